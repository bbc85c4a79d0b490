"""Run configs: a dataclass of defaults, a YAML file on top, then `--key value` overrides.

Unknown keys are errors that list the valid ones; values are converted to the field's type.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from selfspec.shipped.recipes import RECIPES

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad config file or command-line override."""


def _convert(name: str, raw: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        is_none = raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null", ""))
        if is_none and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(name, raw, inner[0])
    if origin in (list, tuple):
        if isinstance(raw, str):
            raw = [x for x in raw.split(",") if x.strip()]
        return [_convert(name, x, args[0] if args else str) for x in raw]
    if hint is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--{name} expects true/false, got {raw!r}")
    if hint in (int, float, str):
        try:
            if hint is int and isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            return hint(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"--{name} expects {hint.__name__}, got {raw!r}") from None
    return raw


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _check_keys(cls: type, keys: list[str], where: str) -> None:
    valid = _fields(cls)
    unknown = [k for k in keys if k not in valid]
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(map(repr, unknown))} in {where}. Valid keys: "
            f"{', '.join(sorted(valid))}"
        )


def option(
    default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None
) -> Any:
    """A config field with its `--help` line: `learning_rate: float = option(1e-3, "the peak learning rate")`;
    `factory` makes a fresh mutable default per config (a list)."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def field_meanings(cls: type) -> dict[str, str]:
    """Each option's one-line meaning, from its field's `option(..., help)`. A subclass that only changes a
    default keeps the meaning its base class gives."""
    meanings: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        for f in getattr(klass, "__dataclass_fields__", {}).values():
            if f.metadata.get("help"):
                meanings[f.name] = f.metadata["help"]
    return meanings


def help_text(cls: type, prog: str) -> str:
    """`--help`: every option with its default and meaning."""
    meanings = field_meanings(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        rows.append((f"--{f.name} {shown}", meanings.get(f.name, "")))
    width = max(len(left) for left, _ in rows) + 2
    lines = [
        f"usage: {prog} [--config FILE.yaml] [--key value ...] [--debug]",
        "",
        (cls.__doc__ or "").strip(),
        "",
        "options (shown with their defaults; a YAML given with --config sets them too, the command line "
        "wins):",
        f"  {'--config FILE.yaml'.ljust(width)}a run config (see configs/); keys are the options below",
    ]
    lines += [f"  {left.ljust(width)}{meaning}" for left, meaning in rows]
    lines.append(f"  {'--debug'.ljust(width)}show the full traceback of an error (also SELFSPEC_DEBUG=1)")
    return "\n".join(lines)


def check_finite(config: Any) -> None:
    """Reject NaN and infinite values in every float option."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{f.name} must be a finite number, got {value}")


def check_at_least(config: Any, names: tuple[str, ...], low: int) -> None:
    """Each named option must be >= low; the error names the option and the value."""
    for name in names:
        if getattr(config, name) < low:
            raise ConfigError(f"--{name} must be >= {low}, got {getattr(config, name)}")


def recipe_path(name: str) -> Path:
    """A run config's file: the path as given, else the recipe of that name that ships with selfspec
    (`configs/eagle/llama3.1-8b-eagle3.yaml` or `eagle/llama3.1-8b-eagle3.yaml` works after a pip install)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    shipped = RECIPES / (path.relative_to("configs") if path.parts[:1] == ("configs",) else path)
    if not path.is_absolute() and shipped.is_file():
        return shipped
    raise ConfigError(f"config file {path} does not exist (the shipped recipes are in {RECIPES})")


def load_config(
    cls: type[T], argv: list[str] | None = None, config_path: str | None = None, prog: str | None = None
) -> T:
    """Build `cls` from its defaults, an optional YAML (`--config`), then `--key value` overrides.
    `--help` / `-h` prints every option with its default and meaning, and exits."""
    argv = list(argv or [])
    if "--help" in argv or "-h" in argv:
        script = Path(sys.argv[0])
        prog = prog or (
            f"accelerate launch train/{script.name}" if script.parent.name == "train" else script.name
        )
        print(help_text(cls, prog))
        raise SystemExit(0)
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: options are written --key value")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("--"):
                value = "true"  # a bare flag
            else:
                value, i = nxt, i + 1
        overrides[key] = value
        i += 1
    config_path = overrides.pop("config", config_path)

    values: dict[str, Any] = {}
    if config_path:
        path = recipe_path(config_path)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            line = f" line {where.line + 1}" if where is not None else ""
            raise ConfigError(f"{path}{line} is not valid YAML: {getattr(e, 'problem', None) or e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a mapping of key: value, got {type(loaded).__name__}")
        _check_keys(cls, list(loaded), str(path))
        values.update(loaded)
    _check_keys(cls, list(overrides), "the command line")
    values.update(overrides)
    hints = _fields(cls)
    return cls(**{k: _convert(k, v, hints[k]) for k, v in values.items()})
