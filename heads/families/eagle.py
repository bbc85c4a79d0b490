"""EAGLE-1/2 (Li et al. 2024): one decoder layer over the target's last hidden state and the next token's
embedding, drafting autoregressively; EAGLE-2's dynamic tree of each step's top-k."""

from __future__ import annotations

from typing import Any

from selfspec.heads.family import Family, check_layer


def describe(config: Any) -> str:
    vocab = f", drafting among {config.draft_vocab_size} tokens" if config.draft_vocab_size else ""
    return (
        f"EAGLE draft model: fc (2H -> H) + {config.num_layers} Llama decoder layer(s) on the target's "
        f"features{vocab}"
    )


FAMILY = Family(
    kind="eagle",
    title="EAGLE-1/2",
    drafter="selfspec.heads.eagle:EagleDraft",
    proposer="selfspec.infer.drafters.eagle:eagle_proposer",
    describe=describe,
    check=check_layer,
    settings=frozenset({"draft_vocab_size"}),
    dynamic_tree=True,
    tune_grid="selfspec.infer.measure.tune:dynamic_grid",
    formats=("eagle1", "sglang-eagle"),
    detect="selfspec.heads.formats.eagle:detect_eagle_format",
    importer="selfspec.heads.formats.eagle:import_eagle",
    exporter="selfspec.heads.formats.eagle:export_as",
    carried={"eagle1": frozenset(), "sglang-eagle": frozenset()},
    recipe="eagle",
    recipe_config="selfspec.train.recipes.eagle:EagleConfig",
    meta_drafter="selfspec.train.recipes.eagle:new_draft",
    vocabulary="rows",
)
