"""Published drafter checkpoints in, serving-engine layouts out: one entry point for every format.

Import detects the layout from the files (FasterDecoding Medusa v1/v2, vLLM Medusa, SafeAILab
EAGLE-1, SGLang EAGLE, SafeAILab / SGLang EAGLE-3, vllm-project/speculators EAGLE-3, z-lab and speculators DFlash);
export writes what each engine loads (fastdecoding-medusa, vllm-medusa, eagle1, sglang-eagle, eagle3,
speculators-eagle3, dflash, speculators-dflash). The layouts and their sources are in the modules beside this
one, one per family (medusa.py, eagle.py, eagle3.py, dflash.py). A folder
is read once (`Checkpoint`: its config.json and tensor names) and each layout is asked in turn whether it holds it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from torch import nn

from selfspec.heads.config import DYNAMIC_TREE_KINDS
from selfspec.heads.dflash import DFlashDraft
from selfspec.heads.eagle import EagleDraft
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.formats.checkpoint import Checkpoint
from selfspec.heads.formats.dflash import DFLASH_FORMATS, detect_dflash_format, import_dflash
from selfspec.heads.formats.dflash_export import export_dflash
from selfspec.heads.formats.eagle import EAGLE_FORMATS, detect_eagle_format, export_eagle, import_eagle
from selfspec.heads.formats.eagle3 import EAGLE3_FORMATS, detect_eagle3_format, import_eagle3
from selfspec.heads.formats.eagle3_export import export_eagle3
from selfspec.heads.formats.medusa import MEDUSA_FORMATS, detect_medusa_format, export_medusa, import_medusa
from selfspec.heads.io import PretrainedHeads
from selfspec.heads.medusa import MedusaHeads

EXPORT_FORMATS = MEDUSA_FORMATS + EAGLE_FORMATS + EAGLE3_FORMATS + DFLASH_FORMATS
# Of a drafter's target and decoding defaults, what each layout's files carry back to an importer (the modules'
# sources: Medusa configs name base_model_name_or_path; speculators' name the verifier and a chain of
# speculative_tokens; SafeAILab/SGLang configs and z-lab's DFlash config name neither). The rest is left behind.
CARRIED = {"fastdecoding-medusa": {"base_model"}, "vllm-medusa": {"base_model"}, "eagle1": set(), "sglang-eagle": set(),
           "eagle3": set(), "speculators-eagle3": {"base_model", "depth"}, "dflash": set(),
           "speculators-dflash": {"base_model"}}
# DFlash first: its folders also hold the fc.weight and layers.0.* an EAGLE-1 detector looks for
DETECTORS = (detect_dflash_format, detect_medusa_format, detect_eagle_format, detect_eagle3_format)


def detect_format(directory: str | Path | Checkpoint) -> str | None:
    """The published layout a folder holds (one of EXPORT_FORMATS), or None: the folder is read once and each
    family's detector looks at the same config and tensor names."""
    checkpoint = Checkpoint.read(directory)
    return next((fmt for detect in DETECTORS if (fmt := detect(checkpoint))), None)


def import_heads(directory: str | Path | Checkpoint, format: str | None = None, base_model: str | None = None,
                 vocab_size: int | None = None) -> PretrainedHeads:
    """Read a published checkpoint (layout detected from its files unless `format` is given). `vocab_size`
    is only for Medusa "version 2" heads whose vocabulary neither config.json nor the base model gives.
    `base_model` is what the imported config names as the target (EAGLE-3: also where the fused layers come
    from when the checkpoint names none)."""
    checkpoint = Checkpoint.read(directory)
    directory = checkpoint.path
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory: download the checkpoint first")
    fmt = format or detect_format(checkpoint)
    if fmt is None:
        if checkpoint.is_selfspec:
            raise ValueError(f"{directory} is already a selfspec drafter: use it as --heads directly (import reads "
                             "published layouts)")
        files = sorted(p.name for p in directory.iterdir())
        raise ValueError(f"{directory} holds no Medusa or EAGLE checkpoint layout this project knows (files: "
                         f"{files}): give a drafter's folder, not a model's; a drafter in a layout not detected "
                         f"is read by selfspec import --src {directory} --format <{'|'.join(EXPORT_FORMATS)}> "
                         "--out DIR")
    if fmt in MEDUSA_FORMATS:
        return import_medusa(checkpoint, fmt, base_model=base_model, vocab_size=vocab_size)
    if vocab_size is not None:
        raise ValueError(f"vocab_size is for Medusa 'version 2' heads; an {fmt} checkpoint states its own")
    if fmt in EAGLE_FORMATS:
        return import_eagle(checkpoint, fmt, base_model=base_model)
    if fmt in EAGLE3_FORMATS:
        return import_eagle3(checkpoint, fmt, base_model=base_model)
    if fmt in DFLASH_FORMATS:
        return import_dflash(checkpoint, fmt, base_model=base_model)
    raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")


def export_heads(heads: PretrainedHeads, fmt: str, out_dir: str | Path, target: nn.Module | None = None,
                 base_model: str | None = None, weights: str | None = None) -> None:
    """Write `heads` in an engine's layout. `target` supplies weights some layouts carry (the lm_head for
    Medusa heads that share it, the embedding in the EAGLE-1 layouts, the verifier's architectures and depth
    for EAGLE-3). `base_model` (Medusa layouts, speculators-eagle3) is what config.json names as the target,
    default the heads' own; `weights` (EAGLE layouts) picks "safetensors" or "bin" (pytorch_model.bin, what
    SafeAILab's code reads first)."""
    if fmt in MEDUSA_FORMATS:
        if not isinstance(heads, MedusaHeads):
            raise ValueError(f"{fmt} is a Medusa layout but these heads are {heads.config.kind}")
        if weights is not None:
            raise ValueError(f"{fmt} has fixed weight files; choosing them (weights={weights!r}) is for EAGLE layouts")
        lm_head = target.get_output_embeddings().weight if target is not None else None
        export_medusa(heads, fmt, out_dir, lm_head_weight=lm_head, base_model=base_model)
    elif fmt in EAGLE_FORMATS:
        if not isinstance(heads, EagleDraft):
            raise ValueError(f"{fmt} is an EAGLE-1 layout but these heads are {heads.config.kind}"
                             + (f": choose one of {', '.join(EAGLE3_FORMATS)}" if heads.config.kind == "eagle3" else ""))
        if base_model:
            raise ValueError(f"{fmt}'s config.json names no base model (its engines are given the target "
                             "separately): leave out --base-model")
        embed = target.get_input_embeddings().weight if target is not None else None
        export_eagle(heads, fmt, out_dir, embed_weight=embed, weights=weights or "safetensors")
    elif fmt in EAGLE3_FORMATS:
        if not isinstance(heads, Eagle3Draft):
            raise ValueError(f"{fmt} is an EAGLE-3 layout but these heads are {heads.config.kind}"
                             + (f": choose one of {', '.join(EAGLE_FORMATS)}" if heads.config.kind == "eagle" else ""))
        if base_model and fmt == "eagle3":
            raise ValueError(f"{fmt}'s config.json names no base model (its engines are given the target "
                             "separately): leave out --base-model")
        export_eagle3(heads, fmt, out_dir, weights=weights or "safetensors", base_model=base_model, target=target)
    elif fmt in DFLASH_FORMATS:
        if not isinstance(heads, DFlashDraft):
            raise ValueError(f"{fmt} is a DFlash layout but these heads are {heads.config.kind}")
        if base_model and fmt == "dflash":
            raise ValueError(f"{fmt}'s config.json names no base model (its engines are given the target "
                             "separately): leave out --base-model")
        export_dflash(heads, fmt, out_dir, weights=weights or "safetensors", base_model=base_model, target=target)
    else:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    if lost := left_behind(heads, fmt, base_model):
        warnings.warn(f"{fmt} has no room for {', '.join(lost)}: importing the export gives the defaults there; keep "
                      "the selfspec folder for them, or re-fit the tree with selfspec tune", UserWarning, stacklevel=2)


def left_behind(heads: PretrainedHeads, fmt: str, base_model: str | None = None) -> list[str]:
    """The settings of `heads` an export in `fmt` does not carry (CARRIED), each as `name=value`: its fitted tree
    (a static tree; EAGLE's and DFlash's depth / top_k / total_tokens, DFlash's only when not the block's chain)
    and the target it names."""
    c = heads.config
    settings: dict[str, object] = {"base_model": base_model or c.base_model}
    if c.tree is not None:
        settings["tree"] = f"{len(c.tree)} nodes"
    if c.kind in DYNAMIC_TREE_KINDS:
        chain = isinstance(heads, DFlashDraft) and c.top_k == 1 and c.depth == c.total_tokens == c.block_size - 1
        if not chain:  # a DFlash export is decoded as the block's chain
            settings |= {"depth": c.depth, "top_k": c.top_k, "total_tokens": c.total_tokens}
    return [f"{k}={v}" for k, v in settings.items() if v not in ("", None) and k not in CARRIED[fmt]]
