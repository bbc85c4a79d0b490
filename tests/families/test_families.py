"""The family registry (heads/families): every declaration resolves to what it names and agrees with the
modules it points at, so a family's one line in the registry is all the layers need."""

from __future__ import annotations

import dataclasses

import pytest

from selfspec.heads.config import HeadsConfig
from selfspec.heads.families import FAMILIES, KINDS, SETTINGS, family, format_family
from selfspec.heads.family import resolve
from selfspec.heads.io import PretrainedHeads

REFERENCES = (
    "drafter",
    "proposer",
    "detect",
    "importer",
    "exporter",
    "recipe_config",
    "meta_drafter",
    "activation_bytes",
    "tune_grid",
)


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
    module = (f.detect or f.exporter).partition(":")[0]
    assert f.formats == tuple(resolve(f"{module}:LAYOUTS")), kind
    assert set(f.carried) == set(f.formats)
    assert all(format_family(fmt) is f for fmt in f.formats)


def test_recipe_configs_name_the_family_they_train():
    """The memory planner builds a recipe's drafter through the family its config names."""
    from selfspec.train.recipes.dflash import DFlashConfig
    from selfspec.train.recipes.eagle import EagleConfig
    from selfspec.train.recipes.medusa import MedusaConfig
    from selfspec.train.recipes.mtp import MtpConfig
    from selfspec.train.recipes.peagle import PEagleConfig

    named = {
        MedusaConfig.kind,
        DFlashConfig.kind,
        EagleConfig().kind,
        EagleConfig(version=3).kind,
        PEagleConfig.kind,
        MtpConfig.kind,
    }
    assert named == {f.kind for f in FAMILIES.values() if f.recipe}
    for cfg in (
        MedusaConfig(),
        EagleConfig(),
        EagleConfig(version=3),
        DFlashConfig(),
        PEagleConfig(),
        MtpConfig(),
    ):
        assert family(cfg.kind).load("recipe_config") is type(cfg)


def test_unknown_kind_is_refused_naming_the_known():
    with pytest.raises(
        ValueError, match=r"unknown heads kind 'pard'; supported: medusa, eagle, eagle3, dflash"
    ):
        HeadsConfig(kind="pard", hidden_size=8, vocab_size=8)


def test_a_family_setting_is_refused_for_the_others():
    defaults = {f.name: f.default for f in dataclasses.fields(HeadsConfig)}
    values = {
        "draft_vocab_size": 4,
        "feature_layers": [1],
        "mask_token_id": 3,
        "norm_before_fc": True,
        "norm_before_residual": True,
        "qk_norm": True,
    }
    assert set(values) == set(SETTINGS)
    for name, kinds in SETTINGS.items():
        assert values[name] != defaults[name]
        with pytest.raises(
            ValueError, match=f"{name} is for .* drafters \\(medusa drafters do not read it\\)"
        ):
            HeadsConfig(kind="medusa", hidden_size=8, vocab_size=8, **{name: values[name]})
        assert "medusa" not in kinds


def test_every_dynamic_family_has_a_tune_grid_its_proposer_accepts():
    """`selfspec tune` fits what the family can build: DFlash's grid stays inside its block and tries the
    chain its exports decode (the EAGLE grid went 8 deep and never tried top_k 1)."""
    from types import SimpleNamespace

    for f in FAMILIES.values():
        assert (f.tune_grid is not None) == f.dynamic_tree, f.kind
    grid = family("dflash").load("tune_grid")(SimpleNamespace(block_size=8))
    assert max(d for d, _, _ in grid) == 7 and (7, 1, 7) in grid and (3, 1, 3) in grid
    assert all(t >= d for d, _, t in grid)


def test_a_dynamic_proposer_ignores_the_drafters_static_tree():
    """tune measures EAGLE-2's dynamic tree even when the drafter's config stores a static one."""
    from conftest import tiny_model
    from eagle_drafts import random_draft

    model = tiny_model("llama")
    draft = random_draft(model)
    draft.config.tree = [[0], [0, 0]]
    build = family("eagle").load("proposer")
    assert build(draft, model, None).static is not None  # the stored static tree, as decoding uses it
    assert build(draft, model, None, dynamic=True, depth=2, top_k=2, total_tokens=4).static is None
