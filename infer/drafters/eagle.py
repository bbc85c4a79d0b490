"""EAGLE-1/2 and EAGLE-3 decoding: the EAGLE drafters on the shared feature-drafting machinery
(infer/drafters/feature_drafter.py), as a static tree of paths (EAGLE-1) or EAGLE-2's dynamic tree."""

from __future__ import annotations

from torch import nn

from selfspec.heads.eagle import EagleDraft
from selfspec.infer.drafters.feature_drafter import FeatureDrafter


class EagleProposer(FeatureDrafter):
    """Drafts with an `EagleDraft` (or `Eagle3Draft`) on the target's features. EAGLE-3 reads fused target
    layers and drafts in its own vocabulary."""

    label = "EAGLE"


def eagle_proposer(
    draft: EagleDraft,
    model: nn.Module,
    tree: list[list[int]] | None = None,
    dynamic: bool = False,
    **tree_options: int | None,
) -> EagleProposer:
    """The EAGLE-1/2 and EAGLE-3 families' proposer: `tree` (else the drafter's own) is a static tree of
    paths; without one, or with `dynamic` (what `selfspec tune` measures), `tree_options` (depth, top_k,
    total_tokens) shape EAGLE-2's dynamic tree."""
    choices = None if dynamic else tree if tree is not None else draft.config.tree
    return EagleProposer(
        draft, model.get_input_embeddings(), model.get_output_embeddings(), choices=choices, **tree_options
    )
