"""A dataset's regeneration work items (conversations, and windows of its packed plain text), built once and
cached like its tokenised examples, and selected the same way."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from pathlib import Path

import datasets
import numpy as np
import torch

from selfspec.train.data.examples import (
    WRITE_BATCH,
    cache_dir,
    record_rows,
    require_chat_template,
    save_examples,
    source_fingerprint,
    write_arrow,
)
from selfspec.train.data.records import RECORD_FEATURES, DataError, iter_records

# a work item: a conversation (its messages as JSON) or a text window (its token ids); `item` numbers them in
# order
ITEM_FEATURES = datasets.Features(
    {
        "messages": datasets.Value("string"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "item": datasets.Value("int64"),
    }
)
PACKED_FEATURES = datasets.Features(
    {k: v for k, v in ITEM_FEATURES.items() if k != "item"}
)  # before numbering


@dataclasses.dataclass
class Items:
    """A source's work items (a memory-mapped dataset of ITEM_FEATURES rows); `key` names them and every
    selection, like train.data.Examples, so train.run_data's `subset` and train.data's `split_examples` select
    them the same way."""

    rows: datasets.Dataset
    key: str

    def __len__(self) -> int:
        return self.rows.num_rows

    def select(self, indices: Iterable[int] | np.ndarray, what: str) -> Items:
        """The items at `indices`, in that order; `what` (e.g. "subset 64 seed 0") extends the key."""
        return Items(
            self.rows.select(indices, keep_in_memory=True),
            hashlib.sha1(f"{self.key}|{what}".encode()).hexdigest()[:16],
        )


class ItemPacker:
    """The batched `map` function that turns records into items, in order (one process): plain text joins one
    token stream (EOS after each document) cut into full max_length windows, as train.data.Packer packs it; a
    conversation is one item, kept as its messages."""

    def __init__(self, tokenizer, max_length: int) -> None:
        self.tokenizer, self.max_length = tokenizer, max_length
        self.stream: list[int] = []

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        texts = [t for t in batch["text"] if t is not None]
        for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []:
            self.stream += ids + (
                [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
            )
        full = len(self.stream) // self.max_length * self.max_length
        windows = [self.stream[i : i + self.max_length] for i in range(0, full, self.max_length)]
        del self.stream[:full]
        chats = [m for m in batch["messages"] if m is not None]
        if chats:
            require_chat_template(self.tokenizer)
        return {"messages": [None] * len(windows) + chats, "input_ids": windows + [None] * len(chats)}


def load_items(source: str, split: str, tokenizer, max_length: int) -> Items:
    """A source's work items, built once and cached under cache_dir() (keyed like its tokenised examples)."""
    key = "items-" + source_fingerprint(source, split, tokenizer, max_length)
    path = cache_dir() / key
    if (path / "state.json").is_file():
        return Items(datasets.load_from_disk(str(path), keep_in_memory=False), key)

    def make(scratch: Path) -> datasets.Dataset:
        rows = record_rows(iter_records(source, split), source)
        table = write_arrow(rows, scratch / "records.arrow", RECORD_FEATURES)
        items = table.map(
            ItemPacker(tokenizer, max_length),
            batched=True,
            batch_size=WRITE_BATCH,
            remove_columns=table.column_names,
            features=PACKED_FEATURES,
            cache_file_name=str(scratch / "items.arrow"),
            new_fingerprint=key,
            writer_batch_size=WRITE_BATCH,
            desc="reading items",
        )
        if len(items) == 0:
            raise DataError(
                f"{source} yields no conversation and no text window of {max_length} tokens; "
                "lower --max_length or add data"
            )
        return items.add_column("item", np.arange(len(items), dtype=np.int64))

    return Items(save_examples(make, path), key)


def random_subset(items: Items, count: int, seed: int) -> Items:
    """A seeded random subset of `count` items in their order (all when there are fewer):
    train.run_data.subset's."""
    n = len(items)
    if count <= 0 or count >= n:
        return items
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:count].sort().values
    return items.select(idx.numpy(), f"subset {count} seed {seed}")
