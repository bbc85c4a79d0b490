"""The drafter kinds and their classes: load any selfspec drafter directory by the `kind` in its config."""

from __future__ import annotations

from pathlib import Path

import torch

from heads.config import HeadsConfig
from heads.eagle import EagleDraft
from heads.eagle3 import Eagle3Draft
from heads.hub import resolve_heads
from heads.io import PretrainedHeads
from heads.medusa import MedusaHeads

DRAFTERS: dict[str, type[PretrainedHeads]] = {"medusa": MedusaHeads, "eagle": EagleDraft, "eagle3": Eagle3Draft}


def load_heads(directory: str | Path, device: str | torch.device = "cpu") -> PretrainedHeads:
    """Load any selfspec drafter directory, dispatching on `kind` in its config.json."""
    directory = resolve_heads(directory)
    return DRAFTERS[HeadsConfig.load(directory).kind].from_pretrained(directory, device)
