"""Published drafter checkpoints in, serving-engine layouts out: one entry point for every format.

Import detects the layout from the files (FasterDecoding Medusa v1/v2, vLLM Medusa, SafeAILab
EAGLE-1, SGLang EAGLE, SafeAILab / SGLang EAGLE-3, vllm-project/speculators EAGLE-3, z-lab and speculators
DFlash); export writes what each engine loads (fastdecoding-medusa, vllm-medusa, eagle1, sglang-eagle, eagle3,
speculators-eagle3, dflash, speculators-dflash). The layouts and their sources are in the modules beside this
one, one per family (medusa.py, eagle.py, eagle3.py, dflash.py). A folder
is read once (`Checkpoint`: its config.json and tensor names) and each layout is asked in turn whether it
holds it.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

from torch import nn

from selfspec.heads.families import FAMILIES, export_formats, family, format_family
from selfspec.heads.formats.checkpoint import Checkpoint
from selfspec.heads.io import PretrainedHeads

EXPORT_FORMATS = export_formats()
# Of a drafter's target and decoding defaults, what each layout's files carry back to an importer (each
# family's `carried`, from its format modules' sources). The rest is left behind.
CARRIED = {fmt: carried for f in FAMILIES.values() for fmt, carried in f.carried.items()}


def detectors() -> list:
    """Each family's layout detector, those whose layouts hold names another's also matches first (DFlash
    folders hold the fc.weight and layers.0.* an EAGLE-1 detector looks for)."""
    ordered = sorted(FAMILIES.values(), key=lambda f: not f.detect_first)
    return [f.load("detect") for f in ordered if f.detect is not None]


def detect_format(directory: str | Path | Checkpoint) -> str | None:
    """The published layout a folder holds (one of EXPORT_FORMATS), or None: the folder is read once and each
    family's detector looks at the same config and tensor names."""
    checkpoint = Checkpoint.read(directory)
    return next((fmt for detect in detectors() if (fmt := detect(checkpoint))), None)


def import_heads(
    directory: str | Path | Checkpoint,
    format: str | None = None,
    base_model: str | None = None,
    vocab_size: int | None = None,
) -> PretrainedHeads:
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
            raise ValueError(
                f"{directory} is already a selfspec drafter: use it as --heads directly (import reads "
                "published layouts)"
            )
        files = sorted(p.name for p in directory.iterdir())
        raise ValueError(
            f"{directory} holds no Medusa or EAGLE checkpoint layout this project knows (files: "
            f"{files}): give a drafter's folder, not a model's; a drafter in a layout not detected "
            f"is read by selfspec import --src {directory} --format <{'|'.join(EXPORT_FORMATS)}> "
            "--out DIR"
        )
    importer = format_family(fmt).load("importer")
    if vocab_size is None:
        return importer(checkpoint, fmt, base_model=base_model)
    if "vocab_size" not in inspect.signature(importer).parameters:
        raise ValueError(f"vocab_size is for Medusa 'version 2' heads; an {fmt} checkpoint states its own")
    return importer(checkpoint, fmt, base_model=base_model, vocab_size=vocab_size)


def export_heads(
    heads: PretrainedHeads,
    fmt: str,
    out_dir: str | Path,
    target: nn.Module | None = None,
    base_model: str | None = None,
    weights: str | None = None,
) -> None:
    """Write `heads` in an engine's layout. `target` supplies weights some layouts carry (the lm_head for
    Medusa heads that share it, the embedding in the EAGLE-1 layouts, the verifier's architectures and depth
    for EAGLE-3). `base_model` (Medusa layouts, speculators-eagle3) is what config.json names as the target,
    default the heads' own; `weights` (EAGLE layouts) picks "safetensors" or "bin" (pytorch_model.bin, what
    SafeAILab's code reads first)."""
    layout = format_family(fmt)
    if heads.config.kind != layout.kind:
        theirs = family(heads.config.kind).formats
        raise ValueError(
            f"{fmt} is a layout of {layout.title} drafters but these heads are {heads.config.kind}"
            + (f": choose one of {', '.join(theirs)}" if theirs else "")
        )
    if base_model and "base_model" not in CARRIED[fmt]:
        raise ValueError(
            f"{fmt}'s config.json names no base model (its engines are given the target "
            "separately): leave out --base-model"
        )
    layout.load("exporter")(heads, fmt, out_dir, target=target, base_model=base_model, weights=weights)
    if lost := left_behind(heads, fmt, base_model):
        warnings.warn(
            f"{fmt} has no room for {', '.join(lost)}: importing the export gives the defaults there; keep "
            "the selfspec folder for them, or re-fit the tree with selfspec tune",
            UserWarning,
            stacklevel=2,
        )


def left_behind(heads: PretrainedHeads, fmt: str, base_model: str | None = None) -> list[str]:
    """The settings of `heads` an export in `fmt` does not carry (CARRIED), each as `name=value`: its fitted
    tree (a static tree; EAGLE's and DFlash's depth / top_k / total_tokens, DFlash's only when not the block's
    chain) and the target it names."""
    c = heads.config
    settings: dict[str, object] = {"base_model": base_model or c.base_model}
    if c.tree is not None:
        settings["tree"] = f"{len(c.tree)} nodes"
    drafter_family = family(c.kind)
    if drafter_family.dynamic_tree and not (drafter_family.exported_tree and drafter_family.exported_tree(c)):
        settings |= {"depth": c.depth, "top_k": c.top_k, "total_tokens": c.total_tokens}
    return [f"{k}={v}" for k, v in settings.items() if v not in ("", None) and k not in CARRIED[fmt]]
