"""Medusa heads in the published layouts: import them here, export ours (heads/formats/medusa_export.py).

Each layout is one `Layout` row in `LAYOUTS`: our parameter name -> the engine's tensor name, and
config.json field -> our config field. Import renames the engine's tensors with it and loads them with
`load_state_dict(strict=True)`; export renames ours the other way. Every engine computes, per head,
`x = x + SiLU(W_l x + b_l)` for each block, then a vocab projection: the function of `MedusaHeads`, so
converting is a renaming of tensors, exact in every bit.

* ``fastdecoding-medusa`` — FasterDecoding/Medusa, also read by Hugging Face TGI and TensorRT-LLM: the
  ``state_dict`` of an ``nn.ModuleList`` of ``nn.Sequential``, v1 ``{h}.{l}.linear.weight|bias`` then
  ``{h}.{n}.weight`` (the bias-free projection); "version 2" has no projection (the heads reuse the
  target's lm_head: our ``share_lm_head``). The weights tell them apart, as TGI does, never the config's
  ``version``. Import reads both; export writes v1 (shared heads get the target's lm_head copied into
  every head) as ``medusa_lm_head.pt`` (FasterDecoding reads only that) and ``.safetensors`` (TGI).
* ``vllm-medusa`` — vLLM's Medusa drafter: ``model.safetensors`` with ``blocks.{h}.layers.{l}.weight|bias``
  and ``lm_heads.{h}.weight``; config.json ``"model_type": "medusa"``, ``"architectures": ["MedusaModel"]``.

Sources read (what each loader expects, taken from its own code):

* FasterDecoding/Medusa ``medusa/model/medusa_model.py`` @ 95f1271bde7912c8e61a868b36233a0c6ef13666 (its
  last change; the same at upstream main e2a5d20c048a9b0a4092e6933c34313687422518), earlier @ 11af0aa5 and
  60eeab92: heads ``nn.Sequential(*([ResBlock(H)] * n), nn.Linear(H, V, bias=False))``, ``ResBlock.linear =
  nn.Linear(H, H)``. ``MedusaModel.from_pretrained``: ``AutoConfig`` on the heads folder fails (no
  ``model_type``), so it reads ``MedusaConfig(medusa_num_heads, medusa_num_layers, base_model_name_or_path)``
  and loads the target from ``AutoConfig.from_pretrained(base_model_name_or_path)`` (a real path or Hub id;
  llama or mistral); ``medusa_num_heads = 5  # TODO: fix the uploaded config`` whatever config.json says
  (published configs say 2 where the weights hold 5: hence "trust the weights" below); weights only from
  ``medusa_lm_head.pt``, ``torch.load`` then ``load_state_dict(strict=False)``.
* FasterDecoding/Medusa ``medusa/model/medusa_model_legacy.py`` @ 2b8020f2fff7a8dfbec50fd18d3640e5d8a5fa39,
  ``medusa/train/train_legacy.py`` @ e2a5d20c: "version 2", ``nn.Sequential(*([ResBlock(H)] * n))`` on
  ``base_model.lm_head``, saved as ``medusa_lm_head.safetensors`` with ``MedusaConfig(..., version="2")``.
* huggingface/text-generation-inference ``server/text_generation_server/layers/medusa.py`` @
  f32fdd0fa16411512f09a14d0304869b5aeba73c (``MedusaHeadV1``: ``{i}.{j}.linear`` biased, ``{i}.{n}`` not;
  ``MedusaHeadV2``: ``assert medusa_config["medusa_num_layers"] == 1``), ``layers/speculative.py`` @
  c09f5bc93071e2701e201bb374d488e4673fac3d (a config with ``architectures`` is not Medusa; ``try:
  MedusaHeadV1.load(...) except: MedusaHeadV2(...)``), ``models/__init__.py`` ``get_model``
  (``"medusa_num_heads" in config_dict`` selects Medusa; weights only from ``medusa_lm_head.safetensors``).
* vllm-project/vllm ``vllm/model_executor/models/medusa.py`` @ 09cddad8f0324594022359cd2b07e962a14b895f and
  01dbb08195ca9c70ac9044786a906a353e07fcdf: ``ResidualBlock.layers[l] = nn.Linear(H, H,
  bias=getattr(config, "medusa_fc_bias", False))``; one ``lm_heads[h]`` per head, or with ``original_lm_head``
  one, loaded from ``lm_heads.0.weight``; ``logit_scale`` (default 1.0); ``load_weights`` strips
  ``medusa_heads.`` and drops names it has no parameter for; ``token_map`` only when ``truncated_vocab_size
  < vocab_size``. ``vllm/transformers_utils/configs/medusa.py`` @ 0531c2226a6a25cd96ccc856f3bda3f0bb4efb5f:
  ``from_pretrained`` renames any key containing "num" and "heads" to ``num_heads``, "num" and "layers" to
  ``num_hidden_layers``. The first vLLM Medusa (bias-free, no ``medusa_fc_bias``) drops block biases.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from selfspec.heads.config import DTYPES, HeadsConfig
from selfspec.heads.formats.checkpoint import Checkpoint
from selfspec.heads.io import read_state_dict
from selfspec.heads.medusa import MedusaHeads
from selfspec.shipped.models import resolve_model


@dataclasses.dataclass(frozen=True)
class Layout:
    """One engine's files. `{h}` is a head, `{l}` a residual block, `{n}` the number of blocks per head."""

    weights: tuple[str, ...]  # the weight files written, and read (the first one present)
    keys: dict[str, str]  # our parameter -> the engine's tensor
    config: dict[str, str]  # config.json field -> our HeadsConfig field
    constants: dict[str, Any]  # config.json fields of fixed value
    drops_unknown: bool  # the engine's loader ignores tensors outside `keys` (else: an error here)


LAYOUTS = {
    "fastdecoding-medusa": Layout(
        weights=("medusa_lm_head.safetensors", "medusa_lm_head.pt"),
        keys={
            "heads.{h}.{l}.linear.weight": "{h}.{l}.linear.weight",
            "heads.{h}.{l}.linear.bias": "{h}.{l}.linear.bias",
            "heads.{h}.{n}.weight": "{h}.{n}.weight",
        },
        config={
            "medusa_num_heads": "num_heads",
            "medusa_num_layers": "num_layers",
            "hidden_size": "hidden_size",
            "vocab_size": "vocab_size",
            "torch_dtype": "dtype",
            "base_model_name_or_path": "base_model",
        },
        constants={},  # no model_type / architectures: FasterDecoding would try AutoConfig, TGI skip Medusa
        drops_unknown=False,  # a stray tensor means another format (a full Medusa-2 model): say so
    ),
    "vllm-medusa": Layout(
        weights=("model.safetensors",),
        keys={
            "heads.{h}.{l}.linear.weight": "blocks.{h}.layers.{l}.weight",
            "heads.{h}.{l}.linear.bias": "blocks.{h}.layers.{l}.bias",
            "heads.{h}.{n}.weight": "lm_heads.{h}.weight",
        },
        config={
            "num_heads": "num_heads",
            "num_hidden_layers": "num_layers",
            "hidden_size": "hidden_size",
            "vocab_size": "vocab_size",
            "truncated_vocab_size": "vocab_size",
            "torch_dtype": "dtype",
            "base_model_name_or_path": "base_model",
        },
        constants={
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "medusa_fc_bias": True,
            "original_lm_head": False,
            "logit_scale": 1.0,
        },
        drops_unknown=True,  # as vLLM's load_weights does
    ),
}
MEDUSA_FORMATS = tuple(LAYOUTS)


@functools.cache
def _regex(template: str) -> re.Pattern[str]:
    return re.compile(re.sub(r"\\\{(\w)\\\}", r"(?P<\1>\\d+)", re.escape(template)))


def _rename(key: str, table: dict[str, str], num_layers: int) -> str | None:
    """`key` through the first row of `table` (template -> template) it matches; None if none does."""
    for src, dst in table.items():
        if m := _regex(src).fullmatch(key):
            return dst.format(**{"n": num_layers, **m.groupdict()})
    return None


def engine_keys(
    fmt: str, num_heads: int, num_layers: int, projection: bool = True, bias: bool = True
) -> list[str]:
    """Every tensor the `fmt` loader reads, head by head; `projection=False` is FasterDecoding "version 2"."""
    ours = []
    for h in range(num_heads):
        for i in range(num_layers):
            ours += [f"heads.{h}.{i}.linear.weight", *([f"heads.{h}.{i}.linear.bias"] if bias else [])]
        ours += [f"heads.{h}.{num_layers}.weight"] if projection else []
    return [_rename(k, LAYOUTS[fmt].keys, num_layers) for k in ours]


def load_strict(
    module: nn.Module,
    state: dict[str, torch.Tensor],
    where: Path | str,
    name: Callable[[str], str | None] = lambda k: k,
    integers: tuple[str, ...] = (),
) -> None:
    """`module.load_state_dict(state, strict=True)`; a refusal is one line naming `where` and the file's own
    names for the missing, unexpected and misshapen tensors (`name` maps ours back to the file's). Only the
    tensors named in `integers` may be other than floating point (quantized weights are refused)."""
    for k, v in state.items():
        if k not in integers and not v.is_floating_point():
            raise ValueError(
                f"{where}: {name(k)} is {v.dtype}; quantized drafters are not supported: dequantize it"
            )
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError:
        want = module.state_dict()
        problems = [
            f"{what} {sorted(name(k) or k for k in keys)[:6]}"
            for what, keys in (("missing", set(want) - set(state)), ("unexpected", set(state) - set(want)))
            if keys
        ]
        problems += [
            f"{name(k)} has shape {tuple(v.shape)}, expected {tuple(want[k].shape)}"
            for k, v in state.items()
            if k in want and v.shape != want[k].shape
        ]
        raise ValueError(
            f"{where}: the tensors do not form the drafter its config describes: {'; '.join(problems)}"
        ) from None


# --------------------------------------------------------------------------------------------- reading


def _count(declared: Any, found: int, what: str, field: str, path: Path) -> int:
    """The weights decide: a config claiming fewer is a known publishing slip (warned), more is an error."""
    if declared is None or declared == found:
        return found
    if not isinstance(declared, int) or isinstance(declared, bool) or declared < 0:
        raise ValueError(f"{path.parent / 'config.json'}: {field} = {declared!r} is not a count")
    if declared > found:
        raise ValueError(
            f"{path.parent / 'config.json'} says {field} = {declared} but {path.name} holds only "
            f"{found} {what}: the weights file is incomplete or belongs to another checkpoint; "
            "re-download it"
        )
    warnings.warn(
        f"config.json says {field} = {declared} but {path.name} holds {found} {what}; trusting the "
        f"weights and using {found} (published Medusa configs often under-count)",
        stacklevel=4,
    )
    return found


def _vocab_for_shared(base_model: str, path: Path) -> int:
    """ "Version 2" heads hold no vocab-sized tensor: the target's config gives V."""
    from transformers import AutoConfig

    reason = "no base model is named"
    if base_model:
        try:
            return int(AutoConfig.from_pretrained(resolve_model(base_model)).get_text_config().vocab_size)
        except Exception as e:  # offline, missing, or not a causal LM config
            reason = f"reading the base model {base_model!r} failed ({type(e).__name__}: {e})"
    raise ValueError(
        f"{path} has no per-head vocab projection (Medusa 'version 2': the heads reuse the "
        f"target's lm_head), so the vocabulary size is not in the weights, and {reason}: pass "
        "vocab_size= / --vocab-size (the target's lm_head rows) or base_model= / --base-model "
        "(a local path or cached hub id)"
    )


def _vllm_config(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    if raw.get("model_type") != "medusa":
        raise ValueError(
            f"{path}: model_type is {raw.get('model_type')!r}, vLLM's Medusa layout has 'medusa'"
        )
    renamed = dict(raw)  # as vLLM's MedusaConfig.from_pretrained: by substring
    for key in raw:
        if "num" in key and ("heads" in key or "layers" in key):
            renamed["num_heads" if "heads" in key else "num_hidden_layers"] = renamed.pop(key)
    vocab, truncated = renamed.get("vocab_size"), renamed.get("truncated_vocab_size")
    if vocab is not None and truncated is not None and truncated < vocab:
        raise ValueError(
            f"{path}: truncated_vocab_size {truncated} < vocab_size {vocab} (a token_map draft "
            "vocabulary): heads here draft over the target's whole vocabulary; export the checkpoint "
            "without a token_map"
        )
    return renamed


def _weight_files(directory: Path, fmt: str) -> list[Path]:
    if fmt == "vllm-medusa":  # vLLM's default loader: *.safetensors when present, else the PyTorch pickles
        return next(
            (f for f in (sorted(directory.glob(p)) for p in ("*.safetensors", "*.bin", "*.pt")) if f), []
        )
    return [directory / n for n in LAYOUTS[fmt].weights if (directory / n).is_file()][:1]


def _engine_state(directory: Path, fmt: str, raw: dict[str, Any]) -> tuple[Path, dict[str, torch.Tensor]]:
    """The first weights file and every tensor, named as the engine's loader names them."""
    files = _weight_files(directory, fmt)
    if not files:
        raise ValueError(
            f"{directory} has config.json but none of its weights ({' or '.join(LAYOUTS[fmt].weights)})"
        )
    state = {k: v for f in files for k, v in read_state_dict(f).items()}
    if fmt == "vllm-medusa":
        state = {k.replace("medusa_heads.", ""): v for k, v in state.items()}  # as vLLM's load_weights does
        if raw.get("original_lm_head"):  # one projection, every head's
            shared = state.pop("lm_heads.0.weight", None)
            shared = state.pop("lm_head.weight", None) if shared is None else shared
            if shared is None:
                raise ValueError(
                    f"{files[0]}: original_lm_head is set but neither lm_heads.0.weight nor "
                    "lm_head.weight is there"
                )
            heads = {int(k.split(".")[1]) for k in state if k.startswith("blocks.")}
            state |= {f"lm_heads.{h}.weight": shared for h in heads}
    return files[0], state


def _import(checkpoint: Checkpoint, fmt: str, base_model: str | None, vocab_size: int | None) -> MedusaHeads:
    directory = checkpoint.path
    layout, cfg_path = LAYOUTS[fmt], directory / "config.json"
    raw = checkpoint.require_config()
    raw = _vllm_config(raw, cfg_path) if fmt == "vllm-medusa" else raw
    path, state = _engine_state(directory, fmt, raw)
    block = _regex(layout.keys["heads.{h}.{l}.linear.weight"])
    blocks = [m.groupdict() for k in state if (m := block.fullmatch(k))]
    if not blocks:
        raise ValueError(
            f"{path}: no residual block ({block.pattern}): not the {fmt} layout, or heads without "
            "blocks, which are not supported here"
        )
    found_heads, num_layers = 1 + max(int(b["h"]) for b in blocks), 1 + max(int(b["l"]) for b in blocks)
    named = {k: _rename(k, {theirs: ours for ours, theirs in layout.keys.items()}, num_layers) for k in state}
    unknown = sorted(k for k, ours in named.items() if ours is None)
    if unknown and not layout.drops_unknown:
        raise ValueError(
            f"{path} has keys outside the {fmt} layout ({', '.join(layout.keys.values())}): "
            f"{unknown[:5]}; is this a full Medusa-2 model or another format?"
        )
    ours = {named[k]: v for k, v in state.items() if named[k] is not None}
    declared = {mine: raw[field] for field, mine in layout.config.items() if raw.get(field) is not None}
    field = {mine: field for field, mine in layout.config.items()}  # ours -> config.json's, for messages
    num_heads = _count(declared.get("num_heads"), found_heads, "heads", field["num_heads"], path)
    num_layers = _count(
        declared.get("num_layers"), num_layers, "residual blocks per head", field["num_layers"], path
    )
    if fmt == "vllm-medusa" and not raw.get("medusa_fc_bias", False):  # vLLM builds bias-free blocks
        if any(k.endswith(".bias") for k in ours):
            warnings.warn(
                f"{path.name} has block biases but config.json has no medusa_fc_bias: true, so vLLM "
                "builds bias-free layers and drops them; importing what vLLM computes (biases ignored)",
                stacklevel=3,
            )
        ours |= {
            k.removesuffix("weight") + "bias": torch.zeros(v.shape[0], dtype=v.dtype)
            for k, v in ours.items()
            if k.endswith(".linear.weight")
        }
    projection = f".{num_layers}.weight"
    scale = float(raw.get("logit_scale", 1.0)) if fmt == "vllm-medusa" else 1.0  # vLLM scales the logits
    ours |= {k: v * scale for k, v in ours.items() if k.endswith(projection) and scale != 1.0}
    first = next(v for k, v in ours.items() if k.endswith(".linear.weight"))
    vocabs = [v.shape[0] for k, v in ours.items() if k.endswith(projection)]
    dtype = str(first.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(
            f"{path} holds {dtype} tensors; Medusa heads here are one of {', '.join(DTYPES)}: cast them"
        )
    base = base_model if base_model is not None else str(declared.get("base_model") or "")
    hidden = first.shape[0]
    vocab = vocabs[0] if vocabs else vocab_size or declared.get("vocab_size") or _vocab_for_shared(base, path)
    for mine, value in (("hidden_size", hidden), ("vocab_size", vocab)):
        if declared.get(mine, value) != value:
            raise ValueError(
                f"{cfg_path}: {field[mine]} is {declared[mine]} but the weights in {path.name} make "
                f"it {value}"
            )
    if vocab_size is not None and vocab_size != vocab:
        raise ValueError(
            f"vocab_size={vocab_size} was passed but the projections in {path} have {vocab} rows"
        )
    config = HeadsConfig(
        kind="medusa",
        base_model=base,
        hidden_size=hidden,
        vocab_size=vocab,
        num_heads=num_heads,
        num_layers=num_layers,
        share_lm_head=not vocabs,
        dtype=dtype,
    )
    heads = MedusaHeads(config).to(first.dtype)
    load_strict(
        heads,
        {k: v.to(first.dtype) for k, v in ours.items()},
        path,
        lambda k: _rename(k, layout.keys, num_layers),
    )
    return heads.eval()


def detect_medusa_format(directory: str | Path | Checkpoint) -> str | None:
    """Which published Medusa layout a directory holds, from its file names and config; None if neither.
    A config.json that is not JSON is an error naming the file and line."""
    checkpoint = Checkpoint.read(directory)
    if _weight_files(checkpoint.path, "fastdecoding-medusa"):
        return "fastdecoding-medusa"
    if (checkpoint.config or {}).get("model_type") == "medusa" and _weight_files(
        checkpoint.path, "vllm-medusa"
    ):
        return "vllm-medusa"
    return None


def import_medusa(
    directory: str | Path | Checkpoint,
    format: str | None = None,  # noqa: A002
    base_model: str | None = None,
    vocab_size: int | None = None,
) -> MedusaHeads:
    """Load published Medusa heads as `MedusaHeads`: config from the files, shapes and dtype from the weights.

    `format` is detected when None. `base_model` overrides the target named in the files. `vocab_size`
    is only needed for FasterDecoding "version 2" heads when neither config.json nor the base model gives it.
    """
    checkpoint = Checkpoint.read(directory)
    directory = checkpoint.path
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory: download the checkpoint first (hf download ...)")
    fmt = format or detect_medusa_format(checkpoint)
    if fmt is None:
        found = sorted(p.name for p in directory.iterdir())[:10]
        raise ValueError(
            f"{directory} is in no known Medusa layout (found {found}): expected config.json with "
            f"{' or '.join(LAYOUTS['fastdecoding-medusa'].weights)} (FasterDecoding), or config.json "
            "with model_type 'medusa' and *.safetensors (vLLM)"
        )
    if fmt not in LAYOUTS:
        raise ValueError(f"unknown Medusa format {fmt!r}; choose one of {', '.join(MEDUSA_FORMATS)}")
    return _import(checkpoint, fmt, base_model, vocab_size)
