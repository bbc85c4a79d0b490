"""MTP: the target's own multi-token-prediction layers (DeepSeek-V3, GLM-4.5, ...) as its drafter, built on
transformers' MtpModel; decoded as EAGLE-2's dynamic tree, every depth reusing MTP layer 0."""

from __future__ import annotations

from typing import Any

from selfspec.heads.family import Family


def describe(config: Any) -> str:
    model_type = (config.layer or {}).get("model_type", "?")
    return (
        f"MTP drafter: the target's own {config.num_layers} multi-token-prediction layer(s) ({model_type} "
        "decoder layers, transformers' MtpLayer), drafting with layer 0 at every depth"
    )


def check(config: Any) -> None:
    if not (config.layer or {}).get("model_type"):
        raise ValueError("an mtp config needs `layer`: the target's config, with its model_type")


FAMILY = Family(
    kind="mtp",
    title="MTP",
    drafter="selfspec.heads.mtp:MtpDraft",
    proposer="selfspec.infer.drafters.mtp:mtp_proposer",
    describe=describe,
    check=check,
    dynamic_tree=True,
    tune_grid="selfspec.infer.drafters.mtp:mtp_grid",
    formats=("mtp",),
    exporter="selfspec.heads.formats.mtp:export_as",
    carried={"mtp": frozenset({"base_model"})},
    recipe="mtp",
    recipe_config="selfspec.train.recipes.mtp:MtpConfig",
)
