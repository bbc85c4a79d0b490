"""How a recipe sizes a drafter for its target: the draft vocabulary and the fused target layers.

Shared by the recipes whose drafters fuse target layers and draft in a vocabulary of their own (EAGLE-3,
P-EAGLE), so that both read `--draft_vocab_size` and `--feature_layers` by the same rules.
"""

from __future__ import annotations

from typing import Any

from selfspec.heads.fused_draft import default_feature_layers
from selfspec.train.loop.config import ConfigError


def default_draft_vocab_size(vocab: int) -> int:
    """A quarter of the target's vocabulary, clamped to 2048..32768 (2048 on the demo, 32064 for Llama-3)."""
    return min(max(2048, vocab // 4), 32768)


def draft_vocab_size(requested: int | None, vocab: int, default: bool = True) -> int:
    """The drafter's vocabulary size for a target of `vocab` tokens from `--draft_vocab_size` (None: the
    default size when `default`, else the whole vocabulary); 0 when it is the whole vocabulary."""
    if requested is not None and requested > vocab:
        raise ConfigError(
            f"--draft_vocab_size {requested} is above the target's vocabulary of {vocab} tokens: use "
            f"at most {vocab}, or 0 for the whole vocabulary"
        )
    size = requested if requested is not None else default_draft_vocab_size(vocab) if default else 0
    return size if 0 < size < vocab else 0


def fused_layers(requested: list[int] | None, target: Any) -> list[int]:
    """The target hidden_states indices a fused drafter reads: `--feature_layers`, checked against the
    target's depth, or the default low/middle/high three."""
    layers_in = target.config.get_text_config().num_hidden_layers
    layers = requested or default_feature_layers(layers_in)
    if max(layers) >= layers_in or min(layers) < 0:
        raise ConfigError(
            f"--feature_layers must be hidden_states indices in [0, {layers_in - 1}] "
            f"(the last, {layers_in}, is already normed), got {layers}"
        )
    return layers
