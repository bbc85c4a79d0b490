"""Medusa heads in the layouts other projects publish and serve: import them, export ours.

Two layouts, named by the project that defines them:

* ``fastdecoding-medusa`` — FasterDecoding/Medusa, also what Hugging Face TGI and TensorRT-LLM read.
  ``config.json`` holds ``medusa_num_heads``, ``medusa_num_layers`` and ``base_model_name_or_path``
  (no ``model_type``, no ``architectures``); the weights are ``medusa_lm_head.safetensors`` or
  ``medusa_lm_head.pt``, the ``state_dict`` of an ``nn.ModuleList`` of per-head ``nn.Sequential``:

  - v1: ``{h}.{l}.linear.weight|bias`` for the residual blocks and ``{h}.{num_layers}.weight`` for the
    head's own vocab projection (bias-free);
  - "version 2": the same blocks and no projection; every head reuses the target's lm_head (our
    ``share_lm_head=True``). The files say which: the projection keys are there or not, as TGI tells
    them apart (it tries the v1 loader and falls back to v2). The legacy trainer also writes
    ``"version": "2"`` into config.json, but that is the default of its config class, so the weights
    decide, never the field.

* ``vllm-medusa`` — vLLM's Medusa drafter: ``config.json`` with ``"model_type": "medusa"``,
  ``"architectures": ["MedusaModel"]``, ``hidden_size``, ``vocab_size``, ``num_heads``,
  ``num_hidden_layers``, ``truncated_vocab_size``, ``medusa_fc_bias``, ``original_lm_head``; weights
  (``model.safetensors``) ``blocks.{h}.layers.{l}.weight|bias`` and ``lm_heads.{h}.weight``.

Both compute, per head, ``x = x + SiLU(W_l x + b_l)`` for each block, then a vocab projection: the same
function as `heads.medusa.MedusaHeads`, so converting is a renaming of tensors, exact in every bit.

Sources read (what each loader expects, taken from its own code):

* FasterDecoding/Medusa ``medusa/model/medusa_model.py`` @ 11af0aa503437b40d45f5a47c001c43699b7ae52 and
  @ 60eeab92e98adb0e787987493b11fa38535a8260: ``MedusaConfig(medusa_num_heads, medusa_num_layers,
  base_model_name_or_path)``; heads ``nn.Sequential(*([ResBlock(H)] * n), nn.Linear(H, V, bias=False))``
  with ``ResBlock.linear = nn.Linear(H, H)`` (biased); ``from_pretrained`` reads ``medusa_lm_head.pt``
  with ``torch.load`` and ``load_state_dict(strict=False)``. Its later ``MedusaModelABC.from_pretrained``
  (upstream main, seen in copies of that file; the upstream revision itself is not in the index read)
  hard-codes ``medusa_num_heads = 5  # TODO: fix the uploaded config (only include 2 heads)``: the
  published configs say 2 heads where the weights hold 5, hence "trust the weights" below.
* FasterDecoding/Medusa ``medusa/model/medusa_model_legacy.py`` @ 2b8020f2fff7a8dfbec50fd18d3640e5d8a5fa39:
  ``MedusaConfig(..., version="2")``; heads are ``nn.Sequential(*([ResBlock(H)] * n))`` only and the
  logits come from ``base_model.lm_head``. ``medusa/train/train_legacy.py`` @
  e2a5d20c048a9b0a4092e6933c34313687422518 saves ``MedusaConfig(..., version="2")`` and
  ``medusa_lm_head.safetensors``.
* huggingface/text-generation-inference ``server/text_generation_server/layers/medusa.py`` @
  f32fdd0fa16411512f09a14d0304869b5aeba73c (``MedusaHeadV1``: ``{i}.{j}.linear`` with bias and
  ``{i}.{n}`` without; ``MedusaHeadV2``: ``assert medusa_config["medusa_num_layers"] == 1``, prefixes
  ``{i}.0.linear``, the target's lm_head), ``layers/speculative.py`` @
  c09f5bc93071e2701e201bb374d488e4673fac3d (a config with ``architectures`` is not treated as Medusa;
  ``try: MedusaHeadV1.load(...) except: MedusaHeadV2(...)``) and ``models/__init__.py`` ``get_model``
  (``"medusa_num_heads" in config_dict`` selects Medusa, ``base_model_name_or_path`` names the target,
  the speculation depth defaults to ``medusa_num_heads``, weights only from ``medusa_lm_head.safetensors``).
* vllm-project/vllm ``vllm/model_executor/models/medusa.py`` @ 09cddad8f0324594022359cd2b07e962a14b895f
  and @ 01dbb08195ca9c70ac9044786a906a353e07fcdf: ``ResidualBlock.layers[l] = nn.Linear(H, H,
  bias=getattr(config, "medusa_fc_bias", False))``; ``lm_heads`` one ``ParallelLMHead(truncated_vocab_size,
  H)`` per head, or with ``original_lm_head`` a single ``lm_head`` loaded from ``lm_heads.0.weight``;
  ``logit_scale`` (default 1.0); ``load_weights`` strips ``medusa_heads.``, drops names it has no parameter
  for, and reads ``token_map`` only when ``truncated_vocab_size < vocab_size``.
  ``vllm/transformers_utils/configs/medusa.py`` @ 0531c2226a6a25cd96ccc856f3bda3f0bb4efb5f:
  ``MedusaConfig(hidden_size, vocab_size, num_heads, num_hidden_layers, max_paths, topk,
  truncated_vocab_size=vocab_size)``, ``architectures`` defaults to ``["MedusaModel"]``, and
  ``from_pretrained`` renames any key containing "num" and "heads" to ``num_heads`` and any containing
  "num" and "layers" to ``num_hidden_layers``. The registry maps ``"MedusaModel": ("medusa", "Medusa")``
  and ``SpeculativeConfig`` picks method "medusa" when the draft's ``model_type == "medusa"``. The first
  vLLM Medusa (``nn.Linear(H, H, bias=False)``, no ``medusa_fc_bias``) silently drops the block biases.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from heads.config import DTYPES, HeadsConfig
from heads.io import atomic_write, read_config_json, read_state_dict
from heads.medusa import MedusaHeads

MEDUSA_FORMATS = ("fastdecoding-medusa", "vllm-medusa")

# FasterDecoding / TGI / TensorRT-LLM: the weights file names, safetensors first (TGI reads only that one).
FASTDECODING_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
FASTDECODING_CONFIG_FIELDS = ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path")
# Keys that make TGI skip Medusa (`architectures`) or FasterDecoding try AutoConfig (`model_type`).
FASTDECODING_FORBIDDEN_FIELDS = ("architectures", "model_type")

VLLM_WEIGHTS_NAME = "model.safetensors"
VLLM_CONFIG_FIELDS = (
    "model_type",
    "architectures",
    "hidden_size",
    "vocab_size",
    "num_heads",
    "num_hidden_layers",
    "truncated_vocab_size",
    "medusa_fc_bias",
    "original_lm_head",
)


def FASTDECODING_MEDUSA_KEYS(  # noqa: N802
    num_heads: int, num_layers: int, projection: bool = True
) -> list[str]:
    """Every tensor FasterDecoding's / TGI's Medusa loader reads; `projection=False` is "version 2"."""
    keys = []
    for h in range(num_heads):
        for layer in range(num_layers):
            keys += [f"{h}.{layer}.linear.weight", f"{h}.{layer}.linear.bias"]
        if projection:
            keys.append(f"{h}.{num_layers}.weight")
    return keys


def VLLM_MEDUSA_KEYS(  # noqa: N802
    num_heads: int, num_layers: int, bias: bool = True, original_lm_head: bool = False
) -> list[str]:
    """Every tensor vLLM's `Medusa.load_weights` reads for this config."""
    keys = []
    for h in range(num_heads):
        for layer in range(num_layers):
            keys.append(f"blocks.{h}.layers.{layer}.weight")
            if bias:
                keys.append(f"blocks.{h}.layers.{layer}.bias")
    keys += ["lm_heads.0.weight"] if original_lm_head else [f"lm_heads.{h}.weight" for h in range(num_heads)]
    return keys


# --------------------------------------------------------------------------------------------- reading


def _dtype_name(tensor: torch.Tensor, path: Path) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(
            f"{path} holds {name} tensors; Medusa heads here are one of {', '.join(DTYPES)}: cast them"
        )
    return name


def _expect_shape(tensor: torch.Tensor, shape: tuple[int, ...], name: str, path: Path) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"{path}: {name} has shape {tuple(tensor.shape)}, expected {shape}: the heads disagree in shape"
        )


def _count_from_weights(config_value: Any, found: int, what: str, config_key: str, path: Path) -> int:
    """The weights decide: a config claiming fewer is a known publishing slip (warned), more is an error."""
    if config_value is None:
        return found
    if not isinstance(config_value, int) or config_value < 0:
        raise ValueError(f"{path.parent}/config.json: {config_key} = {config_value!r} is not a count")
    if config_value > found:
        raise ValueError(
            f"config.json says {config_key} = {config_value} but {path.name} holds only {found} {what}: "
            "the weights file is incomplete or belongs to another checkpoint; re-download it"
        )
    if config_value < found:
        warnings.warn(
            f"config.json says {config_key} = {config_value} but {path.name} holds {found} {what}; "
            f"trusting the weights and using {found} (published Medusa configs often under-count)",
            stacklevel=4,
        )
    return found


def _vocab_for_shared(config: dict[str, Any], base_model: str, vocab_size: int | None, path: Path) -> int:
    """Heads that reuse the target's lm_head hold no vocab-sized tensor: take V from elsewhere."""
    if vocab_size is not None:
        return vocab_size
    if isinstance(config.get("vocab_size"), int):
        return config["vocab_size"]
    if base_model:
        from transformers import AutoConfig

        from shipped.models import resolve_model

        try:
            target = AutoConfig.from_pretrained(resolve_model(base_model))
            text = target.get_text_config() if hasattr(target, "get_text_config") else target
            return int(text.vocab_size)
        except Exception as e:  # offline, missing, or not a causal LM config
            reason = f"reading the base model {base_model!r} failed ({type(e).__name__}: {e})"
    else:
        reason = "no base model is named"
    raise ValueError(
        f"{path.name} has no per-head vocab projection (Medusa 'version 2': the heads reuse the target's "
        f"lm_head), so the vocabulary size is not in the weights, and {reason}: pass vocab_size= (the "
        "target's lm_head rows) "
        "or base_model= (a local path or cached hub id)"
    )


_FD_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def _import_fastdecoding(directory: Path, base_model: str | None, vocab_size: int | None) -> MedusaHeads:
    config = read_config_json(directory)
    path = next((directory / n for n in FASTDECODING_WEIGHTS if (directory / n).is_file()), None)
    if path is None:
        raise ValueError(
            f"{directory} has no {' or '.join(FASTDECODING_WEIGHTS)}: the Medusa heads' weights are missing"
        )
    state = read_state_dict(path)
    parts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    unknown = []
    for key, tensor in state.items():
        m = _FD_KEY.match(key)
        if m is None:
            unknown.append(key)
            continue
        parts.setdefault(int(m[1]), {}).setdefault(int(m[2]), {})[m[3]] = tensor
    if unknown:
        raise ValueError(
            f"{path} has keys outside the FasterDecoding Medusa layout "
            f"({{head}}.{{layer}}.linear.weight|bias, "
            f"{{head}}.{{num_layers}}.weight): {sorted(unknown)[:5]}; is this a full Medusa-2 model or "
            "another format?"
        )
    num_heads = len(parts)
    if num_heads == 0 or sorted(parts) != list(range(num_heads)):
        raise ValueError(f"{path}: head indices {sorted(parts)} are not 0..K-1: the file is incomplete")
    layouts = set()
    for h, layers in parts.items():
        blocks = sorted(i for i, t in layers.items() if "linear.weight" in t)
        n = len(blocks)
        if blocks != list(range(n)) or set(layers) - set(range(n + 1)):
            raise ValueError(
                f"{path}: head {h} has layers {sorted(layers)}, not residual blocks 0..n-1 then a "
                "projection n"
            )
        for i in blocks:
            if set(layers[i]) != {"linear.weight", "linear.bias"}:
                raise ValueError(
                    f"{path}: block {h}.{i} has {sorted(layers[i])}, expected linear.weight and "
                    "linear.bias (FasterDecoding's ResBlock is always biased)"
                )
        projection = n in layers
        if projection and set(layers[n]) != {"weight"}:
            raise ValueError(f"{path}: head {h} layer {n} should be the bias-free projection {h}.{n}.weight")
        layouts.add((n, projection))
    if len(layouts) != 1:
        raise ValueError(f"{path}: the heads differ in layout (blocks, projection): {sorted(layouts)}")
    num_layers, projection = layouts.pop()
    if num_layers == 0:
        raise ValueError(f"{path}: heads with no residual block (medusa_num_layers=0) are not supported here")
    num_heads = _count_from_weights(
        config.get("medusa_num_heads"), num_heads, "heads", "medusa_num_heads", path
    )
    num_layers = _count_from_weights(
        config.get("medusa_num_layers"), num_layers, "residual blocks per head", "medusa_num_layers", path
    )
    first = parts[0][0]["linear.weight"]
    hidden = first.shape[0]
    dtype = _dtype_name(first, path)
    tensors: dict[str, torch.Tensor] = {}
    for h in range(num_heads):
        for i in range(num_layers):
            w, b = parts[h][i]["linear.weight"], parts[h][i]["linear.bias"]
            _expect_shape(w, (hidden, hidden), f"{h}.{i}.linear.weight", path)
            _expect_shape(b, (hidden,), f"{h}.{i}.linear.bias", path)
            tensors[f"heads.{h}.{i}.linear.weight"], tensors[f"heads.{h}.{i}.linear.bias"] = w, b
        if projection:
            p = parts[h][num_layers]["weight"]
            if p.dim() != 2 or p.shape[1] != hidden:
                raise ValueError(
                    f"{path}: {h}.{num_layers}.weight has shape {tuple(p.shape)}, expected (vocab, {hidden})"
                )
            _expect_shape(p, tuple(parts[0][num_layers]["weight"].shape), f"{h}.{num_layers}.weight", path)
            tensors[f"heads.{h}.{num_layers}.weight"] = p
    base = base_model if base_model is not None else str(config.get("base_model_name_or_path") or "")
    if projection:
        vocab = parts[0][num_layers]["weight"].shape[0]
        if vocab_size is not None and vocab_size != vocab:
            raise ValueError(
                f"vocab_size={vocab_size} was passed but {path.name}'s projections have {vocab} rows"
            )
    else:
        vocab = _vocab_for_shared(config, base, vocab_size, path)
    return _build(tensors, base_model=base, hidden_size=hidden, vocab_size=vocab, num_heads=num_heads,
                  num_layers=num_layers, share_lm_head=not projection, dtype=dtype)


def _vllm_weight_files(directory: Path) -> list[Path]:
    # vLLM's default loader: *.safetensors when present, else the PyTorch pickles.
    for pattern in ("*.safetensors", "*.bin", "*.pt"):
        files = sorted(directory.glob(pattern))
        if files:
            return files
    return []


def _import_vllm(directory: Path, base_model: str | None) -> MedusaHeads:
    config = read_config_json(directory)
    cfg_path = directory / "config.json"
    if config.get("model_type") != "medusa":
        raise ValueError(
            f"{cfg_path}: model_type is {config.get('model_type')!r}, vLLM's Medusa layout has 'medusa'"
        )
    # vLLM's MedusaConfig.from_pretrained renames by substring: any "num..heads" key is num_heads, etc.
    renamed = dict(config)
    for key in list(config):
        if "num" in key and "heads" in key:
            renamed["num_heads"] = renamed.pop(key)
        elif "num" in key and "layers" in key:
            renamed["num_hidden_layers"] = renamed.pop(key)
    files = _vllm_weight_files(directory)
    if not files:
        raise ValueError(f"{directory} has config.json but no weights (*.safetensors, *.bin or *.pt)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for key, tensor in read_state_dict(f).items():
            state[key.replace("medusa_heads.", "")] = tensor  # as vLLM's load_weights does
    path = files[0]
    vocab_cfg = renamed.get("vocab_size")
    truncated = renamed.get("truncated_vocab_size") or vocab_cfg
    if vocab_cfg is not None and truncated is not None and truncated < vocab_cfg:
        raise ValueError(
            f"{cfg_path}: truncated_vocab_size {truncated} < vocab_size {vocab_cfg} (a token_map draft "
            "vocabulary): "
            "heads here draft over the target's whole vocabulary; export the checkpoint without a token_map"
        )
    block_key = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
    found: dict[int, set[int]] = {}
    has_bias = False
    for key in state:
        m = block_key.match(key)
        if m:
            found.setdefault(int(m[1]), set()).add(int(m[2]))
            has_bias |= m[3] == "bias"
    if not found:
        raise ValueError(f"{path}: no blocks.{{h}}.layers.{{l}}.weight tensors: not vLLM's Medusa layout")
    num_heads = _count_from_weights(renamed.get("num_heads"), max(found) + 1, "heads", "num_heads", path)
    num_layers = _count_from_weights(
        renamed.get("num_hidden_layers"),
        min(max(s) + 1 for s in found.values()),
        "residual layers per head",
        "num_hidden_layers",
        path,
    )
    bias = bool(renamed.get("medusa_fc_bias", False))
    if has_bias and not bias:
        warnings.warn(
            f"{path.name} has block biases but config.json has no medusa_fc_bias: true, so vLLM "
            "builds bias-free layers and drops them; importing what vLLM computes (biases ignored)",
            stacklevel=2,
        )
    first = state.get("blocks.0.layers.0.weight")
    if first is None:
        raise ValueError(f"{path}: missing blocks.0.layers.0.weight")
    hidden = first.shape[0]
    dtype = _dtype_name(first, path)
    if renamed.get("hidden_size") not in (None, hidden):
        raise ValueError(f"{cfg_path}: hidden_size {renamed['hidden_size']} but the blocks are {hidden} wide")
    original = bool(renamed.get("original_lm_head", False))
    lm_keys = [f"lm_heads.{h}.weight" for h in range(num_heads)]
    if original:  # one lm_head for all heads, stored as lm_heads.0.weight (or lm_head.weight)
        shared = state.get("lm_heads.0.weight", state.get("lm_head.weight"))
        if shared is None:
            raise ValueError(
                f"{path}: original_lm_head is set but neither lm_heads.0.weight nor lm_head.weight is there"
            )
        projections = [shared] * num_heads
    else:
        missing = [k for k in lm_keys if k not in state]
        if missing:
            raise ValueError(f"{path}: missing per-head projections {missing[:5]} (or set original_lm_head)")
        projections = [state[k] for k in lm_keys]
    vocab = projections[0].shape[0]
    if vocab_cfg not in (None, vocab):
        raise ValueError(f"{cfg_path}: vocab_size {vocab_cfg} but lm_heads have {vocab} rows")
    scale = float(renamed.get("logit_scale", 1.0))
    tensors: dict[str, torch.Tensor] = {}
    for h in range(num_heads):
        for i in range(num_layers):
            w = state.get(f"blocks.{h}.layers.{i}.weight")
            if w is None:
                raise ValueError(f"{path}: missing blocks.{h}.layers.{i}.weight")
            _expect_shape(w, (hidden, hidden), f"blocks.{h}.layers.{i}.weight", path)
            b = state.get(f"blocks.{h}.layers.{i}.bias") if bias else None
            if bias and b is None:
                raise ValueError(f"{path}: medusa_fc_bias is true but blocks.{h}.layers.{i}.bias is missing")
            b = torch.zeros(hidden, dtype=w.dtype) if b is None else b  # a bias-free layer is a zero bias
            _expect_shape(b, (hidden,), f"blocks.{h}.layers.{i}.bias", path)
            tensors[f"heads.{h}.{i}.linear.weight"], tensors[f"heads.{h}.{i}.linear.bias"] = w, b
        p = projections[h]
        _expect_shape(p, (vocab, hidden), lm_keys[h], path)
        tensors[f"heads.{h}.{num_layers}.weight"] = p * scale if scale != 1.0 else p  # vLLM scales the logits
    base = base_model if base_model is not None else str(config.get("base_model_name_or_path") or "")
    return _build(tensors, base_model=base, hidden_size=hidden, vocab_size=vocab, num_heads=num_heads,
                  num_layers=num_layers, share_lm_head=False, dtype=dtype)


def _build(tensors: dict[str, torch.Tensor], **fields) -> MedusaHeads:
    """MedusaHeads of kind medusa with these config fields, holding exactly `tensors`."""
    config = HeadsConfig(kind="medusa", **fields)
    dtype = getattr(torch, config.dtype)
    heads = MedusaHeads(config).to(dtype)
    heads.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    return heads.eval()


# ------------------------------------------------------------------------------------------- detection


def detect_medusa_format(directory: str | Path) -> str | None:
    """Which published Medusa layout a directory holds, from its file names and config; None if neither."""
    directory = Path(directory)
    if any((directory / n).is_file() for n in FASTDECODING_WEIGHTS):
        return "fastdecoding-medusa"
    path = directory / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError:
            return None
        if (
            isinstance(config, dict)
            and config.get("model_type") == "medusa"
            and _vllm_weight_files(directory)
        ):
            return "vllm-medusa"
    return None


def import_medusa(
    directory: str | Path,
    format: str | None = None,
    base_model: str | None = None,  # noqa: A002
    vocab_size: int | None = None,
) -> MedusaHeads:
    """Load published Medusa heads as `MedusaHeads`: config from the files, shapes and dtype from the weights.

    `format` is detected when None. `base_model` overrides the target named in the files. `vocab_size`
    is only needed for FasterDecoding "version 2" heads when neither config.json nor the base model gives it.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(
            f"{directory} is not a directory: download the checkpoint first (huggingface-cli download ...)"
        )
    if format is None:
        format = detect_medusa_format(directory)  # noqa: A001
        if format is None:
            found = sorted(p.name for p in directory.iterdir())[:10]
            raise ValueError(
                f"{directory} is in no known Medusa layout (found {found}): expected config.json with "
                f"{' or '.join(FASTDECODING_WEIGHTS)} (FasterDecoding), or config.json with model_type "
                "'medusa' "
                "and *.safetensors (vLLM)"
            )
    if format == "fastdecoding-medusa":
        return _import_fastdecoding(directory, base_model, vocab_size)
    if format == "vllm-medusa":
        return _import_vllm(directory, base_model)
    raise ValueError(f"unknown Medusa format {format!r}; choose one of {', '.join(MEDUSA_FORMATS)}")


# --------------------------------------------------------------------------------------------- writing


def _block(heads: MedusaHeads, h: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    linear = heads.heads[h][i].linear
    return linear.weight.detach().cpu().contiguous(), linear.bias.detach().cpu().contiguous()


def _projections(heads: MedusaHeads, lm_head_weight: torch.Tensor | None, fmt: str) -> list[torch.Tensor]:
    cfg = heads.config
    if not cfg.share_lm_head:
        return [
            heads.heads[h][cfg.num_layers].weight.detach().cpu().contiguous() for h in range(cfg.num_heads)
        ]
    if lm_head_weight is None:
        raise ValueError(
            f"these heads share the target's lm_head, but {fmt} needs one vocab projection per head: pass "
            "lm_head_weight=model.get_output_embeddings().weight to copy it into every head"
        )
    if tuple(lm_head_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(
            f"lm_head_weight has shape {tuple(lm_head_weight.shape)}, the heads expect "
            f"({cfg.vocab_size}, {cfg.hidden_size}): is it the right target's lm_head?"
        )
    dtype = getattr(torch, cfg.dtype)
    # One copy per head: safetensors refuses tensors that share memory.
    return [lm_head_weight.detach().to("cpu", dtype).clone().contiguous() for _ in range(cfg.num_heads)]


def _write(out: Path, name: str, write: Callable[[str], Any]) -> None:
    atomic_write(out / name, write)


def _write_json(out: Path, data: dict[str, Any]) -> None:
    _write(out, "config.json", lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2) + "\n"))


def _save_safetensors(out: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    _write(out, name, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def export_medusa(
    heads: MedusaHeads,
    fmt: str,
    out_dir: str | Path,
    lm_head_weight: torch.Tensor | None = None,
    write_pt: bool = False,
    per_head_projections: bool = False,
) -> None:
    """Write `heads` in a published layout: the exact file names, config fields and keys its loader reads.

    fastdecoding-medusa: heads with their own projections are written as v1, heads sharing the target's
    lm_head as "version 2" (no projection; TGI and the legacy FasterDecoding loader read it). With
    `per_head_projections=True` shared heads get `lm_head_weight` copied into every head and v1 is written
    (what FasterDecoding's current loader and TensorRT-LLM read). `write_pt` also writes
    medusa_lm_head.pt (FasterDecoding's own `from_pretrained` reads only that file; TGI only the safetensors).
    vllm-medusa: always one projection per head, so shared heads need `lm_head_weight`.
    """
    if not isinstance(heads, MedusaHeads):
        raise ValueError(f"export_medusa takes MedusaHeads, got {type(heads).__name__}")
    cfg = heads.config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "fastdecoding-medusa":
        projection = not cfg.share_lm_head or per_head_projections
        tensors: dict[str, torch.Tensor] = {}
        for h in range(cfg.num_heads):
            for i in range(cfg.num_layers):
                tensors[f"{h}.{i}.linear.weight"], tensors[f"{h}.{i}.linear.bias"] = _block(heads, h, i)
        if projection:
            for h, p in enumerate(_projections(heads, lm_head_weight, fmt)):
                tensors[f"{h}.{cfg.num_layers}.weight"] = p
        if not cfg.base_model:
            warnings.warn(
                "the heads name no base model: config.json gets an empty base_model_name_or_path, "
                "which FasterDecoding and TGI load the target from; set heads.config.base_model first",
                stacklevel=2,
            )
        if cfg.num_layers > 1:
            warnings.warn(
                f"{cfg.num_layers} blocks per head: FasterDecoding's own MedusaModel builds "
                "`[ResBlock(h)] * n`, one block repeated, so only TGI (v1) and TensorRT-LLM load "
                "these distinct blocks faithfully",
                stacklevel=2,
            )
        if not projection and cfg.num_layers != 1:
            warnings.warn(
                "TGI loads 'version 2' Medusa heads only with medusa_num_layers == 1; pass "
                "per_head_projections=True and lm_head_weight to write v1 instead",
                stacklevel=2,
            )
        config: dict[str, Any] = {
            "base_model_name_or_path": cfg.base_model,
            "medusa_num_heads": cfg.num_heads,
            "medusa_num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "torch_dtype": cfg.dtype,
        }
        if not projection:
            config["version"] = "2"
        _save_safetensors(out, FASTDECODING_WEIGHTS[0], tensors)
        if write_pt:
            _write(out, FASTDECODING_WEIGHTS[1], lambda tmp: torch.save(tensors, tmp))
        _write_json(out, config)
    elif fmt == "vllm-medusa":
        tensors = {}
        for h in range(cfg.num_heads):
            for i in range(cfg.num_layers):
                tensors[f"blocks.{h}.layers.{i}.weight"], tensors[f"blocks.{h}.layers.{i}.bias"] = _block(
                    heads, h, i
                )
        for h, p in enumerate(_projections(heads, lm_head_weight, fmt)):
            tensors[f"lm_heads.{h}.weight"] = p
        config = {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "num_heads": cfg.num_heads,
            "num_hidden_layers": cfg.num_layers,
            "truncated_vocab_size": cfg.vocab_size,
            "medusa_fc_bias": True,  # our blocks are biased; vLLM's default is bias-free
            "original_lm_head": False,
            "logit_scale": 1.0,
            "torch_dtype": cfg.dtype,
            "base_model_name_or_path": cfg.base_model,
        }
        _save_safetensors(out, VLLM_WEIGHTS_NAME, tensors)
        _write_json(out, config)
    else:
        raise ValueError(f"unknown Medusa format {fmt!r}; choose one of {', '.join(MEDUSA_FORMATS)}")
