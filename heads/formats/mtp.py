"""MTP layers in the target's own checkpoint: read with transformers' MtpModel loader, written back under the
key names the published checkpoints use, so that the folder serves as it is (vLLM / SGLang `method: "mtp"`).

Three layouts, by the target's architecture (checked against transformers 5.25's conversion_mapping "MtpModel"
entry, which reads all three; the first against vLLM 0.11's deepseek_mtp / glm4_moe_mtp loaders, the second
against vLLM's ernie_mtp loader at vllm-project/vllm 028aedf):

`layers` (DeepSeek-V3, GLM-4.5 / 4.6 / 4.7 and the others that store MTP layer k as decoder layer
num_hidden_layers + k):

    model.layers.{L+k}.enorm.weight, .hnorm.weight, .eh_proj.weight
        the MTP layer's own input norms and projection
    model.layers.{L+k}.shared_head.norm.weight
        its output norm (MtpLayer.post_norm)
    model.layers.{L+k}.self_attn.* / .mlp.* / .*_layernorm.*
        its decoder block, named as the target's layers
    model.layers.{L+k}.embed_tokens.weight, .shared_head.head.weight
        copies of the target's embedding and lm_head

`ernie` (Ernie-4.5-MoE): model.mtp_emb_norm.{k}, model.mtp_hidden_norm.{k}, model.mtp_linear_proj.{k} and the
block as model.mtp_block.{k}.*; the output norm is the target's own final norm (model.norm), so none is
written (and fine-tuning leaves it as the target has it).

`mellum` (Mellum, one MTP layer): mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.fc, mtp.norm and the
block as mtp.layers.0.*.

The decoder block's tensors go through transformers' own reverse conversions (MoE experts one by one, as the
target's layers are stored).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from selfspec.heads.mtp import MtpDraft, mtp_config_for, mtp_layer_count, mtp_model_class
from selfspec.shipped.models import resolve_model

LAYOUTS = ("mtp",)
MTP_WEIGHTS = "model-mtp.safetensors"
INDEX = "model.safetensors.index.json"


LAYOUT_BY_TYPE = {
    "ernie4_5_moe": "ernie",
    "mellum": "mellum",
}  # the others: `layers`, where the class says so


def checkpoint_layout(target: nn.Module) -> str | None:
    """The layout the target's checkpoints store MTP layers in (see the module docstring); None: one selfspec
    does not write."""
    kind = LAYOUT_BY_TYPE.get(target.config.get_text_config().model_type)
    return kind or ("layers" if layers_layout(target) else None)


def shares_output_norm(target: nn.Module) -> bool:
    """Whether the target's MTP layers read its final norm as their output norm (Ernie-4.5): the checkpoint
    holds no norm of theirs, so training must leave it as the target's."""
    return checkpoint_layout(target) == "ernie"


def layers_layout(target: nn.Module) -> bool:
    """Whether the target's checkpoints store MTP layer k as decoder layer num_hidden_layers + k (or, a target
    without MTP layers of its own, whose new ones can be stored so)."""
    patterns = getattr(type(target), "_keys_to_ignore_on_load_unexpected", None) or []
    if any(re.match(r"model\\\.layers\\\.\d+", p) for p in patterns):
        return True
    return not mtp_layer_count(target.config) and not any("mtp" in p for p in patterns)


def own_mtp_keys(target: nn.Module, call: Callable | None = None) -> Any:
    """Within (a context manager), or around each call of `call`: transformers' MTP loader also finds this
    target's MTP layers stored as decoder layers num_hidden_layers + k. Its model classes name only the
    published sizes' layer numbers (GLM-4.5's 92 and 46, DeepSeek-V3's 61), so a smaller or a new target's
    would go unread."""
    hidden = target.config.get_text_config().num_hidden_layers
    own = [rf"model\.layers\.{hidden + k}\..*" for k in range(max(mtp_layer_count(target.config), 1))]

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        target._keys_to_ignore_on_load_unexpected = (
            list(type(target)._keys_to_ignore_on_load_unexpected or []) + own
        )
        try:
            yield
        finally:
            del target._keys_to_ignore_on_load_unexpected

    if call is None:
        return scope()

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with scope():
            return call(*args, **kwargs)

    return wrapped


def load_target_mtp(target: nn.Module, base_model: str, device: str | torch.device = "cpu") -> MtpDraft:
    """The target's own MTP layers, read from its checkpoint (config.name_or_path) by transformers' MtpModel
    loader; a target without them is a one-line error."""
    mtp_model = mtp_model_class()  # an older transformers is named first
    layers = mtp_layer_count(target.config)
    if not layers:
        raise ValueError(
            f"{base_model} has no MTP layers (its config declares no num_mtp_layers): use another "
            "drafter, or give it new ones with `accelerate launch train/mtp.py --new_layers 1`"
        )
    dtype = target.get_output_embeddings().weight.dtype
    draft = MtpDraft(mtp_config_for(target, base_model, dtype=str(dtype).removeprefix("torch.")))
    draft = draft.to(device=device, dtype=dtype)
    shared = ("embed_tokens.", "shared_head.", "rotary_emb.")
    try:
        with own_mtp_keys(target):
            loaded = mtp_model.from_pretrained(target, device_map={"": torch.device(device)})
        draft.mtp.load_state_dict({k: v for k, v in loaded.state_dict().items() if not k.startswith(shared)})
    except (RuntimeError, OSError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{base_model}: its MTP weights could not be read ({first[:300]})") from None
    return draft.bind(target.get_output_embeddings())


def _layers_key(hidden: int, k: int, part: str) -> str | None:
    if part.startswith("post_norm."):
        part = "shared_head.norm." + part.removeprefix("post_norm.")
    return f"model.layers.{hidden + k}.{part.removeprefix('mtp_block.')}"


ERNIE_PARTS = {"enorm.": "mtp_emb_norm", "hnorm.": "mtp_hidden_norm", "eh_proj.": "mtp_linear_proj"}
MELLUM_PARTS = {"enorm.": "pre_fc_norm_embedding.", "hnorm.": "pre_fc_norm_hidden.", "eh_proj.": "fc."}


def _ernie_key(hidden: int, k: int, part: str) -> str | None:
    if part.startswith("post_norm."):
        return None  # the target's own model.norm
    if part.startswith("mtp_block."):
        return f"model.mtp_block.{k}.{part.removeprefix('mtp_block.')}"
    prefix = _part(ERNIE_PARTS, part)
    return f"model.{ERNIE_PARTS[prefix]}.{k}.{part.removeprefix(prefix)}"


def _mellum_key(hidden: int, k: int, part: str) -> str | None:
    if k:
        raise ValueError("Mellum's checkpoint layout holds one MTP layer; this drafter has more")
    if part.startswith("mtp_block."):
        return f"mtp.layers.0.{part.removeprefix('mtp_block.')}"
    if part.startswith("post_norm."):
        return "mtp.norm." + part.removeprefix("post_norm.")
    prefix = _part(MELLUM_PARTS, part)
    return "mtp." + MELLUM_PARTS[prefix] + part.removeprefix(prefix)


def _part(parts: dict[str, str], name: str) -> str:
    """The MTP layer's own part `name` belongs to (one of `parts`); a one-line error for anything else."""
    for prefix in parts:
        if name.startswith(prefix):
            return prefix
    raise ValueError(f"the MTP layout has no place for an MTP layer's {name!r}")


WRITERS = {"layers": _layers_key, "ernie": _ernie_key, "mellum": _mellum_key}


def published_tensors(draft: MtpDraft, target: nn.Module) -> dict[str, torch.Tensor]:
    """The MTP layers' tensors under the target checkpoint's key names (see the module docstring)."""
    from transformers.core_model_loading import revert_weight_conversion

    layout = checkpoint_layout(target)
    if layout is None:
        raise ValueError(
            f"{target.config.model_type} stores its MTP layers in a layout selfspec does not write yet (it "
            "writes num_hidden_layers + k as DeepSeek-V3 and GLM-4.5 do, Ernie-4.5's and Mellum's)"
        )
    hidden = target.config.get_text_config().num_hidden_layers
    state: dict[str, torch.Tensor] = {}
    for key, value in draft.mtp.state_dict().items():
        match = re.match(r"layers\.(\d+)\.(.*)", key)
        if match is None:
            raise ValueError(f"the MTP layout has no place for {key!r} (a norm shared by all MTP layers)")
        k, part = int(match.group(1)), match.group(2)
        if layout == "ernie" and part.startswith("post_norm."):
            final = target.get_decoder().norm.weight
            if not torch.equal(value.to(final.device, final.dtype), final):
                raise ValueError(
                    "Ernie-4.5's MTP layers use the target's final norm (model.norm) as their output norm; "
                    "this drafter's differs, which its checkpoint cannot hold: train with it frozen"
                )
        name = WRITERS[layout](hidden, k, part)
        if name is not None:
            state[name] = value
    state = revert_weight_conversion(target, state)
    for k in range(draft.config.num_layers if layout == "layers" else 0):
        # copies (a tied embedding and lm_head would otherwise be one tensor twice, which safetensors refuses)
        state[f"model.layers.{hidden + k}.embed_tokens.weight"] = (
            target.get_input_embeddings().weight.detach().clone()
        )
        state[f"model.layers.{hidden + k}.shared_head.head.weight"] = (
            target.get_output_embeddings().weight.detach().clone()
        )
    dtype = next(target.parameters()).dtype  # stored as the target's own layers are
    return {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}


def export_as(
    draft: MtpDraft,
    fmt: str,
    out_dir: str | Path,
    target: nn.Module | None = None,
    base_model: str | None = None,
    weights: str | None = None,
) -> None:
    """Write the target with these MTP layers as one model folder (its config, tokenizer and weights, the MTP
    tensors among them: in model.safetensors, or a shard of their own listed in the index of a sharded
    target)."""
    if fmt not in LAYOUTS:
        raise ValueError(f"unknown MTP format {fmt!r}; choose one of {', '.join(LAYOUTS)}")
    if target is None:
        raise ValueError(
            "an MTP export is the whole target with its MTP layers: give the target (--model, or target=)"
        )
    if weights not in (None, "safetensors"):
        raise ValueError(
            "an MTP export is written as safetensors (what the engines read), not " + str(weights)
        )
    tensors = published_tensors(draft, target)  # before anything is written: a layout error leaves no folder
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = target.config.get_text_config()
    previous = getattr(text, "num_mtp_layers", None)
    text.num_mtp_layers = draft.config.num_layers
    try:
        target.save_pretrained(out)
    finally:
        if previous is None:
            del text.num_mtp_layers
        else:
            text.num_mtp_layers = previous
    index_path = out / INDEX
    if index_path.is_file():  # a sharded checkpoint: one more shard, listed in the index
        save_file(tensors, str(out / MTP_WEIGHTS), metadata={"format": "pt"})
        index = json.loads(index_path.read_text())
        index["weight_map"].update(dict.fromkeys(tensors, MTP_WEIGHTS))
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    else:  # one file (which loaders read without looking for an index): the MTP tensors go into it
        single = out / "model.safetensors"
        save_file(load_file(str(single)) | tensors, str(single), metadata={"format": "pt"})
    save_tokenizer(target, out)


def save_tokenizer(target: nn.Module, out: Path) -> None:
    """The target's tokenizer (and chat template) beside it, as the engines load it; a warning where it cannot
    be read (a Hub target offline)."""
    import warnings

    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(resolve_model(target.config.name_or_path)).save_pretrained(out)
    except (OSError, ValueError) as e:
        warnings.warn(
            f"the export has no tokenizer ({str(e).splitlines()[0][:200]}): copy the target's tokenizer "
            f"files into {out} before serving it",
            UserWarning,
            stacklevel=2,
        )
