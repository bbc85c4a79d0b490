"""EAGLE-3 drafters written in the `eagle3` and `speculators-eagle3` layouts: the config.json each engine's
loader reads and the weights under the layout's names (the layouts and their sources:
heads/formats/eagle3.py)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from selfspec.heads.draft_layers import llama_config
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.formats.checkpoint import WEIGHTS
from selfspec.heads.formats.eagle import CONFIG_FIELDS, rope_scaling_json, write_weights
from selfspec.heads.formats.eagle3 import EAGLE3_FORMATS, EMBED_KEY, LAYOUTS, layout_keys, theirs_name
from selfspec.heads.formats.eagle3_config import VARIANTS
from selfspec.heads.formats.medusa_export import base_model_field
from selfspec.heads.io import PretrainedHeads, atomic_write


def llama_layer_json(draft: PretrainedHeads) -> dict[str, Any]:
    """The draft layer's Llama config, as both layouts' loaders read it (LlamaConfig fields, SafeAILab's
    RoPE)."""
    cfg = draft.config
    lc, rope = llama_config(cfg), dict((cfg.layer or {}).get("rope_parameters") or {})
    config: dict[str, Any] = {"model_type": "llama"} | {field: getattr(lc, field) for field in CONFIG_FIELDS}
    return config | {
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling": rope_scaling_json(rope),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": cfg.dtype,
    }


def verifier_name(base_model: str) -> str:
    """What a speculators config.json names as the verifier, with a warning when that is a path on this
    machine (speculators reads it when it loads the drafter)."""
    base = base_model_field(base_model, required=False)
    if Path(base).is_absolute():
        warnings.warn(
            f"config.json names the verifier as {base}, a path on this machine, which speculators "
            "reads when it loads the drafter: pass --base-model <Hub id> (base_model=) for a "
            "checkpoint that loads elsewhere",
            stacklevel=4,
        )
    return base


def speculators_config(algorithm: str, tokens: int, base_model: str, architectures: list[str] | None) -> dict:
    """speculators' `speculators_config`: a greedy proposal of `tokens` tokens and the verifier it was trained
    for."""
    proposal = {
        "proposal_type": "greedy",
        "speculative_tokens": tokens,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    return {
        "algorithm": algorithm,
        "proposal_methods": [proposal],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": base_model or None, "architectures": list(architectures or [])},
    }


def eagle3_config_json(
    draft: Eagle3Draft, fmt: str, base_model: str = "", verifier_architectures: list[str] | None = None
) -> dict[str, Any]:
    """The config.json `fmt`'s loaders read (see the module docstring for the sources)."""
    cfg = draft.config
    layers, size = list(cfg.feature_layers or []), draft.lm_head.out_features
    if fmt == "eagle3":
        return {
            "architectures": [LAYOUTS[fmt].architecture],
            **llama_layer_json(draft),
            "draft_vocab_size": size,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [j - 1 for j in layers],  # SGLang adds 1
                "use_aux_hidden_state": True,
                "norm_before_fc": cfg.norm_before_fc,
            },  # SGLang and vLLM read it here first
            "eagle_aux_hidden_state_layer_ids": layers,
        }  # vLLM reads this first, as hidden_states indices
    return {
        "architectures": [LAYOUTS[fmt].architecture],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": llama_layer_json(draft),
        "draft_vocab_size": size,
        "target_hidden_size": None,
        # all written out: vLLM reads an absent norm_before_residual as true
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        **{flag: VARIANTS[flag].neutral for flag in ("fc_norm", "norm_output")},
        "eagle_aux_hidden_state_layer_ids": layers,
        "speculators_config": speculators_config("eagle3", cfg.depth, base_model, verifier_architectures),
    }


def fused_layers_for(draft: PretrainedHeads, target: nn.Module | None) -> int | None:
    """The drafter's fused layers checked for an engine (strictly increasing; below the target's depth when
    the target is given) -> the target's layer count L, or None without a target."""
    layers = list(draft.config.feature_layers or [])
    if layers != sorted(set(layers)):
        raise ValueError(
            f"feature_layers {layers} must be strictly increasing: the engines concatenate the "
            "target's hidden states in layer order (vLLM sorts the ids)"
        )
    if target is None:
        return None
    num_layers = target.config.get_text_config().num_hidden_layers
    if layers[-1] >= num_layers:
        raise ValueError(
            f"feature_layers {layers} include hidden_states[{num_layers}], which transformers norms "
            "and the engines do not: this drafter cannot run there"
        )
    return num_layers


def target_tensor(
    weight: torch.Tensor, what: str, draft: PretrainedHeads, dtype: torch.dtype
) -> torch.Tensor:
    """A (vocabulary, width) tensor of the target's that a layout carries, as a CPU copy of its own (tied
    targets share one tensor for two names), refused when its shape is not the drafter's."""
    cfg = draft.config
    if tuple(weight.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(
            f"the target's {what} is {tuple(weight.shape)}, this drafter's vocabulary and width make it "
            f"{(cfg.vocab_size, cfg.hidden_size)}: give the target it was trained on"
        )
    return weight.detach().to(device="cpu", dtype=dtype).clone()


def write_checkpoint(
    out_dir: str | Path, state: dict[str, torch.Tensor], weights: str, config: dict[str, Any]
) -> None:
    """The weights (`weights`: "safetensors" or "bin") and config.json into `out_dir`."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be 'safetensors' or 'bin', got {weights!r}")
    out = Path(out_dir)
    write_weights(state, out, weights)
    text = json.dumps(config, indent=2) + "\n"
    atomic_write(out / "config.json", lambda tmp: Path(tmp).write_text(text))


def export_eagle3(
    draft: Eagle3Draft,
    fmt: str,
    out_dir: str | Path,
    weights: str = "safetensors",
    base_model: str | None = None,
    target: nn.Module | None = None,
) -> None:
    """Write `draft` as an `eagle3` or `speculators-eagle3` checkpoint: config.json + weights (see
    `eagle3_checkpoint`)."""
    state, config = eagle3_checkpoint(draft, fmt, base_model, target)
    write_checkpoint(out_dir, state, weights, config)


def eagle3_checkpoint(
    draft: Eagle3Draft, fmt: str, base_model: str | None = None, target: nn.Module | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """`draft` as an `eagle3` or `speculators-eagle3` checkpoint's tensors and config.json, not yet written.

    `weights` picks `model.safetensors` or `pytorch_model.bin` (what SafeAILab's loader tries first).
    `base_model` (speculators-eagle3) is the verifier config.json names, default the drafter's own; `target`,
    when given, supplies the verifier's architectures and checks the fused layers against its depth, and
    its input embedding, which speculators-eagle3 carries as `embed_tokens.weight` (required there:
    speculators' loader leaves a missing one uninitialised without a word and drafts garbage).
    """
    if fmt not in LAYOUTS:
        raise ValueError(f"unknown EAGLE-3 format {fmt!r}; choose one of {', '.join(EAGLE3_FORMATS)}")
    cfg = draft.config
    layers = list(cfg.feature_layers or [])
    if fmt == "eagle3" and cfg.norm_before_residual:
        raise ValueError(
            "this drafter computes norm_before_residual, which SGLang and SafeAILab do not read (they "
            "take the residual from the un-normed hidden state): export it as speculators-eagle3, "
            "which vLLM serves with that flag"
        )
    if fmt == "speculators-eagle3" and len(layers) != 3:
        raise ValueError(
            f"this drafter fuses {len(layers)} hidden states; vLLM 0.32 builds the fc of a speculators "
            "EAGLE-3 drafter for 3 (llama_eagle3.py, no eagle_config): export it as eagle3"
        )
    if fmt == "speculators-eagle3" and target is None:
        raise ValueError(
            "a speculators-eagle3 checkpoint carries the target's input embedding (embed_tokens.weight), "
            "which speculators' loader otherwise leaves uninitialised without a warning: give the "
            "target (--model, or target=)"
        )
    fused_layers_for(draft, target)
    state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    size = draft.lm_head.out_features
    reduced = size != cfg.vocab_size
    ours = layout_keys(
        "eagle3", draft_vocab=True, norm_before_fc=cfg.norm_before_fc
    )  # it always holds d2t, t2d
    if set(state) != ours:
        raise ValueError(
            f"this drafter has tensors no EAGLE-3 loader reads (e.g. attention biases): "
            f"{sorted(set(state) ^ ours)[:6]}"
        )
    d2t, t2d = state.pop("d2t"), state.pop("t2d")
    targets = torch.arange(size) + d2t
    if not reduced and d2t.any():
        raise ValueError(
            "this drafter's vocabulary is the whole target vocabulary in another order; the engines "
            "read d2t only for a smaller draft vocabulary"
        )
    if not torch.equal(t2d, torch.zeros_like(t2d).index_fill_(0, targets, True)):
        raise ValueError(
            "t2d does not mark exactly the target ids d2t maps to: rebuild them with set_draft_vocab"
        )
    if reduced:
        state |= {"d2t": d2t, "t2d": t2d}
    state = {theirs_name(fmt)(k): v for k, v in state.items()}
    archs = list(getattr(target.config, "architectures", None) or []) if target is not None else []
    base = ""
    if fmt == "speculators-eagle3":
        state[EMBED_KEY] = target_tensor(
            target.get_input_embeddings().weight, "input embedding", draft, state["fc.weight"].dtype
        )
        base = verifier_name(base_model or cfg.base_model)
    return state, eagle3_config_json(draft, fmt, base, archs)


def export_as(
    draft: Eagle3Draft,
    fmt: str,
    out_dir: str | Path,
    target: nn.Module | None = None,
    base_model: str | None = None,
    weights: str | None = None,
) -> None:
    """`export_heads` for the EAGLE-3 layouts (SafeAILab's names no target; speculators' names the
    verifier)."""
    export_eagle3(draft, fmt, out_dir, weights=weights or "safetensors", base_model=base_model, target=target)
