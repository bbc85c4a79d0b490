"""The `shards` form of a regeneration folder: the data kept as zstd Parquet shards, one per shard of items,
with a manifest of their checksums, so that a long regeneration can be committed (and shipped) shard by shard
as it completes, resumed from whatever was committed, and read by training while it is still growing.

    folder/
      regeneration.json       the run's record (train/regeneration/output.py): target, tokenizer, settings
      manifest.json           the target's weights sha256, the recipe, counts, and per shard: sha256, rows,
                              tokens
      shards/00000.parquet    the shard's rows (ROW_FEATURES), skipped items included with their reason
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from selfspec.heads.io import atomic_write, sha256_of
from selfspec.train.data.records import (
    MANIFEST_FILE,
    REGENERATION_FILE,
    DataError,
    check_shards,
    read_manifest,
)

SUFFIX = ".parquet"


def write_parquet_shard(rows: list[dict[str, Any]], path: Path, features: datasets.Features) -> None:
    """The shard's rows as one zstd Parquet file, renamed into place only when complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    table = pa.Table.from_pylist(rows, schema=features.arrow_schema)
    pq.write_table(table, tmp, compression="zstd", compression_level=9)
    os.replace(tmp, path)


def shard_entry(path: Path) -> dict[str, Any]:
    """What the manifest says of one shard: its checksum, rows kept and skipped, tokens and answer tokens."""
    table = pq.read_table(path, columns=["skipped", "input_ids", "loss_mask"])
    kept = [why is None for why in table.column("skipped").to_pylist()]
    ids, mask = table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()
    return {
        "file": f"shards/{path.name}",
        "sha256": sha256_of(path),
        "rows": sum(kept),
        "skipped": len(kept) - sum(kept),
        "tokens": sum(len(i) for i, k in zip(ids, kept) if k),
        "answer_tokens": sum(sum(m) for m, k in zip(mask, kept) if k),
    }


def write_manifest(folder: Path) -> dict[str, Any]:
    """Write manifest.json for the shards now in `folder`, from its regeneration.json (the target, the recipe,
    the number of shards); entries of unchanged shards are reused rather than re-read. Returns the
    manifest."""
    record = json.loads((folder / REGENERATION_FILE).read_text())
    settings = record["settings"]
    shards = -(-settings["items"] // settings["shard_size"])
    extra = {
        "target": record["target"],
        "tokenizer": record["tokenizer"],
        "backend": record["backend"],
        "versions": record["versions"],
        "recipe": settings,
    }
    old = read_manifest(folder) if (folder / MANIFEST_FILE).is_file() else {}
    known = {e["file"]: e for e in old.get("shards", [])}
    entries = []
    for path in sorted((folder / "shards").glob(f"*{SUFFIX}")):
        entry = known.get(f"shards/{path.name}")
        if entry is None or entry["sha256"] != sha256_of(path):
            entry = shard_entry(path)
        entries.append(entry)
    totals = {k: sum(e[k] for e in entries) for k in ("rows", "skipped", "tokens", "answer_tokens")}
    manifest = extra | {
        "shards_total": shards,
        "shards_done": len(entries),
        "complete": len(entries) == shards,
        "counts": totals,
        "shards": entries,
    }
    atomic_write(
        folder / MANIFEST_FILE, lambda tmp: Path(tmp).write_text(json.dumps(manifest, indent=1) + "\n")
    )
    return manifest


def main(argv: list[str] | None = None) -> None:
    """`python -m selfspec.train.regeneration.shards FOLDER [--write]`: check a shards folder against its
    manifest (--write: write the manifest anew from the shards there) and say what it holds."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("folder")
    p.add_argument(
        "--write", action="store_true", help="write manifest.json anew from the shards in the folder"
    )
    args = p.parse_args(argv)
    folder = Path(args.folder)
    try:
        if args.write:
            if not (folder / REGENERATION_FILE).is_file():
                raise DataError(f"{folder} holds no {REGENERATION_FILE}: not a regeneration folder")
            write_manifest(folder)
        manifest = check_shards(folder)
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    c = manifest["counts"]
    print(
        f"{folder}: {manifest['shards_done']} of {manifest['shards_total']} shards, all checksums match; "
        f"{c['rows']} rows ({c['skipped']} skipped), {c['answer_tokens']} answer tokens of {c['tokens']}"
    )


if __name__ == "__main__":
    main()
