"""A dataset source's records, one at a time, each `{"text"}` or `{"messages": [{"role", "content"}, ...]}`.

Sources: `stdlib` (the demo corpus), a local `.txt` file or folder of text files, `.json`/`.jsonl` with a
`text` field, ShareGPT `conversations` or OpenAI `messages`, a folder written by `datasets.save_to_disk`
(such as a finished train/regenerate.py run), or a name for `datasets.load_dataset`. train/data/examples.py
tokenises them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets

from selfspec.heads.io import sha256_of
from selfspec.shipped.stdlib_corpus import stdlib_texts

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst"}
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
# the roles a `messages` turn may have (OpenAI's layout); other names are refused, not trained as context
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# a record: plain text, or a conversation as the JSON of its [{"role", "content"}] turns (any content type)
RECORD_FEATURES = datasets.Features({"text": datasets.Value("string"), "messages": datasets.Value("string")})
REGENERATION_FILE = (
    "regeneration.json"  # what train/regenerate.py writes beside its output (not a record file)
)
MANIFEST_FILE = "manifest.json"  # train/regenerate.py --output_format shards: the shards and their checksums


class DataError(ValueError):
    """A dataset that cannot be read as any supported layout."""


def _records_from_json(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) pairs of a .json/.jsonl file; `where` names the file and line for error messages.
    A .jsonl file is read a line at a time; a .json file holds one JSON value, so it is parsed whole."""
    if path.suffix == ".jsonl":
        with path.open(errors="replace") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(
                            f"{path} line {number} is not valid JSON ({e.msg} at column {e.colno})"
                        ) from None
                    yield f"{path} line {number}", record
        return
    try:
        data = json.loads(path.read_text(errors="replace"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {e.lineno} is not valid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(data, dict) and "data" in data:
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f"{path} must hold a list of records (or {{'data': [...]}})")
    for i, r in enumerate(data):
        yield f"{path} record {i}", r


def iter_records(source: str, split: str = "train") -> Iterator[dict[str, Any]]:
    """A source's records, one at a time, each with either `text` or `messages` (role/content)."""
    if source in ("stdlib", "demo"):
        yield from ({"text": t} for t in stdlib_texts("validation" if split == "validation" else "train"))
        return
    path = Path(source)
    if is_saved_dataset(path):
        yield from _records_from_saved(path, split)
        return
    if is_regenerated_shards(path):
        for row in load_shards(path).select_columns(["messages", "text"]):
            yield {"messages": row["messages"]} if row["messages"] is not None else {"text": row["text"]}
        return
    if path.is_dir():
        if unfinished_regeneration(path):
            raise DataError(
                f"{path} holds an unfinished regeneration: run the same train/regenerate.py command "
                "again to finish it"
            )
        files = sorted(
            p
            for p in path.rglob("*")
            if p.suffix in TEXT_SUFFIXES | {".json", ".jsonl"} and p.name != REGENERATION_FILE
        )
        if not files:
            raise DataError(f"{path} holds no .txt/.md/.py/.json/.jsonl files")
        for f in files:
            yield from iter_records(str(f), split)
        return
    if path.is_file():
        if path.suffix in (".json", ".jsonl"):
            yield from (_normalise(r, where) for where, r in _records_from_json(path))
        else:
            yield {"text": read_text(path)}
        return
    if path.suffix in TEXT_SUFFIXES | {".json", ".jsonl"} or source.startswith((".", "/", "~")):
        raise DataError(f"dataset {source!r} does not exist (no such file or folder)")
    try:
        ds = datasets.load_dataset(source, split=split)
    except Exception as err:  # the hub and local scripts raise many types; all mean the same to the user
        raise DataError(
            f"could not load dataset {source!r} ({type(err).__name__}: {err}); give a local file, folder, "
            "or a `datasets` name that is cached (HF_HUB_OFFLINE=1 blocks downloads)"
        ) from err
    yield from (_normalise(dict(r), f"{source} record {i}") for i, r in enumerate(ds))


def read_text(path: Path, limit: int | None = None) -> str:
    """A text file's contents (its first `limit` bytes), refused when it is not text: NUL bytes
    (a binary file) or more than 1% of its characters undecodable as UTF-8."""
    with open(path, "rb") as f:
        raw = f.read() if limit is None else f.read(limit)
    if b"\0" in raw:
        raise DataError(
            f"{path} is a binary file, not text: give .txt/.md/.py text, .json/.jsonl records, or a "
            "saved dataset folder"
        )
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    if bad > 0.01 * max(len(text), 1):
        raise DataError(
            f"{path} does not read as UTF-8 text ({bad} of {len(text)} characters undecodable): "
            "convert it to UTF-8 or give another file"
        )
    return text


def check_source(source: str | None) -> None:
    """Before any model loads: a local dataset must be text or records of a known layout. Text files are
    sniffed (their first MiB), JSON files read for their first records; the rest is checked when read."""
    if not source or source in ("stdlib", "demo"):
        return
    path = Path(source)
    if not path.exists() or is_saved_dataset(path) or is_regenerated_shards(path):
        return  # a `datasets` name, a missing path (named when loaded), a saved dataset or regenerated shards
    files = (
        [path]
        if path.is_file()
        else sorted(
            p
            for p in path.rglob("*")
            if p.suffix in TEXT_SUFFIXES | {".json", ".jsonl"} and p.name != REGENERATION_FILE
        )
    )
    for f in files:
        if f.suffix in (".json", ".jsonl"):
            for _ in zip(range(8), iter_records(str(f))):
                pass
        else:
            read_text(f, limit=2**20)


def is_regenerated_shards(path: Path) -> bool:
    """Whether `path` is a train/regenerate.py folder in `shards` form (regeneration.json beside
    manifest.json)."""
    return (path / MANIFEST_FILE).is_file() and (path / REGENERATION_FILE).is_file()


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a folder written by `datasets.save_to_disk` (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def unfinished_regeneration(path: Path) -> bool:
    """Whether `path` holds a train/regenerate.py run that has not merged its shards yet (a run in `shards`
    form is readable as far as its manifest goes, finished or not)."""
    info = path / REGENERATION_FILE
    if not info.is_file() or (path / MANIFEST_FILE).is_file():
        return False
    try:
        return not json.loads(info.read_text()).get("complete")
    except (json.JSONDecodeError, AttributeError):
        return True


def load_saved(path: Path, split: str) -> datasets.Dataset:
    """A `save_to_disk` folder, memory-mapped; of a DatasetDict, its `split`."""
    saved = datasets.load_from_disk(str(path), keep_in_memory=False)
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise DataError(f"{path} holds the splits {', '.join(saved)}, not {split!r}; pick one of them")
        saved = saved[split]
    return saved


def _records_from_saved(path: Path, split: str) -> Iterator[dict[str, Any]]:
    """The records of a `save_to_disk` folder; a column left empty in a row (None) counts as absent."""
    for i, row in enumerate(load_saved(path, split)):
        yield _normalise({k: v for k, v in row.items() if v is not None}, f"{path} row {i}")


def _normalise(record: Any, where: str) -> dict[str, Any]:
    """A record as {"text": ...} or {"messages": [{"role", "content"}, ...]}; errors name `where` it was."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    try:
        if "messages" in record:
            msgs = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
            for m in msgs:
                if m["role"] not in MESSAGE_ROLES:
                    raise DataError(
                        f"{where}: unknown message role {m['role']!r}; use one of "
                        f"{', '.join(MESSAGE_ROLES)} (ShareGPT turns go in `conversations` as from/value)"
                    )
            return {"messages": msgs}
        if "conversations" in record:
            msgs = []
            for turn in record["conversations"]:
                role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
                if role is None:
                    raise DataError(f"{where}: unknown ShareGPT speaker {turn.get('from')!r}")
                msgs.append({"role": role, "content": turn["value"]})
            return {"messages": msgs}
    except (KeyError, TypeError, AttributeError) as e:
        raise DataError(
            f"{where}: a turn needs `role`/`content` (messages) or `from`/`value` (ShareGPT); "
            f"{type(e).__name__}: {e}"
        ) from None
    if "text" in record:
        return {"text": record["text"]}
    raise DataError(
        f"{where}: records need a `text`, `messages` or `conversations` field; got {sorted(record)}"
    )


# ---------------------------------------------------------- regenerated shards (train/regeneration/shards.py)


def read_manifest(folder: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        raise DataError(
            f"{folder / MANIFEST_FILE} is missing or damaged: write the shards' manifest anew with "
            "`python -m selfspec.train.regeneration.shards FOLDER --write`"
        ) from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        raise DataError(
            f"{folder / MANIFEST_FILE} lists no shards: write it anew with "
            "`python -m selfspec.train.regeneration.shards FOLDER --write`"
        )
    return manifest


def check_shards(folder: Path) -> dict[str, Any]:
    """The manifest, once every shard it lists is there with its recorded checksum (else a one-line error
    naming the shard)."""
    manifest = read_manifest(folder)
    for entry in manifest["shards"]:
        path = folder / entry["file"]
        if not path.is_file():
            raise DataError(
                f"{path} is listed in {folder / MANIFEST_FILE} but missing: restore it (git checkout) "
                "or run the regeneration again to write it"
            )
        if sha256_of(path) != entry["sha256"]:
            raise DataError(
                f"{path} does not match its sha256 in {folder / MANIFEST_FILE}: restore it (git "
                "checkout) or delete it and run the regeneration again"
            )
    return manifest


def load_shards(folder: Path) -> datasets.Dataset:
    """The kept rows of every checked shard (skipped items left out), in shard order."""
    manifest = check_shards(folder)
    if not manifest["shards"]:
        raise DataError(f"{folder} holds no finished shard yet: wait for the regeneration's first shard")
    files = [str(folder / e["file"]) for e in manifest["shards"]]
    rows = datasets.Dataset.from_parquet(files, keep_in_memory=False)
    return rows.filter(lambda why: why is None, input_columns="skipped").remove_columns(
        ["skipped", "dropped_turns"]
    )
