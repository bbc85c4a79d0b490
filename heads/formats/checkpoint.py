"""A checkpoint folder read once for every layout: its config.json and the names of its weights, which is all
that detection looks at; the tensors themselves are read only by the layout that imports them."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from selfspec.heads.config import read_json_object
from selfspec.heads.io import read_state_dict

WEIGHTS = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin"}


class Checkpoint:
    """A folder's config.json (None when it has none) and, on first use, its weight files and tensor names."""

    def __init__(self, path: Path, config: dict[str, Any] | None) -> None:
        self.path, self.config = path, config

    @classmethod
    def read(cls, directory: str | Path | Checkpoint) -> Checkpoint:
        """The folder's config read once (a config.json that is not a JSON object is an error naming it)."""
        if isinstance(directory, Checkpoint):
            return directory
        path = Path(directory)
        config_path = path / "config.json"
        return cls(path, read_json_object(config_path) if config_path.is_file() else None)

    @property
    def is_selfspec(self) -> bool:
        """selfspec's own layout: a config.json with a `kind`."""
        return self.config is not None and "kind" in self.config

    def require_config(self) -> dict[str, Any]:
        if self.config is None:
            raise ValueError(f"{self.path} has no config.json: a Medusa or EAGLE checkpoint needs one")
        return self.config

    @functools.cached_property
    def weight_files(self) -> list[Path]:
        """The weight files, safetensors first (what vLLM prefers too); a sharded index lists its shards."""
        for single in WEIGHTS.values():
            index = self.path / f"{single}.index.json"
            if (self.path / single).is_file():
                return [self.path / single]
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                    return [self.path / name for name in sorted(set(weight_map.values()))]
                except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                    raise ValueError(
                        f"{index} is not a readable weight index: {type(e).__name__}: {e}"
                    ) from None
        return []

    @functools.cached_property
    def weight_names(self) -> set[str]:
        """The tensor names of the weight files (safetensors headers only; pickles are read whole)."""
        if not all(f.name.endswith(".safetensors") and f.is_file() for f in self.weight_files):
            return set(self.read_weights())
        names: set[str] = set()
        for path in self.weight_files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    names.update(f.keys())
            except Exception as e:
                raise ValueError(f"cannot read the weights in {path}: {type(e).__name__}: {e}") from None
        return names

    def read_weights(self) -> dict[str, torch.Tensor]:
        """Every tensor, by name (`.bin` read with `weights_only=True`)."""
        if not self.weight_files:
            raise ValueError(
                f"{self.path} has no {' or '.join(WEIGHTS.values())}: no EAGLE weights to import"
            )
        state: dict[str, torch.Tensor] = {}
        for path in self.weight_files:
            if not path.is_file():
                raise ValueError(f"{path} is listed in the weight index but missing")
            state.update(read_state_dict(path))
        return state
