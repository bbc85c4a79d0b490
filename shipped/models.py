"""The models this repository ships (models/demo-target, models/demo-draft) and their short names."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
SHORT_NAMES = {"demo": "demo-target", "demo-target": "demo-target", "demo-draft": "demo-draft"}


def resolve_model(name_or_path: str) -> str:
    """Map the short names `demo` / `demo-draft` to the shipped model folders; pass anything else through."""
    if name_or_path in SHORT_NAMES:
        path = MODELS_DIR / SHORT_NAMES[name_or_path]
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"the shipped model '{name_or_path}' is expected at {path}, but it is missing. "
                "Run from a clone of the selfspec repository installed with `pip install -e .`, "
                "or retrain it with `python train/target.py`."
            )
        return str(path)
    return name_or_path
