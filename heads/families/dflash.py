"""DFlash (block diffusion drafting): one drafter forward fills a block of masked positions from fused target
features; decoded as the block's chain or a tree of each position's top-k."""

from __future__ import annotations

from typing import Any

from selfspec.heads.family import Family, check_fused


def describe(config: Any) -> str:
    return (
        f"DFlash block-parallel drafter: fc over target layers {[i - 1 for i in config.feature_layers]} "
        f"(target_layer_ids) + {config.num_layers} decoder layer(s), blocks of {config.block_size} "
        f"(mask token {config.mask_token_id})"
    )


def check(config: Any) -> None:
    check_fused(config)
    if config.block_size < 2:
        raise ValueError(
            f"a DFlash block holds the last accepted token and at least one mask: block_size must "
            f"be >= 2, got {config.block_size}"
        )
    if config.mask_token_id is None or not 0 <= config.mask_token_id < config.vocab_size:
        raise ValueError(
            f"a dflash config needs `mask_token_id`, an embedding row of the target's vocabulary "
            f"(0..{config.vocab_size - 1}) it never writes as text, got {config.mask_token_id}"
        )
    if config.depth > config.block_size - 1:
        raise ValueError(
            f"a DFlash tree is at most block_size - 1 = {config.block_size - 1} deep (one level per "
            f"masked position), got depth {config.depth}"
        )


def decoded_as_chain(config: Any) -> bool:
    """Whether the config's tree is the block's chain, which is how its exports are decoded."""
    return config.top_k == 1 and config.depth == config.total_tokens == config.block_size - 1


FAMILY = Family(
    kind="dflash",
    title="DFlash",
    drafter="selfspec.heads.dflash:DFlashDraft",
    proposer="selfspec.infer.drafters.dflash:dflash_proposer",
    describe=describe,
    check=check,
    settings=frozenset({"feature_layers", "qk_norm", "mask_token_id"}),
    dynamic_tree=True,
    tune_grid="selfspec.infer.measure.tune:block_grid",
    formats=("dflash", "speculators-dflash"),
    detect="selfspec.heads.formats.dflash:detect_dflash_format",
    importer="selfspec.heads.formats.dflash:import_dflash",
    exporter="selfspec.heads.formats.dflash_export:export_as",
    carried={"dflash": frozenset(), "speculators-dflash": frozenset({"base_model"})},
    detect_first=True,
    exported_tree=decoded_as_chain,
    recipe="dflash",
    recipe_config="selfspec.train.recipes.dflash:DFlashConfig",
)
