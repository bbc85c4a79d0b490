"""Run configs: a dataclass of defaults, a YAML file on top, then `--key value` overrides.

Unknown keys are errors that list the valid ones; values are converted to the field's type.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

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
            f"unknown key(s) {', '.join(map(repr, unknown))} in {where}. Valid keys: {', '.join(sorted(valid))}"
        )


def load_config(cls: type[T], argv: list[str] | None = None, config_path: str | None = None) -> T:
    """Build `cls` from its defaults, an optional YAML (`--config`), then `--key value` overrides."""
    argv = list(argv or [])
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
        path = Path(config_path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a mapping of key: value, got {type(loaded).__name__}")
        _check_keys(cls, list(loaded), str(path))
        values.update(loaded)
    _check_keys(cls, list(overrides), "the command line")
    values.update(overrides)
    hints = _fields(cls)
    return cls(**{k: _convert(k, v, hints[k]) for k, v in values.items()})
