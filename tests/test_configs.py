"""Every shipped YAML parses; run configs are valid for the recipe their header command names."""

from pathlib import Path

import pytest
import yaml

from train.config import load_config
from train.eagle import EagleConfig
from train.medusa import MedusaConfig
from train.target import TargetConfig

CONFIGS = sorted(Path(__file__).resolve().parent.parent.joinpath("configs").rglob("*.yaml"))
RECIPES = {"train/medusa.py": MedusaConfig, "train/eagle.py": EagleConfig, "train/target.py": TargetConfig}


def test_there_are_configs():
    assert len(CONFIGS) >= 8


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_config_parses_and_opens_with_its_command(path):
    text = path.read_text()
    assert isinstance(yaml.safe_load(text), dict)
    first = text.splitlines()[0]
    assert first.startswith("# ") and ("accelerate launch" in first or "python " in first), first
    recipe = next((script for script in RECIPES if script in first), None)
    if recipe and "--config " + str(path.relative_to(path.parents[2])) in first:
        load_config(RECIPES[recipe], ["--config", str(path)])


@pytest.mark.parametrize("recipe, cls", [("medusa", MedusaConfig), ("eagle", EagleConfig)])
def test_demo_yaml_equals_the_no_argument_defaults(recipe, cls):
    path = next(p for p in CONFIGS if p.name == "demo.yaml" and p.parent.name == recipe)
    assert load_config(cls, ["--config", str(path)]) == cls()
