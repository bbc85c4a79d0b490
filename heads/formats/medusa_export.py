"""Medusa heads written in the `fastdecoding-medusa` and `vllm-medusa` layouts: the config.json each engine's
loader reads and the weights under its tensor names (the layouts and their sources:
heads/formats/medusa.py)."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from selfspec.heads.formats.medusa import LAYOUTS, MEDUSA_FORMATS, _rename
from selfspec.heads.io import atomic_write
from selfspec.heads.medusa import MedusaHeads
from selfspec.shipped.models import hub_id, resolve_model

HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
# FasterDecoding's MedusaModel.from_pretrained builds this many heads whatever config.json says.
FASTDECODING_HEADS = 5


def base_model_field(name: str, required: bool = True) -> str:
    """What config.json names as the target: a local model directory as its absolute path (`demo` as the
    shipped model's; `smollm2`, built here from a Hub model, as that Hub id), a Hub id (owner/name) as given.
    FasterDecoding and TGI load the target from it, so with `required` anything else is refused."""
    ask = "pass --base-model (base_model=): a local model directory or a Hub id (owner/name)"
    try:
        path = Path(resolve_model(name)) if name else None
    except FileNotFoundError as e:  # `demo` outside a clone of the repository
        if required:
            raise ValueError(f"{e} Or {ask}") from None
        path = None
    if path is not None and (path / "config.json").is_file():
        return hub_id(path) or str(path.resolve())
    if not required or HUB_ID.fullmatch(name):
        return name
    why = (
        f"{name!r} is neither a model directory here nor a Hub id" if name else "the heads name no base model"
    )
    raise ValueError(
        f"FasterDecoding and TGI load the target config.json's base_model_name_or_path names, and {why}: "
        f"{ask}"
    )


def export_medusa(
    heads: MedusaHeads,
    fmt: str,
    out_dir: str | Path,
    lm_head_weight: torch.Tensor | None = None,
    base_model: str | None = None,
) -> None:
    """Write `heads` in a published layout: the exact file names, config fields and keys its loader reads.

    Heads that share the target's lm_head get `lm_head_weight` (the target's) copied into every head: one
    projection per head is what FasterDecoding's current loader and vLLM read. `base_model` (default: the
    heads' own) is what config.json names as the target; fastdecoding-medusa refuses one it cannot load.
    """
    if fmt not in LAYOUTS:
        raise ValueError(f"unknown Medusa format {fmt!r}; choose one of {', '.join(MEDUSA_FORMATS)}")
    if not isinstance(heads, MedusaHeads):
        raise ValueError(f"{fmt} is a Medusa layout but these heads are {heads.config.kind}")
    layout, cfg, n = LAYOUTS[fmt], heads.config, heads.config.num_layers
    base = base_model_field(base_model or cfg.base_model, required=fmt == "fastdecoding-medusa")
    state = {k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}
    if cfg.share_lm_head:
        if lm_head_weight is None:
            raise ValueError(
                f"these heads share the target's lm_head, but {fmt}'s loader reads one vocab projection "
                "per head: pass lm_head_weight=model.get_output_embeddings().weight (on the command "
                "line, --model names the target) to copy it into every head"
            )
        if tuple(lm_head_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"lm_head_weight has shape {tuple(lm_head_weight.shape)}, the heads expect "
                f"({cfg.vocab_size}, {cfg.hidden_size}): is it the right target's lm_head?"
            )
        lm = lm_head_weight.detach().to("cpu", getattr(torch, cfg.dtype))
        state |= {
            f"heads.{h}.{n}.weight": lm.clone() for h in range(cfg.num_heads)
        }  # safetensors refuses aliases
    if fmt == "fastdecoding-medusa":
        if Path(base, "config.json").is_file():  # its loader builds the heads in the base model's shapes
            from transformers import AutoConfig

            text = AutoConfig.from_pretrained(base).get_text_config()
            if (text.hidden_size, text.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
                raise ValueError(
                    f"the base model {base} has hidden size {text.hidden_size} and vocabulary "
                    f"{text.vocab_size}, the heads {cfg.hidden_size} and {cfg.vocab_size}: name the "
                    "model they were trained for"
                )
        if n > 1:
            warnings.warn(
                f"{n} blocks per head: FasterDecoding's own MedusaModel builds `[ResBlock(h)] * n`, one "
                "block repeated, so only TGI (v1) and TensorRT-LLM load these distinct blocks faithfully",
                stacklevel=2,
            )
        if cfg.num_heads != FASTDECODING_HEADS:
            rest = (
                "ignoring the others" if cfg.num_heads > FASTDECODING_HEADS else "the missing ones untrained"
            )
            warnings.warn(
                f"{cfg.num_heads} heads: FasterDecoding's MedusaModel.from_pretrained builds "
                f"{FASTDECODING_HEADS} whatever config.json says, {rest} (TGI and TensorRT-LLM read "
                "medusa_num_heads)",
                stacklevel=2,
            )
    tensors = {_rename(k, layout.keys, n): v for k, v in state.items()}
    config = {field: getattr(cfg, mine) for field, mine in layout.config.items()} | layout.constants
    config["base_model_name_or_path"] = base
    out = Path(out_dir)
    for name in layout.weights:
        if name.endswith(".safetensors"):
            atomic_write(out / name, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        else:
            atomic_write(out / name, lambda tmp: torch.save(tensors, tmp))
    atomic_write(out / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2) + "\n"))


def export_as(
    heads: MedusaHeads,
    fmt: str,
    out_dir: str | Path,
    target: torch.nn.Module | None = None,
    base_model: str | None = None,
    weights: str | None = None,
) -> None:
    """`export_heads` for the Medusa layouts: heads that share the lm_head get the target's."""
    if weights is not None:
        raise ValueError(
            f"{fmt} has fixed weight files; choosing them (weights={weights!r}) is for EAGLE layouts"
        )
    lm_head = target.get_output_embeddings().weight if target is not None else None
    export_medusa(heads, fmt, out_dir, lm_head_weight=lm_head, base_model=base_model)
