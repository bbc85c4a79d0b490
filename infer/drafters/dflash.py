"""DFlash drafting: one drafter forward per step fills the block [root, MASK × (B − 1)] at once.

Each step the drafter reads the target's fused features of the newly confirmed positions (their keys and
values join its cache, which only ever holds confirmed positions) and the block after them; block position
j's logits are a distribution over the token j places after the root. Those are verified as
  - a chain (top_k 1): each position's argmax, `depth` of them;
  - a tree of each position's top_k: EAGLE-2's selection over candidates whose children at depth d are
    position d's top_k (the positions are drafted in parallel, so every parent shares them), keeping the
    `total_tokens` with the best cumulative log-probability.
The tokens are point proposals: sampling verifies them with the target-only rejection rule (lossless).
"""

from __future__ import annotations

import torch
from torch import nn

from selfspec.heads.dflash import DFlashDraft
from selfspec.heads.draft_layers import DraftCache
from selfspec.heads.joined import for_drafting, unjoin
from selfspec.infer.core.tree import Tree
from selfspec.infer.core.verify import SamplingParams
from selfspec.infer.drafters.drafter import Draft, Drafter, newest_features
from selfspec.infer.drafters.parallel_tree import ParallelTree
from selfspec.infer.drafters.proposers import TREE_OPTIONS, embedding_for


class DFlashProposer(Drafter):
    """Drafts with a `DFlashDraft` on the target's fused layers; a chain when top_k is 1, else a tree.

    It holds the drafter's cache for the sequence (or batch) being decoded: one generation at a time per
    proposer.
    """

    name = "dflash"

    @property
    def drafter(self) -> torch.nn.Module:
        """The trained module this proposer drafts with (what `selfspec tune` fits a tree for)."""
        return self.draft

    def __init__(
        self,
        draft: DFlashDraft,
        embed: nn.Module,
        lm_head: nn.Module,
        depth: int | None = None,
        top_k: int | None = None,
        total_tokens: int | None = None,
    ) -> None:
        cfg = draft.config
        self.draft = draft.eval()
        self.feature_layers = cfg.feature_layers  # the hidden_states indices the target hands over
        self.block = cfg.block_size
        self.device = self.weights_device = next(
            draft.parameters()
        ).device  # by the lm_head; what it reads moves here
        self.embed, self.lm_head = embedding_for(embed, self.device), lm_head
        self.dtype = next(draft.parameters()).dtype
        depth = depth if depth is not None else cfg.depth
        self.top_k = top_k if top_k is not None else cfg.top_k
        total = total_tokens if total_tokens is not None else cfg.total_tokens
        for name, value in (("depth", depth), ("top_k", self.top_k), ("total_tokens", total)):
            if value < 1:
                raise ValueError(f"DFlash {name} must be >= 1, got {value}")
        if depth > self.block - 1:
            raise ValueError(
                f"a DFlash block of {self.block} drafts {self.block - 1} positions: depth {depth} is "
                f"deeper; use at most {self.block - 1}"
            )
        vocab = lm_head.weight.shape[0]
        if self.top_k > vocab:
            raise ValueError(f"top_k {self.top_k} is above the vocabulary of {vocab} tokens")
        self.trees = ParallelTree(depth, self.top_k, total, self.device)
        self.depth, self.max_nodes = self.trees.depth, self.trees.max_nodes

    def _draft(self, roots: torch.Tensor, out: torch.Tensor) -> list[tuple[torch.Tensor, Tree]]:
        """Block outputs at the drafted positions (B, D, H) -> each row's tree tokens (root first) and
        tree."""
        return self.trees.rows(roots, self.draft.logits(out, self.lm_head))

    def start(
        self, rows: int, max_length: int, params: SamplingParams, generators: list[torch.Generator | None]
    ) -> None:
        """A batch of `rows` sequences starts: one drafter cache, row b's confirmed columns
        0 .. lengths[b] − 1. A call writes each row's new context after its own, the block after that, and
        padding past both."""
        for_drafting(self.draft)  # its layers join their parameters until `finish` (heads/joined.py)
        self.cache = DraftCache.for_drafter(self.draft, 2 * max_length + self.block, batch=rows)
        self.lengths = [0] * rows

    def finish(self) -> None:
        unjoin(self.draft)

    def keep_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """Go on with rows `keep` only, in that order (`index`: the same on the device)."""
        self.cache.length = max(self.lengths)
        self.cache.select_rows(keep, index)
        self.lengths = [self.lengths[i] for i in keep]

    @torch.no_grad()
    def propose(
        self, active: list[bool], contexts: list[torch.Tensor], hiddens: list[torch.Tensor]
    ) -> list[Draft | None]:
        """Every row's draft from one drafter forward; rows not `active` feed nothing and get None."""
        if not any(active):
            return [None] * len(contexts)
        counts = [h.shape[0] if on else 0 for h, on in zip(hiddens, active)]
        M, Bk = max(counts), self.block
        starts = [c.shape[0] - 1 for c in contexts]
        feats = newest_features(hiddens, counts, self.dtype, self.device)
        # host-side layout (no device sync): context j of row b at column n_b + j, the block after it, the
        # padding (j >= m_b) after the block, where no row ever looks
        n = torch.tensor(self.lengths)[:, None]
        m = torch.tensor(counts)[:, None]
        j = torch.arange(M)[None]
        columns = torch.cat([torch.where(j < m, n + j, n + Bk + j), n + m + torch.arange(Bk)[None]], dim=1)
        width = max(a + b for a, b in zip(self.lengths, counts)) + Bk
        # additive, made on the host: a boolean mask is converted in each layer's attention, a kernel each
        hidden = torch.arange(width)[None] >= n + m + Bk  # (B, width)
        low = torch.finfo(self.dtype).min
        visible = torch.zeros(hidden.shape, dtype=self.dtype).masked_fill_(hidden, low)
        start = torch.tensor(starts)[:, None]
        ctx_pos = (start - m + j).clamp(min=0)
        blk_pos = start + torch.arange(Bk)[None]
        to = dict(device=self.device, non_blocking=True)
        roots = torch.stack([c[-1] for c in contexts])
        block = self.draft.block_embeds(roots, self.embed, self.dtype)  # (B, Bk, H)
        out = self.draft(
            feats,
            block,
            ctx_pos.to(**to),
            blk_pos.to(**to),
            self.cache,
            columns.to(**to),
            visible.to(**to)[:, None, None, :],
        )
        self.lengths = [a + b for a, b in zip(self.lengths, counts)]
        drafts = self._draft(roots, out[:, 1 : 1 + self.depth])
        return [Draft(*row) if on else None for row, on in zip(drafts, active)]


def dflash_proposer(
    draft: DFlashDraft,
    model: nn.Module,
    tree: list[list[int]] | None = None,
    dynamic: bool = True,
    **tree_options: int | None,
) -> DFlashProposer:
    """The DFlash family's proposer: its tree is built from each block position's top_k, shaped by
    `tree_options` (depth, top_k, total_tokens; top_k 1 is the block's chain), never a static `tree`: it is
    always `dynamic`."""
    if tree is not None:
        raise ValueError(
            "a DFlash drafter builds its tree from each block position's top_k: shape it with "
            f"{', '.join(TREE_OPTIONS)} (draft_top_k=1: a chain), not `tree`"
        )
    return DFlashProposer(draft, model.get_input_embeddings(), model.get_output_embeddings(), **tree_options)
