"""EAGLE-1 drafters in the layouts published and served elsewhere: import them, export ours.

The tensors keep our names in both layouts: `EagleDraft` uses SafeAILab's (`fc.*`, `layers.{i}.*`), and
vLLM and SGLang add their `model.` prefix themselves. The target's embedding travels as
`embed_tokens.weight`; our drafter never stores it (read it with `load_eagle_embedding`). config.json is
a Llama config: export writes the `CONFIG_FIELDS` of the `LlamaConfig` the drafter is built from, import
reads them back through `LlamaConfig`; the weights load with `load_state_dict(strict=True)`. What each
engine needs beyond the decoder layers is the `ENGINE_NEEDS` table; the layouts, `LAYOUTS`, name their
engines, and export follows from the two (zeros for an fc bias SGLang requires, warnings where one engine
drops or lacks a tensor). Sources (read for this module, versions named):

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
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig

from selfspec.heads.config import DTYPES, HeadsConfig, check_compatible
from selfspec.heads.draft_layers import layer_fields, llama_config
from selfspec.heads.eagle import EagleDraft
from selfspec.heads.formats.checkpoint import WEIGHTS, Checkpoint
from selfspec.heads.formats.medusa import load_strict
from selfspec.heads.io import atomic_write

EMBED_KEY = "embed_tokens.weight"
# a draft vocabulary as SGLang takes it for EAGLE-2 (`--speculative-token-map`, FR-Spec's hot token ids; read
# by sglang/srt/speculative/eagle_worker.py `load_token_map` as torch.load(path, weights_only=True), sglang
# v0.5.x)
TOKEN_MAP = "token_map.pt"
# Tensors a file may hold that the drafter does not use: lm_head (SGLang skips it too; every engine uses the
# target's) and the RoPE caches some old checkpoints saved.
IGNORED = re.compile(r"^(lm_head\.|.*rotary_emb\.(inv_freq|cos_cached|sin_cached)$)")
LAYER_PARAMS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "post_attention_layernorm.weight",
)
# config.json fields, written from (and read back into) the LlamaConfig the draft layers are built from.
CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "vocab_size",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
)
# What each engine's loader needs besides the decoder layers; "fc.bias?" only for a drafter with an fc bias.
# SafeAILab's strict load wants the embedding; vLLM drops fc.bias and shares the target's embedding; SGLang's
# fc always has a bias.
ENGINE_NEEDS = {
    "safeailab": (EMBED_KEY, "fc.weight", "fc.bias?"),
    "vllm": ("fc.weight",),
    "sglang": ("fc.weight", "fc.bias"),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    architecture: str  # config.json `architectures`
    engines: tuple[str, ...]  # who loads it (keys of ENGINE_NEEDS)


LAYOUTS = {
    "eagle1": Layout("LlamaForCausalLM", ("safeailab", "vllm")),
    "sglang-eagle": Layout("LlamaForCausalLMEagle", ("sglang",)),
}
EAGLE_FORMATS = tuple(LAYOUTS)


def write_weights(state: dict[str, torch.Tensor], out: Path, weights: str) -> None:
    """The state dict as `model.safetensors` or `pytorch_model.bin`, refusing a folder that holds the
    other."""
    other = next(name for kind, name in WEIGHTS.items() if kind != weights)
    if (out / other).exists():
        raise ValueError(
            f"{out} already holds {other}: loaders would pick one of two weight files; "
            "export into an empty directory"
        )
    if weights == "safetensors":
        atomic_write(out / WEIGHTS[weights], lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    else:
        atomic_write(out / WEIGHTS[weights], lambda tmp: torch.save(state, tmp))


def check_target(config: HeadsConfig, target: nn.Module, embed: torch.Tensor | None, directory: Path) -> None:
    """The target must fit the drafter; an embedding the checkpoint carries should be the target's (else
    warn)."""
    check_compatible(config, target)
    mine = target.get_input_embeddings().weight.detach()
    if embed is not None and (
        mine.shape != embed.shape
        or not torch.allclose(embed.float().cpu(), mine.float().cpu(), rtol=1e-2, atol=1e-3)
    ):
        warnings.warn(
            f"{directory}: its embed_tokens differ from the target's input embedding: it was likely "
            "trained for another model, and will draft poorly",
            stacklevel=3,
        )


def layer_keys(num_layers: int) -> list[str]:
    """The decoder layers' tensors: Llama names, with no input_layernorm on layer 0 (fc feeds attention)."""
    keys = []
    for i in range(num_layers):
        keys += [f"layers.{i}.{p}" for p in LAYER_PARAMS] + (
            [f"layers.{i}.input_layernorm.weight"] if i else []
        )
    return keys


def engine_keys(engine: str, num_layers: int = 1, bias: bool = True) -> list[str]:
    """Every tensor `engine` ("safeailab", "vllm", "sglang") needs in the file for this drafter."""
    needs = [k.rstrip("?") for k in ENGINE_NEEDS[engine] if bias or not k.endswith("?")]
    return needs + layer_keys(num_layers)


# ---------------------------------------------------------------- reading files


def read_eagle_weights(directory: str | Path | Checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor of an EAGLE checkpoint directory, by name (`.bin` read with `weights_only=True`)."""
    return Checkpoint.read(directory).read_weights()


def load_eagle_embedding(directory: str | Path | Checkpoint) -> torch.Tensor | None:
    """The `embed_tokens.weight` a checkpoint carries (the target's, in published ones), or None.

    The imported drafter does not keep it: decoding uses the target's own embedding.
    """
    return read_eagle_weights(directory).get(EMBED_KEY)


def detect_eagle_format(directory: str | Path | Checkpoint) -> str | None:
    """ "eagle1" or "sglang-eagle" for an EAGLE-1 checkpoint directory; None for anything else (a selfspec
    heads directory, an EAGLE-3 drafter, a full model, no config or weights). A config.json that is not
    JSON, or weights that cannot be read, are errors naming the file."""
    checkpoint = Checkpoint.read(directory)
    raw = checkpoint.config
    if raw is None or checkpoint.is_selfspec or not checkpoint.weight_files:
        return None
    archs = raw.get("architectures") or []
    if "LlamaForCausalLMEagle" in archs:
        fmt = "sglang-eagle"
    elif {"LlamaForCausalLM", "EagleLlamaForCausalLM"} & set(archs) or (
        not archs and raw.get("model_type") == "llama"
    ):
        fmt = "eagle1"
    else:
        return None
    names = checkpoint.weight_names
    if "fc.weight" not in names or any(n.startswith(("midlayer.", "model.")) for n in names):
        return None  # EAGLE-3 (`midlayer.*`) or a full causal LM (`model.layers.*`)
    return fmt


# ---------------------------------------------------------------- import


def layer_config_from_json(raw: dict[str, Any], where: Path) -> dict[str, Any]:
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


def import_eagle(
    directory: str | Path | Checkpoint,
    format: str | None = None,
    base_model: str | None = None,
    target: nn.Module | None = None,
) -> EagleDraft:
    """Build an `EagleDraft` from an `eagle1` (SafeAILab / vLLM) or `sglang-eagle` checkpoint directory.

    The hidden size comes from fc, the layer shapes and count from config.json (the count, when absent, from
    the weights), the vocabulary from config.json or embed_tokens, fc_bias from whether fc.bias is there;
    the weights keep the file's dtype. With `target`, a drafter of another hidden or vocabulary size is
    refused, and an embed_tokens that is not the target's embedding is warned about.
    """
    checkpoint = Checkpoint.read(directory)
    directory, raw = checkpoint.path, checkpoint.require_config()
    cfg_path = directory / "config.json"
    fmt = format or detect_eagle_format(checkpoint)
    if fmt is None:
        raise ValueError(
            f"{directory} is not an EAGLE-1 checkpoint this importer recognises: it expects a Llama "
            "config.json (architectures LlamaForCausalLM or LlamaForCausalLMEagle) and fc.weight + layers.*"
        )
    if fmt not in LAYOUTS:
        raise ValueError(f"unknown EAGLE format {fmt!r}; supported: {', '.join(EAGLE_FORMATS)}")
    state = checkpoint.read_weights()
    embed = state.pop(EMBED_KEY, None)
    state = {k: v for k, v in state.items() if not IGNORED.match(k)}
    fc = state.get("fc.weight")
    if fc is None or fc.dim() != 2 or fc.shape[1] != 2 * fc.shape[0]:
        found = None if fc is None else tuple(fc.shape)
        raise ValueError(f"{directory}: fc.weight should have shape (H, 2H), found {found}")
    if not fc.is_floating_point():
        raise ValueError(f"{directory}: fc.weight is {fc.dtype}; quantized drafters are not supported")
    hidden, vocab = fc.shape[0], raw.get("vocab_size", None if embed is None else embed.shape[0])
    if raw.get("hidden_size") != hidden:
        raise ValueError(
            f"{cfg_path}: hidden_size is {raw.get('hidden_size')} but fc.weight {tuple(fc.shape)} "
            f"makes it {hidden}"
        )
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"{directory}: no vocabulary size (no vocab_size in config.json, no embed_tokens)")
    if embed is not None and tuple(embed.shape) != (vocab, hidden):
        raise ValueError(
            f"{directory}: embed_tokens.weight is {tuple(embed.shape)}, config.json and fc make it "
            f"({vocab}, {hidden})"
        )
    layers = {int(m.group(1)) for k in state if (m := re.match(r"layers\.(\d+)\.", k))}
    if (
        fmt == "sglang-eagle"
        and raw.get("bias") is False
        and "fc.bias" in state
        and not state["fc.bias"].any()
    ):
        del state["fc.bias"]  # the zero bias written for SGLang's always-biased fc (see export_eagle)
    named = (raw.get("torch_dtype"), raw.get("dtype"), str(fc.dtype).removeprefix("torch."))
    dtype = next((d for d in named if d in DTYPES), "float32")
    config = HeadsConfig(
        kind="eagle",
        base_model=base_model or "",
        hidden_size=hidden,
        vocab_size=vocab,
        num_layers=raw.get("num_hidden_layers") or 1 + max(layers, default=0),
        fc_bias="fc.bias" in state,
        dtype=dtype,
        layer=layer_config_from_json(raw, cfg_path),
    )
    draft = EagleDraft(config).to(fc.dtype)
    files = checkpoint.weight_files
    load_strict(draft, state, files[0] if len(files) == 1 else directory)
    if (directory / TOKEN_MAP).is_file():  # the draft vocabulary export_eagle writes for SGLang
        draft = draft.with_draft_vocab(read_token_map(directory / TOKEN_MAP, vocab))
    draft.eval()
    if target is not None:
        check_target(config, target, embed, directory)
    return draft


def read_token_map(path: str | Path, vocab: int) -> torch.Tensor:
    """The target ids of an FR-Spec / SGLang token map (a torch-saved 1-D list or tensor of distinct token
    ids, most frequent first), checked against a vocabulary of `vocab` tokens."""
    try:
        ids = torch.as_tensor(torch.load(path, weights_only=True))
    except Exception as e:  # not a file, not a torch file, or not plain data
        reason = (
            "no such file"
            if isinstance(e, FileNotFoundError)
            else f"not a torch-saved list: {type(e).__name__}"
        )
        raise ValueError(f"{path}: cannot read it as a list of token ids ({reason})") from None
    if ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool or ids.numel() == 0:
        raise ValueError(
            f"{path} holds a {ids.dtype} tensor of shape {tuple(ids.shape)}: it must be a 1-D list of "
            "token ids"
        )
    ids = ids.long()
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(
            f"{path} holds token ids outside the target's vocabulary (0..{vocab - 1}): it was made for "
            "another model"
        )
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{path} repeats token ids: it must list each token once")
    return ids


# ---------------------------------------------------------------- export


def rope_scaling_json(rope: dict[str, Any]) -> dict[str, Any] | None:
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
    lc, rope = llama_config(draft.config), dict((draft.config.layer or {}).get("rope_parameters") or {})
    config: dict[str, Any] = {"architectures": [LAYOUTS[fmt].architecture], "model_type": "llama"}
    config |= {field: getattr(lc, field) for field in CONFIG_FIELDS}
    config |= {
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling": rope_scaling_json(rope),
        "tie_word_embeddings": False,
        "torch_dtype": str(draft.fc.weight.dtype).removeprefix("torch."),
    }
    if not draft.config.fc_bias:
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
    if fmt not in LAYOUTS:
        raise ValueError(f"unknown EAGLE format {fmt!r}; choose one of {', '.join(EAGLE_FORMATS)}")
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be 'safetensors' or 'bin', got {weights!r}")
    cfg, engines = draft.config, LAYOUTS[fmt].engines
    state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    hot = (
        draft.draft_ids.cpu() if state.pop("d2t", None) is not None else None
    )  # no such key in these layouts
    if hot is not None:
        warnings.warn(
            f"these layouts have no draft vocabulary (selfspec drafts among {cfg.draft_vocab_size} "
            f"tokens): vLLM and SafeAILab draft over the target's whole vocabulary; SGLang drafts among "
            f"them with --speculative-token-map {Path(out_dir) / TOKEN_MAP}",
            stacklevel=2,
        )
    expected = {"fc.weight", *(["fc.bias"] if cfg.fc_bias else []), *layer_keys(cfg.num_layers)}
    if set(state) != expected:
        raise ValueError(
            f"this drafter has tensors no EAGLE-1 loader reads (e.g. attention biases): "
            f"{sorted(set(state) ^ expected)[:6]}"
        )
    lc = llama_config(cfg)
    if "safeailab" in engines and lc.head_dim * lc.num_attention_heads != cfg.hidden_size:
        warnings.warn(
            "head_dim x heads != hidden size: SafeAILab's EAGLE code assumes head_dim = H / heads "
            "and cannot run this drafter (vLLM and SGLang read head_dim)",
            stacklevel=2,
        )
    if embed_weight is not None:
        if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"embed_weight has shape {tuple(embed_weight.shape)}, the drafter needs "
                f"({cfg.vocab_size}, {cfg.hidden_size})"
            )
        state[EMBED_KEY] = embed_weight.detach().cpu().clone()  # its own dtype: vLLM shares it if identical
    needed = {k for engine in engines for k in engine_keys(engine, cfg.num_layers, cfg.fc_bias)}
    if EMBED_KEY in needed - set(state):
        warnings.warn(
            "no embed_weight: SafeAILab's original EAGLE-1 loader (strict) needs "
            "embed_tokens.weight; vLLM does not",
            stacklevel=2,
        )
    if "fc.bias" in needed - set(state):  # SGLang's fc always has a bias: zeros are the bias-free fc
        state["fc.bias"] = torch.zeros(cfg.hidden_size, dtype=state["fc.weight"].dtype)
    if cfg.fc_bias and "vllm" in engines:
        warnings.warn(
            "this drafter has an fc bias, which vLLM 0.32 drops on load (it still decodes "
            "losslessly but accepts fewer tokens); train with fc_bias=False for vLLM",
            stacklevel=2,
        )
    write_weights(state, Path(out_dir), weights)
    if (
        hot is not None
    ):  # FR-Spec's token map as SGLang loads it: torch.load(path, weights_only=True), the token ids
        atomic_write(Path(out_dir) / TOKEN_MAP, lambda tmp: torch.save(hot, tmp))
    text = json.dumps(eagle_config_json(draft, fmt), indent=2) + "\n"
    atomic_write(Path(out_dir) / "config.json", lambda tmp: Path(tmp).write_text(text))


def export_as(
    draft: EagleDraft,
    fmt: str,
    out_dir: str | Path,
    target: nn.Module | None = None,
    base_model: str | None = None,
    weights: str | None = None,
) -> None:
    """`export_heads` for the EAGLE-1 layouts: they carry the target's embedding and name no target."""
    embed = target.get_input_embeddings().weight if target is not None else None
    export_eagle(draft, fmt, out_dir, embed_weight=embed, weights=weights or "safetensors")
