"""The folder a regeneration writes: its record (regeneration.json, which a resume must match), the shards
written as they complete, and their merge into the saved dataset or JSONL."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Any

import datasets

from selfspec.heads.io import atomic_write
from selfspec.train.data.examples import tokenizer_fingerprint, write_arrow
from selfspec.train.data.records import REGENERATION_FILE, DataError
from selfspec.train.loop.config import ConfigError
from selfspec.train.regeneration.config import RegenerateConfig
from selfspec.train.regeneration.items import Items
from selfspec.train.regeneration.shards import SUFFIX, write_manifest, write_parquet_shard

JSONL_FILE = "regenerated.jsonl"
# a regenerated row: messages (conversations) or text (windows), the exact tokens and where the loss is taken
ROW_FEATURES = datasets.Features(
    {
        "item": datasets.Value("int64"),
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "text": datasets.Value("string"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "skipped": datasets.Value("string"),  # in shards only: why an item gave no row
        "dropped_turns": datasets.Value(
            "int32"
        ),  # in shards only: later answers cut because the chat outgrew the window
    }
)


def describe_run(
    cfg: RegenerateConfig, tokenizer, items: Items, target: dict[str, str], stops: list[int]
) -> dict[str, Any]:
    """What regeneration.json records; a resume must match it in everything but `versions` and the counts."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "output_dir"}
    return {
        "target": target,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "settings": settings | {"items": len(items), "items_key": items.key, "stop_token_ids": stops},
        "backend": cfg.backend,
        "versions": versions(cfg.backend),
        "complete": False,
    }


def versions(backend: str) -> dict[str, str]:
    """The versions that decide the output (vLLM's only with that backend; its CPU build is another
    package)."""
    found = {"python": platform.python_version()}
    for name in ("selfspec", "torch", "transformers", "datasets"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    if backend == "vllm":
        import vllm

        found["vllm"] = vllm.__version__
    return found


def check_output_dir(out: Path) -> None:
    """Refuse, before any work, an output_dir that is a file or holds something other than a regeneration."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output_dir {out} is a file: give a folder (new or empty, or one to resume)")
    if out.is_dir() and any(out.iterdir()) and not (out / REGENERATION_FILE).is_file():
        raise ConfigError(
            f"--output_dir {out} already holds other files and no {REGENERATION_FILE}: give a new or "
            "empty folder (a regeneration resumes only in its own folder)"
        )


def open_output(out: Path, record: dict[str, Any]) -> str:
    """Check that `out` is new or holds this very regeneration (same target, tokenizer and settings): "new",
    "started" or "complete"."""
    check_output_dir(out)
    path = out / REGENERATION_FILE
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise DataError(f"{path} is damaged (not JSON): delete {out} and start again") from None
        differ = [
            f"{k} {old.get(part, {}).get(k)!r} there, {v!r} now"
            for part in ("target", "settings")
            for k, v in record[part].items()
            if old.get(part, {}).get(k) != v
        ]
        if old.get("tokenizer") != record["tokenizer"]:
            differ.append("another tokenizer")
        if differ:
            raise ConfigError(
                f"--output_dir {out} holds a regeneration with other settings ({'; '.join(differ[:3])}):"
                " resume it with the same options, or give another --output_dir"
            )
        return "complete" if old.get("complete") else "started"
    return "new"


def write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2) + "\n"))


def shard_path(out: Path, shard: int, output_format: str = "dataset") -> Path:
    """Where shard `shard` goes: Arrow while a dataset/jsonl run lasts, Parquet kept for good in `shards`
    form."""
    return out / "shards" / f"{shard:05d}{SUFFIX if output_format == 'shards' else '.arrow'}"


def write_shard(rows: list[dict[str, Any]], path: Path) -> None:
    """The shard's rows as one Arrow (or, by its suffix, Parquet) file, renamed into place only when
    complete."""
    if path.suffix == SUFFIX:
        write_parquet_shard(rows, path, ROW_FEATURES)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_arrow(rows, tmp, ROW_FEATURES)
    os.replace(tmp, path)


def merge(out: Path, shards: int, output_format: str, record: dict[str, Any], report: bool = True) -> None:
    """Join the shards into the saved dataset (or JSONL), mark the record complete, delete the shards; in
    `shards` form keep them and complete their manifest instead."""
    if output_format == "shards":
        manifest = write_manifest(out)
        counts = manifest["counts"]
        if counts["rows"] == 0:
            raise DataError("no item could be regenerated (every one was skipped)")
        write_json(out / REGENERATION_FILE, record | {"complete": True, "rows": counts["rows"]})
        if report:
            print(
                f"regenerated {counts['rows']} items into {out}: {manifest['shards_done']} shards, "
                f"{counts['answer_tokens']} answer tokens (manifest.json lists their checksums)"
            )
        return
    parts = datasets.concatenate_datasets(
        [datasets.Dataset.from_file(str(shard_path(out, s))) for s in range(shards)]
    )
    skipped = Counter(r for r in parts["skipped"] if r is not None)
    dropped = parts.filter(lambda why, n: why is None and n > 0, input_columns=["skipped", "dropped_turns"])
    kept = parts.filter(lambda why: why is None, input_columns="skipped").remove_columns(
        ["skipped", "dropped_turns"]
    )
    if len(kept) == 0:
        raise DataError(
            f"no item could be regenerated ({', '.join(f'{n} x {why}' for why, n in skipped.items())})"
        )
    if output_format == "jsonl":

        def lines(tmp: str) -> None:
            with open(tmp, "w") as f:
                for row in kept.select_columns(["messages", "text"]):
                    f.write(
                        json.dumps(
                            {"messages": row["messages"]}
                            if row["messages"] is not None
                            else {"text": row["text"]}
                        )
                        + "\n"
                    )

        atomic_write(out / JSONL_FILE, lines)
    else:
        save_dataset(kept, out)
    cut = {"conversations": len(dropped), "turns": sum(dropped["dropped_turns"])}
    write_json(
        out / REGENERATION_FILE,
        record | {"complete": True, "rows": len(kept), "skipped": dict(skipped), "dropped_turns": cut},
    )
    shutil.rmtree(out / "shards")
    if report:
        print(
            f"regenerated {len(kept)} items into {out}"
            + (
                f" ({sum(skipped.values())} skipped: "
                + ", ".join(f"{n} x {why}" for why, n in skipped.items())
                + ")"
                if skipped
                else ""
            )
        )
        if cut["turns"]:
            print(
                f"note: {cut['conversations']} conversations outgrew --max_length or the model's positions "
                f"and end early: {cut['turns']} later answers were not regenerated"
            )


def save_dataset(rows: datasets.Dataset, out: Path) -> None:
    """save_to_disk into `out` beside regeneration.json: saved aside, then moved in with state.json last."""
    aside = out / ".merging"
    shutil.rmtree(aside, ignore_errors=True)
    quiet = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        rows.save_to_disk(str(aside))
    finally:
        if not quiet:
            datasets.enable_progress_bars()
    names = {p.name for p in aside.iterdir()}
    for stale in out.glob("data-*.arrow"):
        if stale.name not in names:
            stale.unlink()
    for name in sorted(names, key=lambda n: n == "state.json"):
        os.replace(aside / name, out / name)
    aside.rmdir()
