"""The family registry (heads/families): every declaration resolves to what it names and agrees with the modules
it points at, so a family's one line in the registry is all the layers need."""

from __future__ import annotations

import dataclasses

import pytest

from selfspec.heads.config import HeadsConfig
from selfspec.heads.families import FAMILIES, KINDS, SETTINGS, family, format_family
from selfspec.heads.family import resolve
from selfspec.heads.io import PretrainedHeads

REFERENCES = ("drafter", "proposer", "detect", "importer", "exporter", "recipe_config", "meta_drafter",
              "activation_bytes")


@pytest.mark.parametrize("kind", KINDS)
def test_every_reference_resolves(kind):
    f = family(kind)
    for name in REFERENCES:
        if getattr(f, name) is not None:
            assert callable(f.load(name)), (kind, name)
    drafter = f.load("drafter")
    assert issubclass(drafter, PretrainedHeads) and drafter.kind == kind


@pytest.mark.parametrize("kind", KINDS)
def test_declared_formats_are_the_format_modules_layouts(kind):
    f = family(kind)
    module = f.detect.partition(":")[0]
    assert f.formats == tuple(resolve(f"{module}:LAYOUTS")), kind
    assert set(f.carried) == set(f.formats)
    assert all(format_family(fmt) is f for fmt in f.formats)


def test_recipe_configs_name_the_family_they_train():
    """The memory planner builds a recipe's drafter through the family its config names."""
    from selfspec.train.dflash import DFlashConfig
    from selfspec.train.eagle import EagleConfig
    from selfspec.train.medusa import MedusaConfig

    named = {MedusaConfig.kind, DFlashConfig.kind, EagleConfig().kind, EagleConfig(version=3).kind}
    assert named == {f.kind for f in FAMILIES.values() if f.recipe}
    for cfg in (MedusaConfig(), EagleConfig(), EagleConfig(version=3), DFlashConfig()):
        assert family(cfg.kind).load("recipe_config") is type(cfg)


def test_unknown_kind_is_refused_naming_the_known():
    with pytest.raises(ValueError, match=r"unknown heads kind 'pard'; supported: medusa, eagle, eagle3, dflash"):
        HeadsConfig(kind="pard", hidden_size=8, vocab_size=8)


def test_a_family_setting_is_refused_for_the_others():
    defaults = {f.name: f.default for f in dataclasses.fields(HeadsConfig)}
    values = {"draft_vocab_size": 4, "feature_layers": [1], "mask_token_id": 3, "norm_before_fc": True,
              "norm_before_residual": True, "qk_norm": True}
    assert set(values) == set(SETTINGS)
    for name, kinds in SETTINGS.items():
        assert values[name] != defaults[name]
        with pytest.raises(ValueError, match=f"{name} is for .* drafters \\(medusa drafters do not read it\\)"):
            HeadsConfig(kind="medusa", hidden_size=8, vocab_size=8, **{name: values[name]})
        assert "medusa" not in kinds
