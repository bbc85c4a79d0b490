"""The target a drafter decodes with: the base model its config names, or a Medusa-2 checkpoint's adapted one.

A Medusa-2 run trains a LoRA on the target together with the heads, so the heads only fit the adapted
target. Its directory holds either the adapter (peft's format, `config.adapter`), applied to the base model
and merged into its weights at load time, or the merged model itself (`config.merged_target`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from selfspec.heads.config import HeadsConfig

ADAPTED = "_selfspec_adapter"  # attribute marking a model load_target adapted: the adapter folder it merged


def adapted_target_dir(config: HeadsConfig, directory: Path | None) -> Path | None:
    """The checkpoint's adapter or merged-target folder, checked to exist; None for heads of an unchanged
    target."""
    sub = config.adapter or config.merged_target
    if sub is None:
        return None
    if directory is None or not (directory / sub).is_dir():
        where = directory or "the heads' directory"
        raise FileNotFoundError(
            f"these Medusa-2 heads decode with the adapted target in {where}/{sub}, which is "
            "missing: copy or download the whole directory the training run wrote"
        )
    return directory / sub


def apply_adapter(model: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """`model` with the LoRA adapter in `adapter_dir` merged into its weights (no adapter cost per
    forward)."""
    try:
        from peft import PeftModel
    except ImportError:
        raise ValueError("Medusa-2 heads carry a LoRA adapter, which needs peft: pip install peft") from None
    dtype = next(model.parameters()).dtype
    try:
        merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload().to(dtype)
    except (RuntimeError, KeyError, ValueError) as e:  # shapes or module names of another model
        raise ValueError(
            f"the LoRA adapter in {adapter_dir} does not fit {model.name_or_path or 'the model'} "
            f"({type(e).__name__}: {' '.join(str(e).split())[:200]}): load it on the base model it "
            "was trained on"
        ) from None
    setattr(merged, ADAPTED, str(adapter_dir))
    return merged


def load_target(heads: Any, name: str | None = None, load: Any = None, **kwargs: Any) -> torch.nn.Module:
    """The target `heads` decode with: `name` (default the config's base_model), with the checkpoint's adapter
    merged in; or the merged target the checkpoint holds when no name is given. `load(path, **kwargs)` loads a
    model (default AutoModelForCausalLM.from_pretrained)."""
    from transformers import AutoModelForCausalLM

    from selfspec.shipped.models import resolve_model

    load = load or AutoModelForCausalLM.from_pretrained
    config: HeadsConfig = heads.config
    folder = adapted_target_dir(config, getattr(heads, "source_dir", None))
    if config.merged_target:
        if name and Path(resolve_model(name)).resolve() != folder.resolve():
            raise ValueError(
                f"these Medusa-2 heads decode with their merged target in {folder}, not {name}: leave "
                "the model out"
            )
        model = load(str(folder), **kwargs)
        setattr(model, ADAPTED, str(folder))
        return model
    base = name or config.base_model
    if not base:
        raise ValueError(
            "the drafter names no target model (SafeAILab's EAGLE checkpoints never do): pass the model "
            "it was trained for"
        )
    model = load(resolve_model(base), **kwargs)
    return apply_adapter(model, folder) if config.adapter else model


def check_adapted(config: HeadsConfig, model: torch.nn.Module) -> None:
    """Refuse a model passed for heads trained with a LoRA adapter unless load_target adapted it: the base
    model alone decodes exactly but accepts little, silently."""
    if (config.adapter or config.merged_target) and not getattr(model, ADAPTED, None):
        raise ValueError(
            "these Medusa-2 heads were trained with a LoRA adapter on the target: leave the model out "
            "(it is loaded and adapted from the heads' directory) or pass heads.target.load_target(heads)"
        )
