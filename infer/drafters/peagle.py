"""P-EAGLE drafting: one drafter forward per step proposes every depth (heads/peagle.py).

Each step the drafter reads the confirmed pairs (target features, next token) of every row and, after them,
`depth - 1` parallel slots; their keys and values are written at one shared column, the pairs then move down
to each row's own end (as the target's cache does) and the slots are dropped, so the drafter's cache only ever
holds confirmed positions. The last pair's output and the slots' are the distributions of depths 1 .. depth,
verified as
  - a chain (top_k 1): each depth's argmax;
  - a tree of each depth's top_k (infer/drafters/parallel_tree.py), keeping the `total_tokens` most likely.
The tokens are point proposals: sampling verifies them with the target-only rejection rule (lossless).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from selfspec.heads.draft_layers import DraftCache
from selfspec.heads.joined import for_drafting, unjoin
from selfspec.heads.peagle import PEagleDraft
from selfspec.infer.core.mask import RowMask
from selfspec.infer.core.verify import SamplingParams
from selfspec.infer.drafters.confirmed_pairs import ConfirmedPairs, PairFeed
from selfspec.infer.drafters.drafter import Draft, Drafter
from selfspec.infer.drafters.parallel_tree import ParallelTree
from selfspec.infer.drafters.proposers import TREE_OPTIONS, embedding_for


class PEagleProposer(Drafter):
    """Drafts with a `PEagleDraft` on the target's fused layers, a whole batch in one drafter forward per
    step.

    It holds the drafter's cache for the sequence (or batch) being decoded: one generation at a time per
    proposer.
    """

    name = "peagle"

    def __init__(
        self,
        draft: PEagleDraft,
        embed: nn.Module,
        depth: int | None = None,
        top_k: int | None = None,
        total_tokens: int | None = None,
    ) -> None:
        cfg = draft.config
        self.draft = draft.eval()
        self.feature_layers = cfg.feature_layers  # the hidden_states indices the target hands over
        self.device = self.weights_device = next(
            draft.parameters()
        ).device  # the drafter's own; what it reads moves here
        self.embed = embedding_for(embed, self.device)
        self.dtype = next(draft.parameters()).dtype
        depth = depth if depth is not None else cfg.depth
        top_k = top_k if top_k is not None else cfg.top_k
        total = total_tokens if total_tokens is not None else cfg.total_tokens
        for name, value in (("depth", depth), ("top_k", top_k), ("total_tokens", total)):
            if value < 1:
                raise ValueError(f"P-EAGLE {name} must be >= 1, got {value}")
        drafted = cfg.draft_vocab_size or cfg.vocab_size
        if top_k > drafted:
            raise ValueError(
                f"this drafter drafts among {drafted} tokens, fewer than its top_k {top_k}: use at most "
                f"{drafted}"
            )
        draft.check_draft_vocab("this P-EAGLE drafter")  # siblings must be distinct tokens
        self.trees = ParallelTree(depth, top_k, total, self.device, draft.to_target)
        self.depth, self.top_k, self.max_nodes = self.trees.depth, top_k, self.trees.max_nodes
        self.slots = self.depth - 1

    @property
    def lengths(self) -> list[int]:
        """Each row's confirmed positions in the drafter's cache."""
        return self.pairs.lengths

    @property
    def drafter(self) -> torch.nn.Module:
        """The trained module this proposer drafts with (what `selfspec tune` fits a tree for)."""
        return self.draft

    def start(
        self, rows: int, max_length: int, params: SamplingParams, generators: list[torch.Generator | None]
    ) -> None:
        """A batch of `rows` sequences of at most `max_length` tokens starts: row b's confirmed pairs sit in
        columns 0 .. lengths[b] - 1; a call writes at the shared column max(lengths), at most depth + 1 pairs
        and the slots."""
        for_drafting(self.draft)  # its layers join their parameters until `finish` (heads/joined.py)
        queries = self.depth + 1 + self.slots  # the most a step after the prompt writes
        capacity = max_length + queries + 1
        self.cache = DraftCache.for_drafter(self.draft, capacity, batch=rows)
        self.mask = RowMask(rows, queries, capacity, self.dtype, self.device)
        self.pairs = ConfirmedPairs(self.cache, self.mask, rows)

    def finish(self) -> None:
        unjoin(self.draft)

    def keep_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """Go on with rows `keep` only, in that order (`index`: the same on the device)."""
        self.pairs.keep_rows(keep, index)

    @torch.no_grad()
    def propose(
        self, active: list[bool], contexts: list[torch.Tensor], hiddens: list[torch.Tensor]
    ) -> list[Draft | None]:
        """Every row's draft from one drafter forward; rows not `active` feed nothing and get None."""
        B, S, device = len(contexts), self.slots, self.device
        if not any(active):
            return [None] * B
        feed = self.pairs.feed(active, contexts, hiddens, self.dtype, device)
        M = feed.tokens.shape[1]
        slots = feed.last[:, None] + torch.arange(1, S + 1, device=device)
        positions = torch.cat([feed.positions, slots], dim=1)
        block = self._block(feed, S)
        # the prompt: nothing before it to see
        mask = block[:, None] if feed.at == 0 else self.mask.at(feed.at, block)
        out = self.draft(
            self.draft.fuse(feed.feats), feed.tokens, self.embed, mask, positions, self.cache, slots=S
        )
        newest = feed.newest(out)[:, None]
        logits = self.draft.logits(torch.cat([newest, out[:, M:]], dim=1))  # (B, depth, N)
        self.pairs.settle(feed, M + S)  # the slots are dropped (overwritten next step)
        rows = self.trees.rows(torch.stack([c[-1] for c in contexts]), logits)
        return [Draft(*row) if on else None for row, on in zip(rows, active)]

    @staticmethod
    def _block(feed: PairFeed, slots: int) -> torch.Tensor:
        """Who sees whom among one call's M pairs and the slots after them (B, M + S, M + S), True = visible:
        a pair sees the row's pairs up to itself (padding sees itself only), a slot every pair of its row and
        the slots up to itself."""
        B, M = feed.valid.shape
        device = feed.valid.device
        top = torch.cat([feed.pair_block(), torch.zeros(B, M, slots, dtype=torch.bool, device=device)], dim=2)
        own = torch.ones(slots, slots, dtype=torch.bool, device=device).tril().expand(B, slots, slots)
        bottom = torch.cat([feed.valid[:, None, :].expand(B, slots, M), own], dim=2)
        return torch.cat([top, bottom], dim=1)


def peagle_proposer(
    draft: PEagleDraft,
    model: nn.Module,
    tree: list[list[int]] | None = None,
    dynamic: bool = True,
    **tree_options: int | None,
) -> PEagleProposer:
    """The P-EAGLE family's proposer: its tree is built from each depth's top_k, shaped by `tree_options`
    (depth, top_k, total_tokens; top_k 1 is the chain), never a static `tree`."""
    if tree is not None:
        raise ValueError(
            "a P-EAGLE drafter builds its tree from each depth's top_k: shape it with "
            f"{', '.join(TREE_OPTIONS)} (draft_top_k=1: a chain), not `tree`"
        )
    return PEagleProposer(draft, model.get_input_embeddings(), **tree_options)


def peagle_grid(config: Any) -> list[tuple[int, int, int]]:
    """The (depth, top_k, total_tokens) settings `selfspec tune` tries: chains up to the depth trained, and
    trees of each depth's top 2 and 4."""
    deepest = max(config.depth, 2)
    depths = sorted({max(1, deepest // 2), deepest})
    return [(d, 1, d) for d in depths] + [
        (d, k, t) for d in depths for k in (2, 4) for t in (16, 32) if t > d
    ]
