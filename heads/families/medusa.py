"""Medusa-1/2 (Cai et al. 2024): heads on the target's last hidden state, head k guessing the token k+1 places
after the next; a static tree of their top-k."""

from __future__ import annotations

from typing import Any

from selfspec.heads.family import Family


def describe(config: Any) -> str:
    return f"{config.num_heads} Medusa heads x {config.num_layers} residual block(s)"


FAMILY = Family(
    kind="medusa",
    title="Medusa",
    drafter="selfspec.heads.medusa:MedusaHeads",
    proposer="selfspec.infer.drafters.proposers:medusa_proposer",
    describe=describe,
    formats=("fastdecoding-medusa", "vllm-medusa"),
    detect="selfspec.heads.formats.medusa:detect_medusa_format",
    importer="selfspec.heads.formats.medusa:import_medusa",
    exporter="selfspec.heads.formats.medusa_export:export_as",
    carried={"fastdecoding-medusa": frozenset({"base_model"}), "vllm-medusa": frozenset({"base_model"})},
    recipe="medusa",
    recipe_config="selfspec.train.recipes.medusa:MedusaConfig",
    meta_drafter="selfspec.train.recipes.medusa:new_heads",
    activation_bytes="selfspec.train.parallel.memory_activations:medusa_bytes",
)
