"""The run configs that ship with selfspec: configs/ (training and regeneration recipes, accelerate and
DeepSpeed configs), in the checkout or inside the installed package."""

from __future__ import annotations

from pathlib import Path

RECIPES = Path(__file__).resolve().parent.parent / "configs"  # the checkout's configs/, or the installed copy
