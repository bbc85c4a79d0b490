"""The drafter families selfspec knows, one line each: a new family is a declaration module beside these and
its line here (docs/adding-a-drafter.md)."""

from __future__ import annotations

from selfspec.heads.families import dflash, eagle, eagle3, medusa, mtp, peagle
from selfspec.heads.family import Family

FAMILIES: dict[str, Family] = {
    f.kind: f
    for f in (
        medusa.FAMILY,
        eagle.FAMILY,
        eagle3.FAMILY,
        dflash.FAMILY,
        peagle.FAMILY,
        mtp.FAMILY,
    )
}
KINDS = tuple(FAMILIES)
# every family-specific HeadsConfig field, and the families that read it (a field set for another is refused)
SETTINGS = {
    name: tuple(k for k, f in FAMILIES.items() if name in f.settings)
    for name in sorted(set().union(*(f.settings for f in FAMILIES.values())))
}


def family(kind: str) -> Family:
    """The family of a config's `kind`; an unknown one is a ValueError listing the known."""
    try:
        return FAMILIES[kind]
    except KeyError:
        raise ValueError(f"unknown heads kind {kind!r}; supported: {', '.join(KINDS)}") from None


def dynamic_tree(kind: str) -> bool:
    """Whether --depth / --draft-top-k / --total-tokens shape this family's tree."""
    return family(kind).dynamic_tree


def format_family(fmt: str) -> Family:
    """The family whose published layout `fmt` is."""
    for f in FAMILIES.values():
        if fmt in f.formats:
            return f
    raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(export_formats())}")


def export_formats() -> tuple[str, ...]:
    return tuple(fmt for f in FAMILIES.values() for fmt in f.formats)


def recipe_families(recipe: str) -> list[Family]:
    """The families trained by the recipes under configs/<recipe>/ (train/<recipe>.py)."""
    return [f for f in FAMILIES.values() if f.recipe == recipe]
