"""DFlash drafters written in the `dflash` (z-lab) and `speculators-dflash` layouts: the config.json each engine's
loader reads and the weights under the published names (the layouts and their sources: heads/formats/dflash.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from selfspec.heads.dflash import DFlashDraft
from selfspec.heads.formats.checkpoint import WEIGHTS
from selfspec.heads.formats.dflash import DFLASH_FORMATS, EMBED_KEY, LAYOUTS, LM_HEAD_KEY
from selfspec.heads.formats.eagle import write_weights
from selfspec.heads.formats.eagle3_export import llama_layer_json, speculators_config, verifier_name
from selfspec.heads.io import atomic_write


def qwen3_layer_json(draft: DFlashDraft) -> dict[str, Any]:
    """The draft layers' Qwen3 config: the Llama fields they are built from, all layers full attention."""
    layers = draft.config.num_layers
    return llama_layer_json(draft) | {
        "model_type": "qwen3", "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": layers, "layer_types": ["full_attention"] * layers}


def dflash_config_json(draft: DFlashDraft, fmt: str, base_model: str = "", num_target_layers: int | None = None,
                       verifier_architectures: list[str] | None = None) -> dict[str, Any]:
    """The config.json `fmt`'s loaders read (see heads/formats/dflash.py for the sources)."""
    cfg = draft.config
    layer_ids = [j - 1 for j in cfg.feature_layers]  # the published convention: decoder layer outputs
    if fmt == "dflash":
        return {"architectures": [LAYOUTS[fmt].architecture], **qwen3_layer_json(draft),
                "block_size": cfg.block_size, **({"num_target_layers": num_target_layers} if num_target_layers else {}),
                "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": layer_ids,
                                  "block_size": cfg.block_size, "causal": False}}
    return {
        "architectures": [LAYOUTS[fmt].architecture], "speculators_model_type": "dflash",
        "transformer_layer_config": qwen3_layer_json(draft), "draft_vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size, "target_hidden_size": None, "aux_hidden_state_layer_ids": list(cfg.feature_layers),
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": True,  # vLLM 0.32 reads false as causal on every layer
        "sample_from_anchor": False,
        "speculators_config": speculators_config("dflash", cfg.block_size - 1, base_model, verifier_architectures),
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
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be 'safetensors' or 'bin', got {weights!r}")
    cfg = draft.config
    if not cfg.qk_norm:
        raise ValueError("this drafter's layers have no q_norm/k_norm, and vLLM and SGLang build DFlash layers as "
                         "Qwen3 layers, which have them: train with --qk_norm true for a drafter they serve")
    layers = list(cfg.feature_layers)
    if layers != sorted(set(layers)):
        raise ValueError(f"feature_layers {layers} must be strictly increasing: the engines concatenate the "
                         "target's layers in order")
    if LAYOUTS[fmt].carries_target and target is None:
        raise ValueError(f"a {fmt} checkpoint carries the target's embed_tokens and lm_head: give the target "
                         "(--model, or target=)")
    num_layers, archs = None, []
    if target is not None:
        num_layers = target.config.get_text_config().num_hidden_layers
        archs = list(getattr(target.config, "architectures", None) or [])
        if layers[-1] >= num_layers:
            raise ValueError(f"feature_layers {layers} include hidden_states[{num_layers}], which transformers norms "
                             "and the engines do not: this drafter cannot run there")
    state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    base = ""
    if LAYOUTS[fmt].carries_target:
        dtype = state["fc.weight"].dtype
        for key, weight in ((EMBED_KEY, target.get_input_embeddings().weight),
                            (LM_HEAD_KEY, target.get_output_embeddings().weight)):
            if tuple(weight.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise ValueError(f"the target's {key} is {tuple(weight.shape)}, this drafter's vocabulary and "
                                 f"width make it {(cfg.vocab_size, cfg.hidden_size)}: give the target it was "
                                 "trained on")
            state[key] = weight.detach().to(device="cpu", dtype=dtype).clone()  # tied targets share one tensor
        base = verifier_name(base_model or cfg.base_model)
    text = json.dumps(dflash_config_json(draft, fmt, base, num_layers, archs), indent=2) + "\n"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_weights(state, out, weights)
    atomic_write(out / "config.json", lambda tmp: Path(tmp).write_text(text))
