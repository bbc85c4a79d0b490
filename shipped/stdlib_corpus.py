"""The corpus the shipped demo models were trained on: the running interpreter's standard library.

The split is by file so that no test-split source ever reaches training:
``int(sha1(relative_path).hexdigest(), 16) % 100`` below 90 is train, 90-94 validation,
95 and above test.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

SPLITS = ("train", "validation", "test")


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
