"""Load a selfspec drafter directory by the `kind` in its config, or a
published Medusa/EAGLE checkpoint as it is (converted in memory, the layout detected as `import` does)."""

from __future__ import annotations

from pathlib import Path

import torch

from selfspec.heads.config import HeadsConfig
from selfspec.heads.families import family
from selfspec.heads.formats import import_heads
from selfspec.heads.formats.checkpoint import Checkpoint
from selfspec.heads.hub import resolve_heads
from selfspec.heads.io import PretrainedHeads


def is_published(directory: str | Path | Checkpoint) -> bool:
    """Whether a directory holds another project's checkpoint: a config.json without selfspec's `kind`.
    A config.json that is not a JSON object is an error naming the file."""
    checkpoint = Checkpoint.read(directory)
    return checkpoint.config is not None and not checkpoint.is_selfspec


def load_heads(
    name_or_path: str | Path,
    device: str | torch.device = "cpu",
    base_model: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> PretrainedHeads:
    """Load a drafter from a local directory or a Hub repo id: selfspec's own layout by the `kind` in its
    config.json, or a published Medusa / EAGLE checkpoint as it is, converted in memory (the layout detected
    from its files as `selfspec import` does; nothing is written).

    `base_model` is the target (a name or path) a published checkpoint is loaded for: its config then names
    that one (published EAGLE checkpoints name none), and EAGLE-3 checkpoints that name no fused layers take
    the target's default ones. selfspec's own directories keep the target they name. `revision` and `token`
    are the Hub's, for a repo id."""
    checkpoint = Checkpoint.read(resolve_heads(name_or_path, revision=revision, token=token))
    if is_published(checkpoint):
        return import_heads(checkpoint, base_model=base_model or None).to(device)
    drafter = family(HeadsConfig.load(checkpoint.path).kind).load("drafter")
    return drafter.from_pretrained(checkpoint.path, device)
