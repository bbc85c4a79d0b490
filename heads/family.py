"""`Family`: everything selfspec knows about one drafter family, declared once (heads/families/<kind>.py) and
read by the layers through the registry (heads/families/__init__.py) instead of `kind` switches.

What lives in infer/ and train/ (the proposer, the training recipe, the memory model) is named by a
"module:attribute" reference and imported when first used, so heads/ never imports infer/ or train/ and a
family's declaration costs nothing to import."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any


def resolve(reference: str) -> Any:
    """The object a "package.module:attribute" reference names."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True)
class Family:
    """One drafter family: its config's `kind`, its classes and functions, its formats and recipes."""

    kind: str  # HeadsConfig.kind, the `kind` of its config.json
    title: str  # the name people know it by, in cards and messages ("EAGLE-3")
    drafter: str  # "module:Class" of its nn.Module (a PretrainedHeads built from a HeadsConfig)
    proposer: (
        str  # "module:function" (heads, target, tree, **tree_options) -> the proposer decoding drafts with
    )
    describe: Callable[[Any], str]  # the card's line on a drafter's shape, from its HeadsConfig
    settings: frozenset[str] = (
        frozenset()
    )  # the family-specific HeadsConfig fields it reads (others stay default)
    check: Callable[[Any], None] | None = (
        None  # its own config checks (ValueError naming the field and the fix)
    )
    dynamic_tree: bool = False  # depth / top_k / total_tokens shape its tree (else a static tree of paths)
    tune_grid: str | None = (
        None  # "module:function" (config) -> the (depth, top_k, total_tokens) `selfspec tune` tries
    )
    # the published layouts it reads and writes (heads/formats/): names, and "module:function" of each step
    formats: tuple[str, ...] = ()
    detect: str | None = None  # (Checkpoint) -> a format name or None
    importer: str | None = None  # (Checkpoint, fmt, base_model, vocab_size) -> the drafter
    exporter: str | None = None  # (drafter, fmt, out_dir, target, base_model, weights) -> None
    carried: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=dict)  # what each layout keeps
    exported_tree: Callable[[Any], bool] | None = None  # whether its layouts' decoding is this config's tree
    detect_first: bool = False  # its layouts hold names another family's detector also matches
    # training: the recipe folder (configs/<recipe>/, launched by train/<recipe>.py) whose config builds it
    recipe: str | None = None
    recipe_config: str | None = None  # "module:Class" of that recipe's config
    meta_drafter: str | None = (
        None  # "module:function" (recipe config, target) -> the drafter it trains (any device)
    )
    activation_bytes: str | None = (
        None  # "module:function" (cfg, target, drafter, rows, length) -> peak bytes
    )
    vocabulary: str = (
        "target"  # "target": drafts over the target's vocabulary; "rows": a subset of its lm_head's
    )
    # rows (d2t, no training); "learned": an lm_head of its own over a draft vocabulary chosen at training

    def load(self, attribute: str) -> Any:
        """The object one of the "module:attribute" fields names; a family without it is a ValueError."""
        reference = getattr(self, attribute)
        if reference is None:
            raise ValueError(f"{self.title} drafters have no {attribute.replace('_', ' ')} in selfspec yet")
        return resolve(reference)


def check_layer(config: Any) -> None:
    """A drafter with decoder layers of its own needs their LlamaConfig fields."""
    if not config.layer:
        raise ValueError(f"an {config.kind} config needs `layer`: the decoder layer's LlamaConfig fields")


def check_fused(config: Any) -> None:
    """A drafter fusing target layers needs its decoder layer's fields and the hidden_states it reads."""
    check_layer(config)
    if not config.feature_layers or min(config.feature_layers) < 0:
        raise ValueError(
            f"an {config.kind} config needs `feature_layers`: the target hidden_states indices its fc "
            f"fuses (e.g. [2, L // 2, L - 3]), got {config.feature_layers}"
        )
