"""How an EAGLE-3 checkpoint's config.json is read: the variant flags each engine assumes (stated or absent),
the target layers the drafter fuses, and the draft-vocabulary maps; the layouts and sources are in
heads/formats/eagle3.py."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from selfspec.heads.draft_layers import draft_targets
from selfspec.shipped.models import resolve_model


@dataclasses.dataclass(frozen=True)
class Variant:
    neutral: Any  # the value Eagle3Draft computes
    means: str  # what any other value changes


# Variant flags Eagle3Draft computes: HeadsConfig fields of the same names (false: SafeAILab's drafter).
FLAGS = ("norm_before_residual", "norm_before_fc")
# Variant flags it does not compute: refused at any other value.
VARIANTS = {
    "fc_norm": Variant(False, "an RMSNorm per fused hidden state (fc_norm.{i}) before fc"),
    "use_aux_norm": Variant(False, "SGLang's older name for fc_norm"),
    "norm_output": Variant(False, "the normed output, not the pre-norm one, is fed to the next draft step"),
    "use_aux_hidden_state": Variant(True, "false: no fc, the drafter reads the target's last hidden state"),
    "bias": Variant(False, "a bias on fc (SGLang) or in attention (vLLM)"),
    "logit_scale": Variant(1.0, "the draft logits are scaled"),
}
# What an engine assumes for a flag a layout leaves out, where that is not the neutral value (vLLM algos.py).
ABSENT = {"speculators-eagle3": {"norm_before_residual": True}}


def settings(
    raw: dict[str, Any], fmt: str, layer_json: dict[str, Any], where: Path
) -> dict[str, tuple[Any, bool]]:
    """Each variant flag (FLAGS and VARIANTS) as the layout's engines read it: (value, whether the file states
    it)."""
    defaults = {f: False for f in FLAGS} | {f: v.neutral for f, v in VARIANTS.items()}
    if fmt == "speculators-eagle3":  # algos.py update_eagle3 copies the top-level flags over the layer config
        top = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
        found = {f: (raw[f], True) for f in top if f in raw} | {
            f: (layer_json[f], True) for f in defaults if f in layer_json and f not in top
        }
    else:
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ValueError(f"{where}: eagle_config must be a JSON object, got {eagle!r}")
        found = {f: (raw[f], True) for f in defaults if f in raw and f != "use_aux_hidden_state"}
        found |= {f: (eagle[f], True) for f in ("norm_before_fc", "use_aux_hidden_state") if f in eagle}
    absent = ABSENT.get(fmt, {})
    return {f: found.get(f, (absent.get(f, neutral), False)) for f, neutral in defaults.items()}


def is_neutral(value: Any, neutral: Any) -> bool:
    if isinstance(neutral, bool):
        return value is neutral
    return type(value) in (int, float) and value == neutral


def refuse_variants(settings: dict[str, tuple[Any, bool]], fmt: str, where: Path) -> None:
    for flag, variant in VARIANTS.items():
        value, stated = settings[flag]
        if not is_neutral(value, variant.neutral):
            how = (
                ""
                if stated
                else f" (it is absent, which vLLM reads as {json.dumps(value)} in a {fmt} config)"
            )
            raise ValueError(
                f"{where}: {flag} = {json.dumps(value)}{how} means {variant.means}; Eagle3Draft does "
                f"not compute that variant, so this drafter cannot be imported"
            )


def flags(settings: dict[str, tuple[Any, bool]], fmt: str, where: Path) -> dict[str, bool]:
    """The FLAGS Eagle3Draft computes, as HeadsConfig fields; an absent one that the layout's engine reads as
    true is warned about (speculators' own config class reads it as false)."""
    flags = {}
    for flag in FLAGS:
        value, stated = settings[flag]
        if type(value) is not bool:
            raise ValueError(f"{where}: {flag} must be true or false, got {json.dumps(value)}")
        if value and not stated:
            warnings.warn(
                f"{where}: {flag} is absent, which vLLM reads as true in a {fmt} config, so it is imported "
                f"as true (speculators' Eagle3SpeculatorConfig defaults it to false): if the drafter was "
                f'trained without it, write "{flag}": false into config.json',
                stacklevel=3,
            )
        flags[flag] = value
    return flags


def target_layers(target: nn.Module | None, base_model: str) -> int | None:
    """The target's layer count L, from the target or from its config when it is on this machine."""
    if target is not None:
        return target.config.get_text_config().num_hidden_layers
    if not base_model:
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolve_model(base_model), local_files_only=True)
    except (OSError, ValueError):
        return None
    return config.get_text_config().num_hidden_layers


def int_list(value: Any, field: str, where: Path) -> list[int]:
    if not isinstance(value, list) or not all(type(i) is int for i in value):
        raise ValueError(f"{where}: {field} must be a list of integers, got {value!r}")
    return value


def feature_layers(raw: dict[str, Any], fmt: str, num_layers: int | None, where: Path) -> list[int]:
    """The hidden_states indices the engines fuse, in the order they concatenate them (increasing)."""
    top = raw.get("eagle_aux_hidden_state_layer_ids") or None
    top = None if top is None else int_list(top, "eagle_aux_hidden_state_layer_ids", where)
    layers = top
    if fmt == "eagle3":
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or None
        if ids is not None:
            layers = [i + 1 for i in int_list(ids, "eagle_config.eagle_aux_hidden_state_layer_ids", where)]
            if top is not None and sorted(top) != sorted(layers):
                raise ValueError(
                    f"{where}: SGLang fuses hidden_states {sorted(layers)} (eagle_config ids {ids} + 1) but "
                    f"vLLM {sorted(top)} (the top-level eagle_aux_hidden_state_layer_ids); which the drafter "
                    "was trained on is unknown: remove the wrong field"
                )
    if layers is None:
        if num_layers is None:
            raise ValueError(
                f"{where} names no eagle_aux_hidden_state_layer_ids, so the engines fuse the target's "
                "hidden_states [2, L // 2, L - 3], and L is unknown: pass the target as --base-model "
                "(base_model=), a local model directory or a Hub id in the HF cache"
            )
        layers = [2, num_layers // 2, num_layers - 3]
    if len(set(layers)) != len(layers):
        raise ValueError(
            f"{where}: the hidden_states indices {layers} repeat one; the engines capture each once"
        )
    layers = sorted(layers)
    if layers[0] < 0:
        raise ValueError(f"{where}: hidden_states indices {layers} must not be negative")
    if num_layers is not None and layers[-1] >= num_layers:
        raise ValueError(
            f"{where}: hidden_states indices {layers} must lie in [0, L - 1 = {num_layers - 1}] "
            "(index L is normed in transformers but not in the engines)"
        )
    return layers


def draft_vocab_maps(
    d2t: torch.Tensor | None, t2d: torch.Tensor | None, size: int, vocab: int, where: Path
) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t as the engines decode with it (zeros when absent: draft id i is target id i), and t2d rebuilt from
    it."""
    d2t = torch.zeros(size, dtype=torch.long) if d2t is None else d2t
    if d2t.shape != (size,) or d2t.is_floating_point() or d2t.is_complex():
        raise ValueError(
            f"{where}: d2t should be {size} integers (one per lm_head row), found {d2t.dtype} "
            f"{tuple(d2t.shape)}"
        )
    targets = draft_targets(d2t, vocab, where)
    rebuilt = torch.zeros(vocab, dtype=torch.bool)
    rebuilt[targets] = True
    if t2d is not None:
        if t2d.shape != (vocab,):
            raise ValueError(
                f"{where}: t2d has shape {tuple(t2d.shape)}, the target vocabulary makes it ({vocab},)"
            )
        if not torch.equal(t2d.bool(), rebuilt):
            warnings.warn(
                f"{where}: t2d does not mark exactly the target ids d2t maps to; the engines decode with "
                "d2t alone, so t2d is rebuilt from it",
                stacklevel=3,
            )
    return d2t.long(), rebuilt
