"""The seed paper's drafter (Leviathan et al. 2023): a separate small causal LM proposes a chain.

Greedy decoding drafts the draft model's argmax; sampling draws each token from the draft's own
distribution q (warped like the target's: temperature, top-k, top-p) and hands q to verification,
which accepts with min(1, p/q) and resamples from (p - q)+.

Every row of a batch drafts in the same forwards: one feed of each row's new context (right-padded, written at
one shared cache column, then moved down to the row's own end, as the target's cache is kept by the decode
loop) and one forward per further drafted token. The draft model's cache holds only confirmed context: the
drafted tokens are dropped after each step and those the target accepted come back in the next feed. Sampled
output has the target's distribution in any batch; a seeded row's draws see its draft distribution q through
the batch's float rounding, so the same seed may sample another path in another batch (decode the row alone
to reproduce it bit for bit).
"""

from __future__ import annotations

import torch
from torch import nn

from selfspec.infer.core.cache import new_cache
from selfspec.infer.core.mask import RowMask
from selfspec.infer.core.rows import upload
from selfspec.infer.core.target import Target
from selfspec.infer.core.tree import chain_choices, tree_from_choices
from selfspec.infer.core.verify import SamplingParams, draw, target_probs
from selfspec.infer.drafters.drafter import Draft, Drafter


class DraftModelProposer(Drafter):
    """Drafts `num_tokens` (gamma) tokens as a chain with a small LM sharing the target's vocabulary, for
    every row of the batch at once."""

    name = "draft_model"

    def __init__(self, draft_model: nn.Module, num_tokens: int = 4, vocab_size: int | None = None) -> None:
        if num_tokens < 1:
            raise ValueError(f"the draft model must propose at least one token, got num_tokens={num_tokens}")
        self.draft = Target(draft_model)
        if vocab_size is not None and self.draft.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model has {self.draft.vocab_size} vocabulary rows but the target has "
                f"{vocab_size}: a draft model must share the target's tokenizer"
            )
        self.num_tokens = num_tokens
        self.max_nodes = num_tokens + 1
        self.device = self.draft.device
        self.tree = tree_from_choices(chain_choices(num_tokens)).to(self.device)

    def start(
        self, rows: int, max_length: int, params: SamplingParams, generators: list[torch.Generator | None]
    ) -> None:
        """A batch starts: row b's context will sit in columns starts[b] .. filled[b] - 1 of one cache (its
        prompt left-padded to the longest, as the target's)."""
        self.params, self.generators = params, generators
        self.cache = new_cache(self.draft.model, max_length + 2 * self.max_nodes)
        self.mask = RowMask(rows, self.max_nodes, self.cache.max_length, self.draft.dtype, self.device)
        self.starts: list[int] = []
        self.filled: list[int] = []

    def keep_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """Go on with rows `keep` only, in that order (`index`: the same on the device); before the first
        draft (rows that stopped at their first token) there is nothing to move yet."""
        index = index.to(self.device)  # the loop's is on the target's lm_head device
        self.cache.select_rows(keep, index)
        self.mask.select_rows(keep, index, max(self.filled, default=0))
        if not self.filled:
            return
        self.starts = [self.starts[i] for i in keep]
        self.filled = [self.filled[i] for i in keep]

    @torch.no_grad()
    def propose(
        self, active: list[bool], contexts: list[torch.Tensor], hiddens: list[torch.Tensor]
    ) -> list[Draft | None]:
        """Every active row's chain: the rows' new context in one forward (after `observe`'s prefill), then
        one forward per drafted token after the first."""
        if not any(active):
            return [None] * len(contexts)
        logits = self._feed(active, contexts)  # (B, V)
        base = self.cache.get_seq_length()
        drafted, probs = [], []
        for i in range(self.num_tokens):
            token, q = self._pick(logits, active)
            drafted.append(token)
            probs.append(q)
            if i + 1 < self.num_tokens:  # token i goes in at column base + i, after the row's own end
                visible = torch.ones(len(contexts), 1, i + 1, dtype=torch.bool, device=self.device)
                places = [f - s + i if on else 0 for f, s, on in zip(self.filled, self.starts, active)]
                positions = upload(places, self.device)  # an inactive row may be at the position limit
                mask = self.mask.at(base, visible)
                logits = self.draft.verify_rows(
                    token[:, None], positions[:, None], mask, self.cache, hidden=False
                )[0][:, -1]
        self.mask.hide(base, self.num_tokens)
        self.cache.set_length(base)  # the drafted tokens are dropped (overwritten next time)
        roots = torch.stack([c[-1] for c in contexts]).to(self.device)
        tokens = torch.cat([roots[:, None], torch.stack(drafted, dim=1)], dim=1)  # (B, N)
        device = contexts[0].device  # what it hands back sits where the context is
        if self.tree.depths.device != device:
            self.tree = self.tree.to(device)
        if self.params.greedy:
            return [Draft(row.to(device), self.tree) if on else None for row, on in zip(tokens, active)]
        q = torch.stack(probs, dim=1)  # (B, num_tokens, V)
        q = torch.cat([torch.zeros_like(q[:, :1]), q], dim=1).to(device)
        return [Draft(row.to(device), self.tree, p) if on else None for row, p, on in zip(tokens, q, active)]

    def observe(self, new: list[list[int]]) -> None:
        """At a generation's start (each row's prompt and first token, on the host): the prompts, left-padded
        to the longest, through the draft model once, in the loop's prefill step; the first token is fed by
        the first `propose`. Later steps' tokens come with `propose`'s contexts."""
        if self.filled:
            return
        prompts = [row[:-1] for row in new]
        T = max(len(p) for p in prompts)
        self.starts, self.filled = [T - len(p) for p in prompts], [T] * len(prompts)
        ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts]).to(self.device)
        start = upload(self.starts, self.device)
        self.draft.prefill_rows(ids, self.cache, start if any(self.starts) else None, hidden=False)
        self.mask.open(start, T)

    def _feed(self, active: list[bool], contexts: list[torch.Tensor]) -> torch.Tensor:
        """Each active row's context since its last feed, right-padded and written at the shared column, then
        moved to the row's own end -> each row's next-token logits (B, V). An inactive row (near the position
        limit, stopped, or drafted by lookup this step) feeds nothing: what it missed comes with its next
        feed."""
        counts = [
            c.shape[0] - (f - s) if on else 0
            for c, f, s, on in zip(contexts, self.filled, self.starts, active)
        ]
        M, B = max(counts), len(contexts)
        ids = torch.zeros(B, M, dtype=torch.long, device=self.device)
        for b, (c, m) in enumerate(zip(contexts, counts)):
            ids[b, :m] = c[c.shape[0] - m :]
        at = self.cache.get_seq_length()
        cols = torch.arange(M, device=self.device)
        count_t, filled = upload(counts, self.device), upload(self.filled, self.device)
        valid = cols < count_t[:, None]
        causal = torch.ones(M, M, dtype=torch.bool, device=self.device).tril()
        block = (causal[None] & valid[:, None, :]) | torch.eye(M, dtype=torch.bool, device=self.device)
        positions = torch.where(valid, (filled - upload(self.starts, self.device))[:, None] + cols, 0)
        logits, _ = self.draft.verify_rows(ids, positions, self.mask.at(at, block), self.cache, hidden=False)
        newest = logits.gather(1, (count_t - 1).clamp(min=0)[:, None, None].expand(B, 1, logits.shape[-1]))[
            :, 0
        ]
        dst = filled[:, None] + cols
        self.filled = [f + m for f, m in zip(self.filled, counts)]
        self.cache.keep_rows(at + cols.expand(B, M), dst, max(self.filled))
        self.mask.commit(at, M, dst, valid)
        return newest

    def _pick(self, logits: torch.Tensor, active: list[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's drafted token (B,) and, when sampling, the distribution it was drawn from (B, V); an
        inactive row's generator is left alone (its token is discarded)."""
        if self.params.greedy:
            return logits.argmax(-1), None
        q = target_probs(logits, self.params)
        picks = [draw(row, g) if on else row.argmax() for row, g, on in zip(q, self.generators, active)]
        return torch.stack(picks), q
