"""The seed paper's drafter (Leviathan et al. 2023): a separate small causal LM proposes a chain.

Greedy decoding drafts the draft model's argmax; sampling draws each token from the draft's own
distribution q (warped like the target's: temperature, top-k, top-p) and hands q to verification,
which accepts with min(1, p/q) and resamples from (p - q)+. The draft model keeps its own KV
cache: tokens it drafted that the target accepted stay in it, the rest are cut off.
"""

from __future__ import annotations

import torch
from torch import nn

from selfspec.infer.core.cache import new_cache, truncate
from selfspec.infer.core.target import Target
from selfspec.infer.core.tree import chain_choices, tree_from_choices
from selfspec.infer.core.verify import SamplingParams, draw, target_probs
from selfspec.infer.drafters.drafter import Draft


class DraftModelProposer:
    """Drafts `num_tokens` (gamma) tokens as a chain with a small LM sharing the target's vocabulary."""

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
        self.tree = tree_from_choices(chain_choices(num_tokens)).to(self.draft.device)
        self.reset(0, SamplingParams(), None)

    def reset(self, max_length: int, params: SamplingParams, generator: torch.Generator | None) -> None:
        self.params, self.generator = params, generator
        self.cache = new_cache(self.draft.model, max_length + self.max_nodes)

    def observe(self, new: list[int]) -> None:
        pass  # it reads the device context: what its cache lacks of it

    def _next(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed `ids` (n,) after the draft model's cache -> its logits (V,) for the next token."""
        return self.draft.prefill_rows(ids[None].to(self.draft.device), self.cache, hidden=False)[0][0]

    def _pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.params.greedy:
            return logits.argmax().view(1), None
        q = target_probs(logits, self.params)
        return draw(q, self.generator).view(1), q

    @torch.no_grad()
    def propose(self, context: torch.Tensor, hiddens: torch.Tensor) -> Draft:
        # the cache holds the last context and the drafted tokens fed after it; what the target accepted
        # is a prefix of that chain, so keep it and feed only the rest (at least the new root)
        keep = min(self.cache.get_seq_length(), context.shape[0] - 1)
        truncate(self.cache, keep)
        logits = self._next(context[keep:])
        drafted, probs = [], []
        for i in range(self.num_tokens):
            token, q = self._pick(logits)
            drafted.append(token)
            probs.append(q)
            if i + 1 < self.num_tokens:
                logits = self._next(token)
        # what it hands back sits where the context is (the target's drafts), wherever the draft model runs
        device = context.device
        tokens = torch.cat([context[-1:], torch.cat(drafted).to(device)])
        if self.tree.depths.device != device:
            self.tree = self.tree.to(device)
        if self.params.greedy:
            return Draft(tokens, self.tree)
        q = torch.stack(probs).to(device)
        return Draft(tokens, self.tree, torch.cat([torch.zeros_like(q[:1]), q]))
