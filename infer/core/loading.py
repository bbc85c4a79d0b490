"""What `SpeculativeModel.from_pretrained` loads: the drafter, and the target it names with transformers'
loading options (device_map, dtype, attn_implementation, revision, token), or the caller's own model as it
is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from selfspec.heads.config import check_compatible
from selfspec.heads.families import family
from selfspec.heads.io import PretrainedHeads
from selfspec.heads.registry import load_heads
from selfspec.heads.target import check_adapted, load_target
from selfspec.infer.core.arguments import same_device, unavailable_device
from selfspec.infer.drafters.drafter import Drafter
from selfspec.infer.drafters.proposers import TREE_OPTIONS


def as_dtype(value: torch.dtype | str | None) -> torch.dtype | str | None:
    """A dtype as transformers takes it: a torch.dtype, its name ("bfloat16", "torch.bfloat16"), "auto" or
    None."""
    if value is None or isinstance(value, torch.dtype) or value == "auto":
        return value
    name = str(value).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(
            f"dtype {value!r} is not a torch dtype: give e.g. torch.bfloat16, 'bfloat16' or 'auto'"
        )
    return getattr(torch, name)


def target_placement(
    device_map: Any,
    device: str | torch.device | None,
    dtype: torch.dtype | str | None,
    torch_dtype: torch.dtype | str | None,
) -> tuple[Any, torch.dtype | str | None]:
    """from_pretrained's device_map and dtype, each of which it takes under two names (`device`: a single
    device's device_map; `torch_dtype`: dtype's old name); two that disagree are an error."""
    dtype, other = as_dtype(dtype), as_dtype(torch_dtype)
    if other is not None and dtype is not None and other != dtype:
        raise ValueError(
            f"dtype={dtype} and torch_dtype={other} disagree: pass dtype alone (torch_dtype is its old name)"
        )
    dtype = dtype if dtype is not None else other
    if device is not None and device_map is not None and str(device) != str(device_map):
        raise ValueError(f"device={device} and device_map={device_map} disagree: pass device_map alone")
    device_map = device_map if device_map is not None else device
    for place in device_map.values() if isinstance(device_map, dict) else [device_map]:
        if (
            isinstance(place, (str, torch.device))
            and str(place) not in ("auto", "disk", "meta")
            and (why := unavailable_device(str(place))) is not None
        ):
            raise ValueError(f"device_map={device_map!r}: {why}")
    return device_map, dtype


def refuse_unknown(kwargs: dict[str, Any]) -> None:
    """One line naming the first argument from_pretrained does not take (and the right name for the old
    ones)."""
    if not kwargs:
        return
    name = next(iter(kwargs))
    renamed = {old: new for new, old in TREE_OPTIONS.items()}
    if name in renamed:
        raise ValueError(
            f"from_pretrained got {name}=: EAGLE's tree options are {', '.join(TREE_OPTIONS)} "
            f"(use {renamed[name]}=); sampling's top_k goes to generate"
        )
    raise ValueError(
        f"from_pretrained got an argument it does not take: {name}= (it takes model, device_map, dtype, "
        "attn_implementation, revision, token, trust_remote_code, draft_revision, tree, "
        f"{', '.join(TREE_OPTIONS)}, compile)"
    )


def check_given_model(model: torch.nn.Module, device_map: Any, dtype: torch.dtype | str | None) -> None:
    """The caller's model is used as it is, never moved or cast: a device_map or dtype it does not already
    match is an error saying so."""
    weight = model.get_output_embeddings().weight
    if device_map is not None:
        if isinstance(device_map, dict) or device_map == "auto":
            raise ValueError(
                "device_map places a target that from_pretrained loads; the model you passed is placed "
                "already: leave device_map out"
            )
        if not same_device(torch.device(device_map), weight.device):
            raise ValueError(
                f"the model you passed is on {weight.device}, not {device_map}, and it is not moved: "
                f"move it first (model.to('{device_map}')) or leave device_map out"
            )
    if isinstance(dtype, torch.dtype) and weight.dtype != dtype:
        raise ValueError(
            f"the model you passed is {str(weight.dtype).removeprefix('torch.')}, not "
            f"{str(dtype).removeprefix('torch.')}, and it is not cast: cast it first "
            f"(model.to({dtype})) or leave dtype out"
        )


def proposer_for(
    heads: torch.nn.Module,
    model: torch.nn.Module,
    tree: list[list[int]] | None = None,
    **tree_options: int | None,
) -> Drafter:
    """The proposer that drafts with these heads on this target; `tree_options` (depth, top_k, total_tokens)
    shape EAGLE's dynamic tree and DFlash's tree (top_k 1: its chain)."""
    return family(heads.config.kind).load("proposer")(heads, model, tree, **tree_options)


def given_options(target_options: dict[str, Any], device_map: Any) -> dict[str, Any]:
    """The target's from_pretrained options the caller gave (None: left to transformers), with its
    device_map."""
    options = {k: v for k, v in target_options.items() if v is not None}
    if device_map is not None:
        options["device_map"] = device_map
    return options


def load_parts(
    drafter: str | Path | PretrainedHeads,
    model: torch.nn.Module | None,
    device_map: Any,
    dtype: torch.dtype | str | None,
    target_options: dict[str, Any],
    draft_options: dict[str, Any],
    tree: list[list[int]] | None,
    tree_options: dict[str, int | None],
) -> tuple[torch.nn.Module, Drafter]:
    """The target and the proposer of `SpeculativeModel.from_pretrained` (see there)."""
    if model is not None:
        check_given_model(model, device_map, dtype)
    if isinstance(drafter, PretrainedHeads):
        heads = drafter
    else:
        heads = load_heads(drafter, base_model=getattr(model, "name_or_path", None), **draft_options)
    if model is None:
        if not heads.config.base_model and not heads.config.merged_target:
            where = "" if isinstance(drafter, PretrainedHeads) else f" in {drafter}"
            raise ValueError(
                f"the drafter{where} names no target model (SafeAILab's EAGLE checkpoints never do): "
                "pass model=..., the model it was trained for"
            )
        model = load_target(
            heads, dtype=dtype or heads.config.dtype, **given_options(target_options, device_map)
        )
    check_adapted(heads.config, model)
    check_compatible(heads.config, model)
    # the drafter reads the hidden states where the lm_head is (the last device under a device_map), in the
    # target's dtype (on CPU too: bf16 halves its weight reads, measured 6.8 vs 10.3 ms per EAGLE-3 draft on
    # the demo)
    weight = model.get_output_embeddings().weight
    heads = heads.to(device=weight.device, dtype=weight.dtype)
    return model, proposer_for(heads, model, tree, **{TREE_OPTIONS[k]: v for k, v in tree_options.items()})


def load_mtp_parts(
    name: str | Path | PretrainedHeads,
    model: torch.nn.Module | None,
    device_map: Any,
    dtype: torch.dtype | str | None,
    target_options: dict[str, Any],
    tree: list[list[int]] | None,
    tree_options: dict[str, int | None],
) -> tuple[torch.nn.Module, Drafter]:
    """The target and the proposer of `SpeculativeModel.from_pretrained(target, mtp=True)`: its own MTP
    layers."""
    from transformers import AutoModelForCausalLM

    from selfspec.heads.formats.mtp import load_target_mtp
    from selfspec.shipped.models import resolve_model

    if isinstance(name, PretrainedHeads):
        raise ValueError(
            "mtp=True drafts with the target's own MTP layers: give the target's name or path (a "
            "trained drafter, fine-tuned MTP layers included, is loaded without mtp=True)"
        )
    if model is not None:
        check_given_model(model, device_map, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            resolve_model(str(name)), dtype=dtype or "auto", **given_options(target_options, device_map)
        )
    weight = model.get_output_embeddings().weight
    heads = load_target_mtp(model, str(name), weight.device)
    return model, proposer_for(heads, model, tree, **{TREE_OPTIONS[k]: v for k, v in tree_options.items()})
