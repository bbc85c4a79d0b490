"""P-EAGLE (parallel EAGLE): the EAGLE-3 body drafting every depth in one forward, the later depths from a
learned mask embedding and hidden state; decoded as a chain or a tree of each depth's top-k, served by vLLM
with `parallel_drafting`."""

from __future__ import annotations

from typing import Any

from selfspec.heads.family import Family, check_fused


def describe(config: Any) -> str:
    return (
        f"P-EAGLE parallel drafter: fc over target layers {config.feature_layers} + one decoder layer, "
        f"{config.depth} depths per forward, draft vocabulary of "
        f"{config.draft_vocab_size or config.vocab_size} tokens (mask token {config.mask_token_id})"
    )


def check(config: Any) -> None:
    check_fused(config)
    if config.mask_token_id is None or not 0 <= config.mask_token_id < config.vocab_size:
        raise ValueError(
            f"a peagle config needs `mask_token_id`, the embedding row its parallel slots read in vLLM "
            f"(0..{config.vocab_size - 1}, a token the target never writes), got {config.mask_token_id}"
        )


def decoded_as_chain(config: Any) -> bool:
    """Whether the config's tree is a chain, which is how vLLM decodes its exports."""
    return config.top_k == 1 and config.depth == config.total_tokens


FAMILY = Family(
    kind="peagle",
    title="P-EAGLE",
    drafter="selfspec.heads.peagle:PEagleDraft",
    proposer="selfspec.infer.drafters.peagle:peagle_proposer",
    describe=describe,
    check=check,
    settings=frozenset(
        {"feature_layers", "draft_vocab_size", "norm_before_residual", "norm_before_fc", "mask_token_id"}
    ),
    dynamic_tree=True,
    tune_grid="selfspec.infer.drafters.peagle:peagle_grid",
    exported_tree=decoded_as_chain,
    formats=("peagle", "speculators-peagle"),
    detect="selfspec.heads.formats.peagle:detect_peagle_format",
    importer="selfspec.heads.formats.peagle:import_peagle",
    exporter="selfspec.heads.formats.peagle:export_as",
    carried={"peagle": frozenset(), "speculators-peagle": frozenset({"base_model", "depth"})},
    detect_first=True,
    recipe="peagle",
    recipe_config="selfspec.train.recipes.peagle:PEagleConfig",
    vocabulary="learned",
)
