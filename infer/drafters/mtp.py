"""Decoding with the target's own MTP layers (heads/mtp.py): the shared feature drafter
(infer/drafters/feature_drafter.py) over the layers' own KV cache, a transformers Cache of preallocated layers
(infer/core/cache.py) that grows a tree of each depth's top-k (EAGLE-2's dynamic tree; top_k 1: the chain
transformers' MTP generator drafts)."""

from __future__ import annotations

import torch
from torch import nn

from selfspec.heads.mtp import MtpDraft
from selfspec.infer.core.cache import PreallocatedCache
from selfspec.infer.drafters.feature_drafter import FeatureDrafter


class MtpCache(PreallocatedCache):
    """The MTP layer's keys and values, as the feature drafter reads and moves a drafter's cache: one `length`
    for its layers (a layer writes after it and the forward advances it), rows moved or dropped in place."""

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    @length.setter
    def length(self, value: int) -> None:
        for layer in self.layers:
            layer._set_length(value)

    def keep_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:  # type: ignore[override]
        super().keep_rows(src, dst, self.length)


class MtpProposer(FeatureDrafter):
    """Drafts with a target's MTP layers on its last hidden states, every depth through MTP layer 0."""

    label = "MTP"

    def new_cache(self, capacity: int, rows: int) -> MtpCache:
        return MtpCache(capacity)


def mtp_proposer(
    draft: MtpDraft,
    model: nn.Module,
    tree: list[list[int]] | None = None,
    dynamic: bool = False,
    **tree_options: int | None,
) -> MtpProposer:
    """The MTP family's proposer: the dynamic tree of `tree_options` (depth, top_k, total_tokens; default the
    drafter's), or a static `tree` of paths."""
    draft.bind(model.get_output_embeddings())
    choices = None if dynamic else tree if tree is not None else draft.config.tree
    return MtpProposer(
        draft, model.get_input_embeddings(), model.get_output_embeddings(), choices=choices, **tree_options
    )


def mtp_grid(config: object) -> list[tuple[int, int, int]]:
    """`selfspec tune`'s grid for MTP layers: chains of 1 to 4 (what the engines draft) and narrow trees."""
    return [(d, 1, d) for d in (1, 2, 3, 4)] + [(d, k, t) for d in (2, 3, 4) for k in (2, 4) for t in (8, 16)]
