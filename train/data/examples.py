"""Datasets -> variable-length examples of token ids with a loss mask, memory-mapped from disk.

A source's records (train/data/records.py) are tokenised: text is packed into blocks, conversations are
rendered with the tokenizer's chat template (loss on assistant turns only). A folder written by
train/regenerate.py whose tokens come from the same tokenizer gives its rows' exact tokens and loss masks, one
example per row (cut to max_length). Records stream from the files into an Arrow file (a `.jsonl` line at a
time), are tokenised with `datasets.map` a batch at a time, and the examples are saved as a `datasets.Dataset`
under the cache folder, keyed by the source, its files' sizes and times, the tokenizer and max_length; later
runs memory-map it, so RAM does not grow with the data. Rows are stored unpadded; `pad_batch` pads each batch
to its own longest row.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from selfspec.train.data.records import (
    MANIFEST_FILE,
    RECORD_FEATURES,
    REGENERATION_FILE,
    DataError,
    is_regenerated_shards,
    is_saved_dataset,
    iter_records,
    load_saved,
    load_shards,
)

# an example: its token ids and, per token, 1 where the loss is taken; no padding is stored
EXAMPLE_FEATURES = datasets.Features(
    {"input_ids": datasets.List(datasets.Value("int32")), "loss_mask": datasets.List(datasets.Value("int8"))}
)
WRITE_BATCH = 1000  # rows per Arrow record batch and per tokenising `map` batch


# ---------------------------------------------------------------- tokenising


def require_chat_template(tokenizer) -> None:
    """Conversations are rendered with the tokenizer's chat template: refuse a tokenizer without one."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "conversation data needs a tokenizer with a chat template (tokenizer.chat_template is empty):"
            " use the model's chat (instruct) variant, or plain text data"
        )


def chat_example(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Render a conversation with the chat template; the loss mask covers assistant turns only.

    Each prefix messages[:i+1] is rendered; an assistant turn owns the characters its rendering adds,
    and a token is trained on when it starts inside such a span.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            "conversation data needs a fast tokenizer (character offsets); load it with use_fast=True"
        )
    require_chat_template(tokenizer)
    spans, previous = [], ""
    for i, msg in enumerate(messages):
        rendered = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not rendered.startswith(previous):
            raise DataError(
                "this chat template does not render conversations prefix by prefix; cannot mask turns"
            )
        if msg["role"] == "assistant":
            spans.append((len(previous), len(rendered)))
        previous = rendered
    enc = tokenizer(previous, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return enc["input_ids"], mask


class Packer:
    """The batched `map` function that turns records into examples, in order (one process).

    Plain text joins one token stream (EOS after each document) cut into full max_length blocks; the tokens
    past the last full block carry over to the next batch, and the stream's tail is dropped at the end.
    A conversation is one example, truncated to max_length, dropped when no token of it is trained on.
    """

    def __init__(self, tokenizer, max_length: int) -> None:
        self.tokenizer, self.max_length = tokenizer, max_length
        self.stream: list[int] = []  # text tokens not yet in a block

    def __call__(self, batch: dict[str, list]) -> dict[str, list[list[int]]]:
        length, eos = self.max_length, self.tokenizer.eos_token_id
        ids_out: list[list[int]] = []
        mask_out: list[list[int]] = []
        texts = [t for t in batch["text"] if t is not None]
        for enc in self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []:
            self.stream.extend(enc)
            if eos is not None:
                self.stream.append(eos)
        full = len(self.stream) // length * length
        for start in range(0, full, length):
            ids_out.append(self.stream[start : start + length])
            mask_out.append([1] * length)
        del self.stream[:full]
        for messages in batch["messages"]:
            if messages is None:
                continue
            ids, mask = chat_example(self.tokenizer, json.loads(messages))
            if sum(mask[:length]):
                ids_out.append(ids[:length])
                mask_out.append(mask[:length])
        return {"input_ids": ids_out, "loss_mask": mask_out}


def write_arrow(rows: Iterable[dict[str, Any]], path: Path, features: datasets.Features) -> datasets.Dataset:
    """Write rows to one Arrow file, `WRITE_BATCH` rows at a time, and return it memory-mapped."""
    schema = features.arrow_schema
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        rows = iter(rows)
        while chunk := list(itertools.islice(rows, WRITE_BATCH)):
            writer.write_batch(pa.RecordBatch.from_pylist(chunk, schema=schema))
    return datasets.Dataset.from_file(str(path), in_memory=False)


def save_examples(make: Callable[[Path], datasets.Dataset], path: Path) -> datasets.Dataset:
    """Build a dataset in a scratch folder next to `path` (`make(scratch)`), save it, and move the saved
    folder onto `path` in one rename: a crash leaves no half-written cache entry. Returns it memory-mapped."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as scratch:
        built = make(Path(scratch))
        quiet = datasets.utils.are_progress_bars_disabled()
        datasets.disable_progress_bars()  # a bar for a copy of what `make` just showed
        try:
            built.save_to_disk(str(Path(scratch) / "saved"))
        finally:
            if not quiet:
                datasets.enable_progress_bars()
        del built  # its Arrow files are in `scratch`, removed on leaving
        try:
            os.replace(Path(scratch) / "saved", path)
        except OSError:  # another process saved the same entry first: keep theirs
            if not (path / "state.json").is_file():
                raise
    return datasets.load_from_disk(str(path), keep_in_memory=False)


def record_rows(records: Iterable[dict[str, Any]], source: str) -> Iterator[dict[str, str | None]]:
    """The records as RECORD_FEATURES rows (messages as JSON); a DataError at their end when none held any
    text or conversation: the source is empty, which no --max_length can help."""
    content = False
    for r in records:
        content = content or bool(r.get("text") or r.get("messages"))
        yield {"text": r.get("text"), "messages": json.dumps(r["messages"]) if "messages" in r else None}
    if not content:
        raise DataError(
            f"{source} holds no text and no conversation: it is empty; give a file or folder with data"
        )


def build_examples(
    records: Iterable[dict[str, Any]],
    tokenizer,
    max_length: int,
    path: Path,
    batch_size: int = WRITE_BATCH,
    source: str = "the dataset",
) -> datasets.Dataset:
    """Tokenise records into examples saved at `path` (see Packer); records never all sit in RAM."""

    def make(scratch: Path) -> datasets.Dataset:
        table = write_arrow(record_rows(records, source), scratch / "records.arrow", RECORD_FEATURES)
        examples = table.map(
            Packer(tokenizer, max_length),
            batched=True,
            batch_size=batch_size,
            remove_columns=table.column_names,
            features=EXAMPLE_FEATURES,
            cache_file_name=str(scratch / "examples.arrow"),
            new_fingerprint=path.name,
            writer_batch_size=WRITE_BATCH,
            desc="tokenising",
        )
        if len(examples) == 0:
            raise DataError(
                f"the dataset yields no example of {max_length} tokens; lower --max_length or add data"
            )
        return examples

    return save_examples(make, path)


def regenerated_token_rows(source: str, tokenizer) -> datasets.Dataset | None:
    """A train/regenerate.py dataset folder's rows when its `input_ids` come from this tokenizer (the same
    vocabulary, special tokens and chat template); None for any other source, or another tokenizer's rows
    (then the records' messages/text are tokenised again)."""
    path = Path(source)
    info = path / REGENERATION_FILE
    shards = is_regenerated_shards(path)
    if not ((shards or is_saved_dataset(path)) and info.is_file()):
        return None
    try:
        recorded = json.loads(info.read_text()).get("tokenizer")
    except (OSError, json.JSONDecodeError, AttributeError):
        raise DataError(
            f"{info} is damaged (not a JSON object); regenerate the data or delete that file"
        ) from None
    rows = load_shards(path) if shards else load_saved(path, "train")
    if recorded != tokenizer_fingerprint(tokenizer) or not {"input_ids", "loss_mask"} <= set(
        rows.column_names
    ):
        return None
    return rows


def build_token_examples(rows: datasets.Dataset, max_length: int, path: Path) -> datasets.Dataset:
    """Rows that already hold `input_ids` and `loss_mask` as examples saved at `path`: each row its own
    example, cut to max_length, dropped when no token of it is trained on."""

    def cut(batch: dict[str, list]) -> dict[str, list]:
        keep = [i for i, mask in enumerate(batch["loss_mask"]) if any(mask[:max_length])]
        return {
            "input_ids": [batch["input_ids"][i][:max_length] for i in keep],
            "loss_mask": [batch["loss_mask"][i][:max_length] for i in keep],
        }

    def make(scratch: Path) -> datasets.Dataset:
        examples = rows.select_columns(["input_ids", "loss_mask"]).map(
            cut,
            batched=True,
            batch_size=WRITE_BATCH,
            features=EXAMPLE_FEATURES,
            cache_file_name=str(scratch / "examples.arrow"),
            new_fingerprint=path.name,
            writer_batch_size=WRITE_BATCH,
            desc="cutting to max_length",
        )
        if len(examples) == 0:
            raise DataError(
                f"no row of the dataset has a trained token in its first {max_length}; raise --max_length"
            )
        return examples

    return save_examples(make, path)


def tokenizer_fingerprint(tokenizer) -> str:
    """A digest of what decides a tokenizer's ids: its vocabulary, special tokens and chat template (the same
    across library versions, so data regenerated in another environment is recognised)."""
    h = hashlib.sha1(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    specials = [str(getattr(tokenizer, f"{name}_token", None)) for name in ("bos", "eos", "pad", "unk")]
    h.update(json.dumps(specials).encode())
    h.update(str(getattr(tokenizer, "chat_template", "") or "").encode())
    return h.hexdigest()[:16]


def source_fingerprint(source: str, split: str, tokenizer, max_length: int) -> str:
    """The cache key of a source's examples: the source, its files' sizes and times (a shards folder: its
    manifest's checksums), the tokenizer, max_length."""
    h = hashlib.sha1(f"{source}|{split}|{max_length}|{tokenizer.name_or_path}|{len(tokenizer)}".encode())
    h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()[:1_000_000])
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    path = Path(source)
    if path.is_dir() and is_regenerated_shards(
        path
    ):  # checksummed shards: their manifest names the content, so a
        h.update((path / MANIFEST_FILE).read_bytes())  # fresh clone (new file times) finds its cache again
        return h.hexdigest()[:16]
    files = sorted(path.rglob("*")) if path.is_dir() else [path] if path.exists() else []
    for f in files:
        if f.is_file():
            st = f.stat()
            h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    if source in ("stdlib", "demo"):
        import sysconfig

        h.update(sysconfig.get_paths()["stdlib"].encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("SELFSPEC_CACHE", Path.home() / ".cache" / "selfspec")) / "tokenized"


# ---------------------------------------------------------------- examples for a DataLoader


class Examples(torch.utils.data.Dataset):
    """Tokenised rows (a memory-mapped `datasets.Dataset`) as tensors for a DataLoader.

    `key` names the content (the cache key, extended by every selection), so a run can be fingerprinted
    without reading the data. `features` (EAGLE's feature cache) gives row i's target features (L_i, H)
    from disk; `pad_batch` pads them like the tokens.
    """

    def __init__(
        self, rows: datasets.Dataset, key: str, features: Callable[[int], torch.Tensor] | None = None
    ) -> None:
        self.rows, self.key, self.features = rows, key, features
        self._tensors = rows.with_format("torch")

    def __len__(self) -> int:
        return self.rows.num_rows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self._tensors[i]
        out = {"input_ids": row["input_ids"], "loss_mask": row["loss_mask"]}  # (L,) int32 and int8
        if self.features is not None:
            out["features"] = self.features(i)  # (L, H)
        return out

    def select(self, indices: Iterable[int] | np.ndarray, what: str) -> Examples:
        """The rows at `indices`, in that order; `what` (e.g. "subset 64 seed 0") extends the key."""
        if self.features is not None:
            raise ValueError("select rows before attaching features")
        key = hashlib.sha1(f"{self.key}|{what}".encode()).hexdigest()[:16]
        return Examples(self.rows.select(indices, keep_in_memory=True), key)

    def lengths(self) -> np.ndarray:
        """Every row's token count (N,), read a batch at a time."""
        arrow = self.rows.with_format("arrow")
        return np.concatenate(
            [pc.list_value_length(b["input_ids"]).to_numpy() for b in arrow.iter(4096)]
            or [np.zeros(0, dtype=np.int32)]
        )

    def token_batches(self, batch_size: int = 4096) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(ids, loss_mask) of `batch_size` rows at a time, flattened to (tokens,) each."""
        for b in self.rows.with_format("arrow").iter(batch_size):
            ids = pc.list_flatten(b["input_ids"]).to_numpy().astype(np.int64)
            mask = pc.list_flatten(b["loss_mask"]).to_numpy().astype(bool)
            yield torch.from_numpy(ids), torch.from_numpy(mask)


def examples_from_lists(input_ids: list[list[int]], loss_mask: list[list[int]] | None = None) -> Examples:
    """Small in-memory examples (tests, calibration): rows of ids and their loss masks (default: all 1)."""
    masks = loss_mask if loss_mask is not None else [[1] * len(r) for r in input_ids]
    rows = datasets.Dataset.from_dict({"input_ids": input_ids, "loss_mask": masks}, features=EXAMPLE_FEATURES)
    return Examples(rows, hashlib.sha1(repr((input_ids, masks)).encode()).hexdigest()[:16])


def pad_batch(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A DataLoader's collate: rows padded on the right to the batch's longest row.

    input_ids (B, T) long, 0 on padding; loss_mask (B, T) bool, False on padding; attention_mask (B, T)
    long, 0 on padding; and features (B, T, H) zero on padding when the rows carry them. The padding id is
    never read: no real position attends to it and no loss is taken there. Packed rows (train/data/packing.py)
    also carry position_ids (B, T), restarting at 0 on the padding, and seq_ids (B, T), -1 on the padding.
    """
    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), length, dtype=torch.bool)
    attention = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = r["input_ids"]
        loss_mask[i, :n] = r["loss_mask"].bool()
        attention[i, :n] = 1
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention}
    if "features" in rows[0]:
        first = rows[0]["features"]
        feats = first.new_zeros(len(rows), length, first.shape[-1])
        for i, r in enumerate(rows):
            feats[i, : len(r["features"])] = r["features"]
        batch["features"] = feats
    if "seq_ids" in rows[0]:
        batch["position_ids"] = torch.arange(length).repeat(len(rows), 1)
        batch["seq_ids"] = torch.full((len(rows), length), -1, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            batch["position_ids"][i, :n] = r["position_ids"]
            batch["position_ids"][i, n:] -= n
            batch["seq_ids"][i, :n] = r["seq_ids"]
    return batch


def load_examples(source: str, tokenizer, max_length: int, split: str = "train") -> Examples:
    """Tokenised examples for a source, memory-mapped from the on-disk cache (built there on first use)."""
    key = source_fingerprint(source, split, tokenizer, max_length)
    path = cache_dir() / key
    if (path / "state.json").is_file():
        rows = datasets.load_from_disk(str(path), keep_in_memory=False)
    elif (tokens := regenerated_token_rows(source, tokenizer)) is not None:
        rows = build_token_examples(tokens, max_length, path)
    else:
        rows = build_examples(iter_records(source, split), tokenizer, max_length, path, source=source)
    return Examples(rows, key)


def split_examples(examples: Examples, fraction: float, seed: int) -> tuple[Examples, Examples]:
    """Hold out a seeded `fraction` of examples (at least one) for validation."""
    n = len(examples)
    if n < 2:
        raise DataError(
            "need at least 2 examples to hold one out for validation; add data or lower --max_length"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    k = max(1, int(n * fraction))
    what = f"split {fraction} seed {seed}"
    return examples.select(order[k:], f"train {what}"), examples.select(order[:k], f"held out {what}")
