"""EAGLE-3 (Li et al. 2025): one decoder layer over a fusion of three target layers' hidden states, its own
lm_head over a draft vocabulary, trained with training-time test; EAGLE-2's dynamic tree."""

from __future__ import annotations

from typing import Any

from selfspec.heads.family import Family, check_fused


def describe(config: Any) -> str:
    return (
        f"EAGLE-3 draft model: fc over target layers {config.feature_layers} + one decoder layer, "
        f"draft vocabulary of {config.draft_vocab_size or config.vocab_size} tokens"
    )


FAMILY = Family(
    kind="eagle3",
    title="EAGLE-3",
    drafter="selfspec.heads.eagle3:Eagle3Draft",
    proposer="selfspec.infer.drafters.eagle:eagle_proposer",
    describe=describe,
    check=check_fused,
    settings=frozenset({"feature_layers", "draft_vocab_size", "norm_before_residual", "norm_before_fc"}),
    dynamic_tree=True,
    tune_grid="selfspec.infer.measure.tune:dynamic_grid",
    formats=("eagle3", "speculators-eagle3"),
    detect="selfspec.heads.formats.eagle3:detect_eagle3_format",
    importer="selfspec.heads.formats.eagle3:import_eagle3",
    exporter="selfspec.heads.formats.eagle3_export:export_as",
    carried={"eagle3": frozenset(), "speculators-eagle3": frozenset({"base_model", "depth"})},
    recipe="eagle",
    recipe_config="selfspec.train.recipes.eagle:EagleConfig",
    meta_drafter="selfspec.train.recipes.eagle:new_draft",
    activation_bytes="selfspec.train.parallel.memory_activations:eagle3_bytes",
    vocabulary="learned",
)
