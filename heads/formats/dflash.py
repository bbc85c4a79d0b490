"""DFlash drafters in the published layouts: import them here, export ours (heads/formats/dflash_export.py).

`DFlashDraft` already uses the published tensor names (`fc.weight`, `hidden_norm.weight`, `norm.weight`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.{input,post_attention}_layernorm.weight`) and
computes the published layer, so no tensor is converted; a layout is its config.json and which of the target's
tensors it carries. Sources (read for this module, versions named):

`dflash` — z-lab's layout (z-lab/*-DFlash on the Hub; the checkpoints SpecForge writes).
  - config.json: a Qwen3 config of the draft layers (`model_type: "qwen3"`, `num_hidden_layers` = draft
    layers, `layer_types`), `architectures: ["DFlashDraftModel"]`, `block_size` at the top level (Qwen3.5-era
    checkpoints put it in `dflash_config`), `num_target_layers`, and `dflash_config: {mask_token_id,
    target_layer_ids}`; the weights carry neither the embedding nor an lm_head (the target's are used).
  - Layer ids: `target_layer_ids` name decoder layers; the drafter reads each one's OUTPUT, transformers'
    hidden_states[id + 1] (z-lab `extract_context_feature`; vLLM 0.32.0
    `model_executor/models/qwen3_dflash.py` and `v1/worker/gpu_model_runner.py` add 1; speculators' converter
    writes id + 1; SGLang's `dflash.py` captures layer id + 1). Our `feature_layers` are hidden_states
    indices: target_layer_ids + 1.
  - vLLM 0.32.0 (the PyPI wheel) `qwen3_dflash.py`: the registry maps DFlashDraftModel there; the context's
    keys/values are the k/v projections (k_norm, RoPE) of `hidden_norm(fc(features))`; the block's queries,
    keys and values go through `input_layernorm`; q_norm is required (Qwen3 layers); a layer is causal when
    `is_causal` or `dflash_config.causal` says so, else when `layer_types[i]` is sliding attention, else not;
    a missing `embed_tokens` / `lm_head` is the target's; `mask_embedding.pt` would override the mask row.

`speculators-dflash` — vllm-project/speculators' layout.
  - speculators 0.9.0 (the PyPI wheel) `models/dflash/config.py` (`DFlashSpeculatorConfig`):
    `speculators_model_type: "dflash"`, `architectures: ["DFlashSpeculator"]`, `transformer_layer_config` (a
    Qwen3 config), `draft_vocab_size`, `block_size`, `target_hidden_size`, `aux_hidden_state_layer_ids`,
    `mask_token_id`, `sliding_window_non_causal`, `sample_from_anchor`; `speculators_config` as for EAGLE-3
    with `speculative_tokens` = block_size − 1. `models/dflash/core.py`: fc over
    `len(aux_hidden_state_layer_ids)` hidden states; the embedding is the verifier's;
    `convert/dflash/converter.py`: aux ids = z-lab ids + 1 (hidden_states indices). We write the target's
    `embed_tokens.weight` and `lm_head.weight` too: the file then decodes in a loader that does not fetch the
    verifier.
  - vLLM 0.32.0 `transformers_utils/configs/speculators/algos.py` `update_dflash`: DFlashDraftModel with
    `eagle_aux_hidden_state_layer_ids` = aux ids and `dflash_config.target_layer_ids` = aux ids − 1, and
    `dflash_config.causal = not sliding_window_non_causal` with the flag TRUE WHEN ABSENT — an explicit false
    makes vLLM run every layer causally, so export writes true (speculators applies it to sliding-window
    layers only; ours are all full attention).

Refused on import, in one line naming it: sliding-window or causal layers, `sample_from_anchor`, a separate
mask embedding, a draft vocabulary (d2t/t2d), fused qkv projections, a target hidden size other than the
drafter's, attention biases.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from selfspec.heads.config import DTYPES, HeadsConfig
from selfspec.heads.dflash import DFlashDraft
from selfspec.heads.formats.checkpoint import Checkpoint
from selfspec.heads.formats.eagle import check_target, layer_config_from_json
from selfspec.heads.formats.eagle3_config import int_list
from selfspec.heads.formats.medusa import load_strict

EMBED_KEY, LM_HEAD_KEY = "embed_tokens.weight", "lm_head.weight"
MASK_EMBEDDING = "mask_embedding.pt"
QWEN3_ONLY = (
    "architectures",
    "auto_map",
    "block_size",
    "dflash_config",
    "num_target_layers",
    "layer_types",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "attention_dropout",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "transformers_version",
)


@dataclasses.dataclass(frozen=True)
class Layout:
    architecture: str  # config.json `architectures`
    carries_target: bool  # the target's embed_tokens and lm_head are in the weights


LAYOUTS = {
    "dflash": Layout("DFlashDraftModel", False),
    "speculators-dflash": Layout("DFlashSpeculator", True),
}
DFLASH_FORMATS = tuple(LAYOUTS)


def detect_dflash_format(directory: str | Path | Checkpoint) -> str | None:
    """ "dflash" or "speculators-dflash" for a DFlash checkpoint directory; None for anything else."""
    checkpoint = Checkpoint.read(directory)
    raw = checkpoint.config
    if raw is None or checkpoint.is_selfspec or not checkpoint.weight_files:
        return None
    if raw.get("speculators_model_type") == "dflash":
        return "speculators-dflash"
    if "DFlashDraftModel" in (raw.get("architectures") or []) or isinstance(raw.get("dflash_config"), dict):
        return "dflash"
    return None


# ---------------------------------------------------------------- reading config.json


def _settings(raw: dict[str, Any], fmt: str, where: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the draft layers' Qwen3 config, the DFlash fields: block_size, mask_token_id, feature_layers,
    verifier)."""
    if fmt == "speculators-dflash":
        layer_json = raw.get("transformer_layer_config")
        if not isinstance(layer_json, dict):
            raise ValueError(
                f"{where}: transformer_layer_config (the draft layers' config) must be a JSON object"
            )
        if raw.get("sample_from_anchor"):
            raise ValueError(
                f"{where}: sample_from_anchor is true (the anchor position drafts a token too), which "
                "DFlashDraft does not compute: its block drafts from the masked positions only"
            )
        ids = int_list(raw.get("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids", where)
        verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""
        fields = {
            "block_size": raw.get("block_size"),
            "mask_token_id": raw.get("mask_token_id"),
            "feature_layers": ids,
            "base_model": str(verifier),
        }
    else:
        layer_json = {k: v for k, v in raw.items() if k not in QWEN3_ONLY}
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ValueError(f"{where}: dflash_config must be a JSON object")
        for key, problem in (
            ("causal", "causal draft layers"),
            ("use_swa", "sliding-window draft layers"),
            ("sample_from_anchor", "drafting from the anchor position"),
        ):
            if dflash.get(key):
                raise ValueError(
                    f"{where}: dflash_config.{key} is true ({problem}), which DFlashDraft does not "
                    "compute: its layers attend over the whole block and context"
                )
        ids = int_list(dflash.get("target_layer_ids"), "dflash_config.target_layer_ids", where)
        fields = {
            "block_size": raw.get("block_size", dflash.get("block_size")),
            "mask_token_id": dflash.get("mask_token_id", raw.get("mask_token_id")),
            "feature_layers": [i + 1 for i in ids],
            "base_model": "",
        }
        _refuse_sliding(raw, where)
    _refuse_sliding(layer_json, where)
    if layer_json.get("is_causal") or raw.get("is_causal"):
        raise ValueError(f"{where}: is_causal is true; DFlashDraft's block attention is bidirectional")
    if layer_json.get("model_type", "qwen3") not in ("qwen3", "llama"):
        raise ValueError(
            f"{where}: the draft layers are {layer_json['model_type']!r}; DFlashDraft computes Qwen3 "
            "(or Llama) decoder layers"
        )
    hidden = raw.get("target_hidden_size")
    if hidden not in (None, layer_json.get("hidden_size")):
        raise ValueError(
            f"{where}: target_hidden_size {hidden} differs from the draft layers' hidden_size "
            f"{layer_json.get('hidden_size')}; DFlashDraft is as wide as its target"
        )
    for key in ("block_size", "mask_token_id"):
        if type(fields[key]) is not int:
            raise ValueError(f"{where}: {key} must be an integer, got {fields[key]!r}")
    return layer_json, fields


def _refuse_sliding(config: dict[str, Any], where: Path) -> None:
    kinds = config.get("layer_types") or []
    if config.get("use_sliding_window") or any(kind != "full_attention" for kind in kinds):
        raise ValueError(
            f"{where}: the draft layers use sliding-window attention (use_sliding_window / layer_types "
            f"{sorted(set(kinds))}), which DFlashDraft does not compute"
        )


# ---------------------------------------------------------------- import


def import_dflash(
    directory: str | Path | Checkpoint,
    format: str | None = None,  # noqa: A002
    base_model: str | None = None,
    target: nn.Module | None = None,
) -> DFlashDraft:
    """Build a `DFlashDraft` from a `dflash` (z-lab) or `speculators-dflash` checkpoint directory.

    Shapes come from config.json and the weights; the tensors keep the file's dtype. `base_model` is what the
    imported config names as the target (default: the speculators verifier, else nothing). The embedding and
    lm_head a file carries are the target's: dropped, and with `target` compared against its own (a warning
    when they differ); a drafter for another hidden or vocabulary size is refused."""
    checkpoint = Checkpoint.read(directory)
    directory, raw = checkpoint.path, checkpoint.require_config()
    where_cfg = directory / "config.json"
    fmt = format or detect_dflash_format(checkpoint)
    if fmt not in LAYOUTS:
        raise ValueError(
            f"{directory} is not a DFlash checkpoint this importer recognises (architectures "
            "DFlashDraftModel with a dflash_config, or speculators_model_type dflash)"
            if fmt is None
            else f"unknown DFlash format {fmt!r}; supported: {', '.join(DFLASH_FORMATS)}"
        )
    if (directory / MASK_EMBEDDING).exists():
        raise ValueError(
            f"{directory / MASK_EMBEDDING}: a separately trained mask embedding, which DFlashDraft "
            "does not read (it embeds the mask with the target's row mask_token_id)"
        )
    layer_json, fields = _settings(raw, fmt, where_cfg)
    files = checkpoint.weight_files
    where = files[0] if len(files) == 1 else directory
    state = {k: v for k, v in checkpoint.read_weights().items() if not k.endswith("rotary_emb.inv_freq")}
    embed, lm_head = state.pop(EMBED_KEY, None), state.pop(LM_HEAD_KEY, None)
    for bad, why in (
        ("qkv_proj", "fused qkv projections"),
        ("d2t", "a draft vocabulary (d2t/t2d)"),
        ("t2d", "a draft vocabulary (d2t/t2d)"),
        (".bias", "biases"),
    ):
        if any(bad in k for k in state):
            raise ValueError(
                f"{where} holds {why}, which DFlashDraft does not have: "
                f"{sorted(k for k in state if bad in k)[:3]}"
            )
    fc = state.get("fc.weight")
    hidden = layer_json.get("hidden_size")
    if (
        fc is None
        or fc.dim() != 2
        or fc.shape[0] != hidden
        or fc.shape[1] != hidden * len(fields["feature_layers"])
    ):
        found = None if fc is None else tuple(fc.shape)
        raise ValueError(
            f"{where}: fc.weight is {found}; the config's hidden_size {hidden} and "
            f"{len(fields['feature_layers'])} target layers make it "
            f"({hidden}, {hidden * len(fields['feature_layers'])})"
        )
    qk_norm = any(k.endswith("self_attn.q_norm.weight") for k in state)
    named = (
        layer_json.get("torch_dtype"),
        layer_json.get("dtype"),
        raw.get("torch_dtype"),
        str(fc.dtype).removeprefix("torch."),
    )
    block = fields["block_size"]
    layer = layer_config_from_json(layer_json, where_cfg)
    try:
        config = HeadsConfig(
            kind="dflash",
            base_model=base_model if base_model is not None else fields["base_model"],
            hidden_size=hidden,
            vocab_size=layer_json.get("vocab_size"),
            num_layers=layer_json.get("num_hidden_layers", 1),
            dtype=next((d for d in named if d in DTYPES), "float32"),
            layer=layer,
            feature_layers=fields["feature_layers"],
            block_size=block,
            mask_token_id=fields["mask_token_id"],
            qk_norm=qk_norm,
            fc_bias=False,
            depth=block - 1,
            top_k=1,
            total_tokens=block - 1,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where_cfg}: {e}") from None
    draft = DFlashDraft(config).to(fc.dtype)
    load_strict(draft, state, where)
    draft.eval()
    if target is not None:
        check_target(config, target, embed, directory)
        _check_lm_head(target, lm_head, directory)
    return draft


def _check_lm_head(target: nn.Module, lm_head: torch.Tensor | None, directory: Path) -> None:
    mine = target.get_output_embeddings().weight.detach()
    if lm_head is not None and (
        mine.shape != lm_head.shape
        or not torch.allclose(lm_head.float().cpu(), mine.float().cpu(), rtol=1e-2, atol=1e-3)
    ):
        warnings.warn(
            f"{directory}: its lm_head differs from the target's: DFlashDraft drafts through the "
            "target's lm_head, so the file's was trained for another model",
            stacklevel=3,
        )
