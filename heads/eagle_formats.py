"""EAGLE-1 drafters in the layouts published and served elsewhere: import them, export ours.

Two formats, each taken from its loader's own source (read for this module, versions named):

`eagle1` — SafeAILab's layout (the yuhuili/EAGLE-* checkpoints), which vLLM also serves.
  - SafeAILab/EAGLE `eagle/model/cnets1.py` (the EAGLE-1 `Model`, commit 2174a790):
    `fc = nn.Linear(2H, H, bias=bias)` applied to `torch.cat((inputs_embeds, hidden_states), -1)`:
    the token embedding is the FIRST half of fc's input, as in `heads.eagle.EagleDraft`, so no conversion.
    Layer 0 has no `input_layernorm` (`if self.index != 0`); there is no final norm and no lm_head.
    The model owns `embed_tokens` (frozen), so its state dict carries `embed_tokens.weight`.
  - `eagle/model/ea_model.py` (commits 2320d52e and 47de7b0e): `bias = config.json["bias"]`, True when
    absent; weights from `pytorch_model.bin` (the EAGLE-1 code reads only that, with a strict
    `load_state_dict`), the later code falls back to `model.safetensors` and loads non-strictly.
    `eagle/model/configs.py` (EConfig, 08dc06cc) and the shipped `eagle/train/*.json`: a LlamaConfig-like
    config.json (`num_hidden_layers: 1`); `rope_scaling` must be null or exactly
    {"type": "linear"|"dynamic", "factor": f}; head_dim is always H / heads.
  - vLLM 0.32.0 (the PyPI wheel), `vllm/model_executor/models/llama_eagle.py` (EagleLlamaForCausalLM):
    `config/speculative.py` wraps the draft's config in `transformers_utils/configs/eagle.py` EAGLEConfig,
    which renames `LlamaForCausalLM` to `EagleLlamaForCausalLM` (use `"method": "eagle"`). The loader
    prefixes every name but lm_head with `model.`, stacks q/k/v and gate/up, and builds
    `fc = ReplicatedLinear(2H, H, bias=False)` on `cat((input_embeds, hidden_states))`. An `fc.bias` in the
    file is silently dropped: `AutoWeightsLoader.load_weights` (models/utils.py) always ignores unexpected
    `.bias` names — a drafter trained with fc bias runs without it there (still lossless, fewer accepted
    tokens). `embed_tokens.weight` is optional: absent, or `torch.equal` to the target's, the target's is
    shared (v1/spec_decode/llm_base_proposer.py `_maybe_share_embeddings`); a differing one is kept. An
    `lm_head.*` tensor would fail (the class has no lm_head; the target's is shared).
  - Both vLLM 0.32 (`models/llama.py`) and SGLang read a config `"bias": true` as ATTENTION bias
    (`getattr(config, "attention_bias", False) or getattr(config, "bias", False)`). So the fc-bias flag is
    written only as `"bias": false`; with an fc bias the field is left out (SafeAILab's default is True).

`sglang-eagle` — SGLang 0.5.23 (the PyPI wheel), `sglang/srt/models/llama_eagle.py` (LlamaForCausalLMEagle):
  - config.json `architectures: ["LlamaForCausalLMEagle"]` (SGLang does not rename a plain Llama config).
  - `load_weights` prefixes every name but lm_head with `model.` itself, so the file's keys carry NO
    `model.` prefix: the same names as `eagle1`. Names containing `lm_head` are skipped.
  - `fc = torch.nn.Linear(2H, H)`: it always has a bias, and nothing checks that every weight was loaded
    (`LlamaForCausalLM._legacy_load_weights`), so a drafter without fc bias is written with a zero one.
  - embedding first: `self.fc(torch.cat((hidden_states, spec_info.hidden_states)))` where `hidden_states`
    is `embed_tokens(input_ids)`. The speculative worker then replaces embed_tokens and lm_head with the
    target's (`set_embed_and_head`, speculative/eagle_worker_v2.py), so `embed_tokens.weight` is optional.
  - `"tie_word_embeddings": false`, else lm_head is built as embed_tokens.

Our drafter never stores the target's embedding; an imported file's `embed_tokens.weight` is dropped from
the drafter and can be read with `load_eagle_embedding` (e.g. to check it is the target's).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig

from heads.config import DTYPES, HeadsConfig, check_compatible
from heads.eagle import EagleDraft, layer_fields
from heads.io import atomic_write, read_config_json, read_state_dict

EAGLE_FORMATS = ("eagle1", "sglang-eagle")
ARCHITECTURES = {"eagle1": "LlamaForCausalLM", "sglang-eagle": "LlamaForCausalLMEagle"}
ENGINES = {"eagle1": ("safeailab", "vllm"), "sglang-eagle": ("sglang",)}  # who loads each format

SAFETENSORS_NAME = "model.safetensors"
BIN_NAME = "pytorch_model.bin"
EMBED_KEY = "embed_tokens.weight"
# Tensors a file may hold that the drafter does not use: lm_head (SGLang skips it too; every engine uses the
# target's) and the RoPE caches some old checkpoints saved.
IGNORED = re.compile(r"^(lm_head\.|.*rotary_emb\.(inv_freq|cos_cached|sin_cached)$)")

LAYER_PARAMS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "post_attention_layernorm.weight",
)


def layer_keys(num_layers: int) -> list[str]:
    """The decoder layers' tensors: Llama names, with no input_layernorm on layer 0 (fc feeds attention)."""
    keys = []
    for i in range(num_layers):
        keys += [f"layers.{i}.{p}" for p in LAYER_PARAMS]
        if i > 0:
            keys.append(f"layers.{i}.input_layernorm.weight")
    return keys


def safeailab_keys(num_layers: int = 1, bias: bool = True) -> list[str]:
    """What SafeAILab's EAGLE-1 `Model.load_state_dict(strict=True)` reads (ea_model.py at 2320d52e)."""
    return [EMBED_KEY, "fc.weight", *(["fc.bias"] if bias else []), *layer_keys(num_layers)]


def vllm_keys(num_layers: int = 1, bias: bool = True) -> list[str]:
    """What vLLM 0.32 EagleLlamaForCausalLM loads and needs: fc.bias is dropped whatever `bias` is, and
    embed_tokens is optional (the target's is shared when it is absent or identical)."""
    return ["fc.weight", *layer_keys(num_layers)]


def sglang_keys(num_layers: int = 1, bias: bool = True) -> list[str]:
    """What SGLang 0.5.23 LlamaForCausalLMEagle needs: its fc always has a bias (zeros stand in for none);
    embed_tokens is optional (replaced by the target's)."""
    return ["fc.weight", "fc.bias", *layer_keys(num_layers)]


ENGINE_KEYS = {"safeailab": safeailab_keys, "vllm": vllm_keys, "sglang": sglang_keys}


# ---------------------------------------------------------------- reading files


def _weight_files(directory: Path) -> list[Path]:
    """The weight files, safetensors first (what vLLM prefers too); a sharded index lists its shards."""
    pairs = ((SAFETENSORS_NAME, "model.safetensors.index.json"), (BIN_NAME, "pytorch_model.bin.index.json"))
    for single, index in pairs:
        if (directory / single).is_file():
            return [directory / single]
        if (directory / index).is_file():
            try:
                weight_map = json.loads((directory / index).read_text())["weight_map"]
                return [directory / name for name in sorted(set(weight_map.values()))]
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{directory / index} is not a readable weight index: {e!r}") from None
    raise ValueError(f"{directory} has no {SAFETENSORS_NAME} or {BIN_NAME}: no EAGLE weights to import")


def read_eagle_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an EAGLE checkpoint directory, by name (`.bin` read with `weights_only=True`)."""
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(directory)):
        if not path.is_file():
            raise ValueError(f"{path} is listed in the weight index but missing")
        state.update(read_state_dict(path))
    return state


def _weight_names(directory: Path) -> set[str]:
    names: set[str] = set()
    for path in _weight_files(directory):
        if path.name.endswith(".safetensors") and path.is_file():
            try:
                with safe_open(str(path), framework="pt") as f:
                    names.update(f.keys())
            except Exception as e:
                raise ValueError(f"cannot read the weights in {path}: {type(e).__name__}: {e}") from None
        else:
            names.update(read_eagle_weights(directory))
            break
    return names


def load_eagle_embedding(directory: str | Path) -> torch.Tensor | None:
    """The `embed_tokens.weight` a checkpoint carries (the target's, in published ones), or None.

    The imported drafter does not keep it: decoding uses the target's own embedding.
    """
    return read_eagle_weights(directory).get(EMBED_KEY)


def detect_eagle_format(directory: str | Path) -> str | None:
    """"eagle1" or "sglang-eagle" for an EAGLE-1 checkpoint directory; None for anything else (a selfspec
    heads directory, an EAGLE-3 drafter, a full model, no config or weights)."""
    directory = Path(directory)
    try:
        raw = read_config_json(directory)
        if "kind" in raw:  # a selfspec HeadsConfig
            return None
        archs = raw.get("architectures") or []
        if "LlamaForCausalLMEagle" in archs:
            fmt = "sglang-eagle"
        elif any(a in ("LlamaForCausalLM", "EagleLlamaForCausalLM") for a in archs) or (
            not archs and raw.get("model_type") == "llama"
        ):
            fmt = "eagle1"
        else:
            return None
        names = _weight_names(directory)
    except ValueError:
        return None
    if "fc.weight" not in names or any(n.startswith(("midlayer.", "model.")) for n in names):
        return None  # EAGLE-3 (`midlayer.*`) or a full causal LM (`model.layers.*`)
    return fmt


# ---------------------------------------------------------------- import


def _layer_config(raw: dict[str, Any], where: Path) -> dict[str, Any]:
    """Our layer fields from a Llama config.json (read by transformers, legacy RoPE keys included)."""
    for flag in ("qkv_bias", "attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ValueError(f"{where}: `{flag}: true` (biased attention/MLP) is not supported here")
    keep = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "bias", "auto_map")}
    try:
        fields = layer_fields(LlamaConfig.from_dict(keep))
    except Exception as e:
        raise ValueError(f"{where}: not a readable Llama config: {type(e).__name__}: {e}") from None
    rope = fields["rope_parameters"]
    if "rope_type" in rope:
        rope.pop("type", None)  # the legacy name transformers keeps beside rope_type
    return fields


def _dtype_name(raw: dict[str, Any], weight: torch.Tensor) -> str:
    named = raw.get("torch_dtype") or raw.get("dtype")
    if isinstance(named, str) and named in DTYPES:
        return named
    name = str(weight.dtype).removeprefix("torch.")
    return name if name in DTYPES else "float32"


def import_eagle(
    directory: str | Path,
    format: str | None = None,
    base_model: str | None = None,
    target: nn.Module | None = None,
) -> EagleDraft:
    """Build an `EagleDraft` from an `eagle1` (SafeAILab / vLLM) or `sglang-eagle` checkpoint directory.

    Shapes come from the tensors (hidden size from fc, vocabulary from embed_tokens when present), the
    layer from the Llama config, fc_bias from whether fc.bias is there. The weights keep the file's dtype.
    With `target`, a drafter of another hidden or vocabulary size is refused, and an embed_tokens that is
    not the target's embedding is warned about (the file was made for another model).
    """
    directory = Path(directory)
    raw = read_config_json(directory)
    fmt = format or detect_eagle_format(directory)
    if fmt is None:
        raise ValueError(
            f"{directory} is not an EAGLE-1 checkpoint this importer recognises: it expects a Llama "
            "config.json (architectures LlamaForCausalLM or LlamaForCausalLMEagle) and fc.weight + layers.*"
        )
    if fmt not in EAGLE_FORMATS:
        raise ValueError(f"unknown EAGLE format {fmt!r}; supported: {', '.join(EAGLE_FORMATS)}")
    state = read_eagle_weights(directory)
    embed = state.pop(EMBED_KEY, None)
    state = {k: v for k, v in state.items() if not IGNORED.match(k)}

    fc = state.get("fc.weight")
    if fc is None or fc.dim() != 2 or fc.shape[1] != 2 * fc.shape[0]:
        shape = None if fc is None else tuple(fc.shape)
        raise ValueError(f"{directory}: fc.weight should have shape (H, 2H), found {shape}")
    if not fc.is_floating_point():
        raise ValueError(f"{directory}: fc.weight is {fc.dtype}; quantized drafters are not supported")
    hidden = fc.shape[0]
    if raw.get("hidden_size") != hidden:
        raise ValueError(f"{directory}: config.json says hidden_size {raw.get('hidden_size')} but fc.weight "
                         f"is {tuple(fc.shape)} (hidden size {hidden})")
    vocab = raw.get("vocab_size")
    if embed is not None:
        if embed.dim() != 2 or embed.shape[1] != hidden:
            raise ValueError(f"{directory}: embed_tokens.weight {tuple(embed.shape)} does not match hidden "
                             f"size {hidden}")
        if vocab is not None and vocab != embed.shape[0]:
            raise ValueError(f"{directory}: config.json says vocab_size {vocab} but embed_tokens.weight has "
                             f"{embed.shape[0]} rows")
        vocab = embed.shape[0]
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"{directory}: no vocabulary size (no vocab_size in config.json, no embed_tokens)")

    indices = sorted({int(m.group(1)) for k in state if (m := re.match(r"layers\.(\d+)\.", k))})
    if not indices or indices != list(range(len(indices))):
        raise ValueError(f"{directory}: decoder layers should be numbered 0..n-1, found {indices}")
    if raw.get("num_hidden_layers", len(indices)) != len(indices):
        raise ValueError(f"{directory}: config.json says num_hidden_layers {raw['num_hidden_layers']} but "
                         f"the weights hold {len(indices)} layer(s)")

    fc_bias = "fc.bias" in state
    if fmt == "sglang-eagle" and fc_bias and raw.get("bias") is False and not state["fc.bias"].any():
        del state["fc.bias"]  # the zero bias written for SGLang's always-biased fc (see export_eagle)
        fc_bias = False
    config = HeadsConfig(
        kind="eagle", base_model=base_model or "", hidden_size=hidden, vocab_size=vocab,
        num_layers=len(indices), fc_bias=fc_bias, dtype=_dtype_name(raw, fc),
        layer=_layer_config(raw, directory / "config.json"),
    )
    draft = EagleDraft(config).to(fc.dtype)
    expected = set(draft.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"{directory}: the weights do not form an EAGLE-1 drafter of {len(indices)} "
                         f"layer(s): missing {missing[:6]}, unexpected {unexpected[:6]}")
    try:
        draft.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{directory}: the weights do not match config.json's shapes: {e}") from None
    draft.eval()
    if target is not None:
        check_compatible(config, target)
        if embed is not None:
            mine = target.get_input_embeddings().weight.detach()
            if mine.shape != embed.shape or not torch.allclose(embed.float().cpu(), mine.float().cpu(),
                                                                rtol=1e-2, atol=1e-3):
                warnings.warn(f"{directory}: its embed_tokens differ from the target's input embedding: it "
                              "was likely trained for another model, and will draft poorly", stacklevel=2)
    return draft


# ---------------------------------------------------------------- export


def _rope_scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    """RoPE scaling for config.json: null by default; SafeAILab's {"type", "factor"} where it fits."""
    rest = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
    kind = rest.get("rope_type", "default")
    if kind == "default":
        return None
    if kind in ("linear", "dynamic") and set(rest) == {"rope_type", "factor"}:
        return {"type": kind, "factor": float(rest["factor"])}
    return rest


def eagle_config_json(draft: EagleDraft, fmt: str) -> dict[str, Any]:
    """The Llama-style config.json the format's loaders read (see the module docstring for the sources)."""
    cfg, layer = draft.config, dict(draft.config.layer or {})
    rope = dict(layer.get("rope_parameters") or {})
    heads = layer["num_attention_heads"]
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[fmt]],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": layer["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": layer.get("num_key_value_heads", heads),
        "head_dim": layer.get("head_dim", cfg.hidden_size // heads),
        "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "hidden_act": layer.get("hidden_act", "silu"),
        "rms_norm_eps": layer.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": layer.get("max_position_embeddings", 2048),
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling": _rope_scaling(rope),
        "tie_word_embeddings": False,
        "torch_dtype": str(draft.fc.weight.dtype).removeprefix("torch."),
    }
    if not cfg.fc_bias:
        config["bias"] = False  # SafeAILab's fc-bias flag; `true` means attention bias to vLLM and SGLang
    return config


def export_eagle(
    draft: EagleDraft,
    fmt: str,
    out_dir: str | Path,
    embed_weight: torch.Tensor | None = None,
    weights: str = "safetensors",
) -> None:
    """Write `draft` as an `eagle1` or `sglang-eagle` checkpoint: config.json + weights.

    `embed_weight` (the target's input embedding) is written as `embed_tokens.weight`, as published
    checkpoints carry it (SafeAILab's EAGLE-1 loader requires it). `weights` picks `model.safetensors`
    (vLLM, SGLang and today's SafeAILab code) or `pytorch_model.bin` (the original EAGLE-1 code).
    """
    if fmt not in EAGLE_FORMATS:
        raise ValueError(f"unknown EAGLE format {fmt!r}; choose one of {', '.join(EAGLE_FORMATS)}")
    if weights not in ("safetensors", "bin"):
        raise ValueError(f"weights must be 'safetensors' or 'bin', got {weights!r}")
    cfg = draft.config
    state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    expected = {"fc.weight", *(["fc.bias"] if cfg.fc_bias else []), *layer_keys(cfg.num_layers)}
    if set(state) != expected:
        raise ValueError(f"this drafter has tensors no EAGLE-1 loader reads (e.g. attention biases): "
                         f"{sorted(set(state) ^ expected)[:6]}")
    layer = cfg.layer or {}
    if layer.get("head_dim", cfg.hidden_size // layer["num_attention_heads"]) * layer["num_attention_heads"] \
            != cfg.hidden_size:
        warnings.warn("head_dim x heads != hidden size: SafeAILab's EAGLE code assumes head_dim = H / heads "
                      "and cannot run this drafter (vLLM and SGLang read head_dim)", stacklevel=2)
    if embed_weight is not None:
        if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"embed_weight has shape {tuple(embed_weight.shape)}, the drafter needs "
                             f"({cfg.vocab_size}, {cfg.hidden_size})")
        state[EMBED_KEY] = embed_weight.detach().cpu().clone()  # its own dtype: vLLM shares it if identical
    elif fmt == "eagle1":
        warnings.warn("no embed_weight: SafeAILab's original EAGLE-1 loader (strict) needs "
                      "embed_tokens.weight; vLLM does not", stacklevel=2)
    if fmt == "eagle1" and cfg.fc_bias:
        warnings.warn("this drafter has an fc bias, which vLLM 0.32 drops on load (it still decodes "
                      "losslessly but accepts fewer tokens); train with fc_bias=False for vLLM", stacklevel=2)
    if fmt == "sglang-eagle" and not cfg.fc_bias:
        state["fc.bias"] = torch.zeros(cfg.hidden_size, dtype=state["fc.weight"].dtype)

    out = Path(out_dir)
    name, other = (SAFETENSORS_NAME, BIN_NAME) if weights == "safetensors" else (BIN_NAME, SAFETENSORS_NAME)
    if (out / other).exists():
        raise ValueError(f"{out} already holds {other}: loaders would pick one of two weight files; "
                         "export into an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    if weights == "safetensors":
        atomic_write(out / name, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    else:
        atomic_write(out / name, lambda tmp: torch.save(state, tmp))
    text = json.dumps(eagle_config_json(draft, fmt), indent=2) + "\n"
    atomic_write(out / "config.json", lambda tmp: Path(tmp).write_text(text))
