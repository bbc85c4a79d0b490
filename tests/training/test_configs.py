"""Every shipped YAML parses; run configs are valid for the recipe their header command names."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from selfspec.train.loop.config import load_config
from selfspec.train.recipes.demo_models import TargetConfig
from selfspec.train.recipes.dflash import DFlashConfig
from selfspec.train.recipes.eagle import EagleConfig
from selfspec.train.recipes.medusa import MedusaConfig
from selfspec.train.recipes.mtp import MtpConfig
from selfspec.train.recipes.peagle import PEagleConfig
from selfspec.train.regeneration.config import RegenerateConfig

CONFIGS = sorted(Path(__file__).resolve().parents[2].joinpath("configs").rglob("*.yaml"))
ACCELERATE = [p for p in CONFIGS if p.parent.name == "accelerate"]  # `accelerate launch --config_file` files
RUN_CONFIGS = [p for p in CONFIGS if p.parent.name != "accelerate"]  # a recipe's `--config`
RECIPES = {
    "train/medusa.py": MedusaConfig,
    "train/eagle.py": EagleConfig,
    "train/target.py": TargetConfig,
    "train/regenerate.py": RegenerateConfig,
    "train/dflash.py": DFlashConfig,
    "train/peagle.py": PEagleConfig,
    "train/mtp.py": MtpConfig,
}


def relative(path: Path) -> str:
    return str(path.relative_to(path.parents[2]))  # configs/<kind>/<name>.yaml


def test_there_are_configs():
    assert len(ACCELERATE) >= 2 and len(RUN_CONFIGS) >= 6


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_config_parses_and_opens_with_its_command(path):
    text = path.read_text()
    assert isinstance(yaml.safe_load(text), dict)
    first = text.splitlines()[0]
    assert first.startswith("# ") and ("accelerate launch" in first or "python " in first), first
    flag = "--config_file" if path in ACCELERATE else "--config"
    assert f"{flag} {relative(path)}" in first, first


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_run_config_is_valid_for_its_recipe(path):
    first = path.read_text().splitlines()[0]
    recipes = [script for script in RECIPES if script in first]
    assert len(recipes) == 1, f"the header should name one recipe of {sorted(RECIPES)}: {first}"
    load_config(RECIPES[recipes[0]], ["--config", str(path)])


@pytest.mark.parametrize(
    "recipe, cls",
    [("medusa", MedusaConfig), ("eagle", EagleConfig), ("peagle", PEagleConfig), ("mtp", MtpConfig)],
)
def test_demo_yaml_equals_the_no_argument_defaults(recipe, cls):
    path = next(p for p in CONFIGS if p.name == "demo.yaml" and p.parent.name == recipe)
    assert load_config(cls, ["--config", str(path)]) == cls()


@pytest.mark.parametrize("cls", [EagleConfig, DFlashConfig, MtpConfig, PEagleConfig, MedusaConfig])
def test_a_recipe_declares_only_the_options_it_changes(cls):
    """An option a recipe shares with its base (TrainConfig, or FeatureRunConfig for the recipes that train on
    the target's features) is declared again only to change its default: one definition of each meaning."""
    base = cls.__mro__[1]
    inherited = {f.name: f for f in dataclasses.fields(base)}
    for name in cls.__dict__.get("__annotations__", {}):
        if name in inherited:
            mine = next(f for f in dataclasses.fields(cls) if f.name == name)
            theirs = inherited[name]
            if mine.default_factory is not dataclasses.MISSING:
                same = theirs.default_factory is not dataclasses.MISSING and (
                    mine.default_factory() == theirs.default_factory()
                )
            else:
                same = mine.default == theirs.default
            assert not same, f"{cls.__name__}.{name} repeats {base.__name__}'s default"
