"""DFlash drafters written in the `dflash` (z-lab) and `speculators-dflash` layouts: the config.json each
engine's loader reads and the weights under the published names (the layouts and their sources:
heads/formats/dflash.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from selfspec.heads.dflash import DFlashDraft
from selfspec.heads.formats.dflash import DFLASH_FORMATS, EMBED_KEY, LAYOUTS, LM_HEAD_KEY
from selfspec.heads.formats.eagle3_export import (
    fused_layers_for,
    llama_layer_json,
    speculators_config,
    target_tensor,
    verifier_name,
    write_checkpoint,
)


def qwen3_layer_json(draft: DFlashDraft) -> dict[str, Any]:
    """The draft layers' Qwen3 config: the Llama fields they are built from, all layers full attention."""
    layers = draft.config.num_layers
    return llama_layer_json(draft) | {
        "model_type": "qwen3",
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "layer_types": ["full_attention"] * layers,
    }


def dflash_config_json(
    draft: DFlashDraft,
    fmt: str,
    base_model: str = "",
    num_target_layers: int | None = None,
    verifier_architectures: list[str] | None = None,
) -> dict[str, Any]:
    """The config.json `fmt`'s loaders read (see heads/formats/dflash.py for the sources)."""
    cfg = draft.config
    layer_ids = [j - 1 for j in cfg.feature_layers]  # the published convention: decoder layer outputs
    if fmt == "dflash":
        return {
            "architectures": [LAYOUTS[fmt].architecture],
            **qwen3_layer_json(draft),
            "block_size": cfg.block_size,
            **({"num_target_layers": num_target_layers} if num_target_layers else {}),
            "dflash_config": {
                "mask_token_id": cfg.mask_token_id,
                "target_layer_ids": layer_ids,
                "block_size": cfg.block_size,
                "causal": False,
            },
        }
    return {
        "architectures": [LAYOUTS[fmt].architecture],
        "speculators_model_type": "dflash",
        "transformer_layer_config": qwen3_layer_json(draft),
        "draft_vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": list(cfg.feature_layers),
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": True,  # vLLM 0.32 reads false as causal on every layer
        "sample_from_anchor": False,
        "speculators_config": speculators_config(
            "dflash", cfg.block_size - 1, base_model, verifier_architectures
        ),
    }


def export_dflash(
    draft: DFlashDraft,
    fmt: str,
    out_dir: str | Path,
    weights: str = "safetensors",
    base_model: str | None = None,
    target: nn.Module | None = None,
) -> None:
    """Write `draft` as a `dflash` or `speculators-dflash` checkpoint: config.json + weights.

    `target`, when given, checks the fused layers against its depth and supplies `num_target_layers` and the
    verifier's architectures; speculators-dflash needs it, as it carries the target's `embed_tokens.weight`
    and `lm_head.weight`. `base_model` (speculators-dflash) is the verifier config.json names, default the
    drafter's own."""
    if fmt not in LAYOUTS:
        raise ValueError(f"unknown DFlash format {fmt!r}; choose one of {', '.join(DFLASH_FORMATS)}")
    cfg = draft.config
    if not cfg.qk_norm:
        raise ValueError(
            "this drafter's layers have no q_norm/k_norm, and vLLM and SGLang build DFlash layers as "
            "Qwen3 layers, which have them: train with --qk_norm true for a drafter they serve"
        )
    if LAYOUTS[fmt].carries_target and target is None:
        raise ValueError(
            f"a {fmt} checkpoint carries the target's embed_tokens and lm_head: give the target "
            "(--model, or target=)"
        )
    num_layers = fused_layers_for(draft, target)
    archs = list(getattr(target.config, "architectures", None) or []) if target is not None else []
    state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    base = ""
    if LAYOUTS[fmt].carries_target:
        dtype = state["fc.weight"].dtype
        state[EMBED_KEY] = target_tensor(target.get_input_embeddings().weight, EMBED_KEY, draft, dtype)
        state[LM_HEAD_KEY] = target_tensor(target.get_output_embeddings().weight, LM_HEAD_KEY, draft, dtype)
        base = verifier_name(base_model or cfg.base_model)
    write_checkpoint(out_dir, state, weights, dflash_config_json(draft, fmt, base, num_layers, archs))


def export_as(
    draft: DFlashDraft,
    fmt: str,
    out_dir: str | Path,
    target: nn.Module | None = None,
    base_model: str | None = None,
    weights: str | None = None,
) -> None:
    """`export_heads` for the DFlash layouts (z-lab's names no target; speculators' names the verifier)."""
    export_dflash(draft, fmt, out_dir, weights=weights or "safetensors", base_model=base_model, target=target)
