"""The shipped demo target: where its files live and the stdlib corpus it was trained on.

The split is by file so that no test-split source ever reaches training:
``int(sha1(relative_path).hexdigest(), 16) % 100`` below 90 is train, 90-94 validation,
95 and above test.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
SHORT_NAMES = {"demo": "demo-target", "demo-target": "demo-target", "demo-draft": "demo-draft"}
SPLITS = ("train", "validation", "test")


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


def split_of(relative_path: str) -> str:
    """Which split a corpus file belongs to, from its stdlib-relative path with '/' separators."""
    bucket = int(hashlib.sha1(relative_path.encode()).hexdigest(), 16) % 100
    if bucket < 90:
        return "train"
    return "validation" if bucket < 95 else "test"


def stdlib_files(split: str, stdlib_dir: str | None = None) -> list[Path]:
    """Sorted `.py` files of the interpreter's standard library in one split (site-packages excluded)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel.split("/"):
            continue
        if split_of(rel) == split:
            files.append(path)
    return files


def stdlib_texts(split: str, stdlib_dir: str | None = None) -> list[str]:
    """The source text of every file in a split (undecodable bytes replaced)."""
    return [p.read_bytes().decode("utf-8", errors="replace") for p in stdlib_files(split, stdlib_dir)]
