"""Datasets -> fixed-length examples of token ids with a loss mask.

Sources: `stdlib` (the demo corpus), a local `.txt` file or folder of text files, `.json`/`.jsonl`
with a `text` field, ShareGPT `conversations` or OpenAI `messages` (rendered with the tokenizer's chat
template, loss on assistant turns only), or a name for `datasets.load_dataset`. Tokenised results
are cached on disk, keyed by the source, its files' sizes and times, the tokenizer and max_length.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from heads.io import atomic_write
from shipped.stdlib_corpus import stdlib_texts

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


class DataError(ValueError):
    """A dataset that cannot be read as any supported layout."""


def _records_from_json(path: Path) -> list[tuple[str, Any]]:
    """(where, record) pairs of a .json/.jsonl file; `where` names the file and line for error messages."""
    text = path.read_text(errors="replace")
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    records.append((f"{path} line {number}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path} line {number} is not valid JSON ({e.msg} at column {e.colno})") from None
        return records
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {e.lineno} is not valid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(data, dict) and "data" in data:
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f"{path} must hold a list of records (or {{'data': [...]}})")
    return [(f"{path} record {i}", r) for i, r in enumerate(data)]


def load_records(source: str, split: str = "train") -> list[dict[str, Any]]:
    """Read a source into records with either `text` or `messages` (role/content)."""
    if source in ("stdlib", "demo"):
        return [{"text": t} for t in stdlib_texts("validation" if split == "validation" else "train")]
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES | {".json", ".jsonl"})
        if not files:
            raise DataError(f"{path} holds no .txt/.md/.py/.json/.jsonl files")
        return [r for f in files for r in load_records(str(f), split)]
    if path.is_file():
        if path.suffix in (".json", ".jsonl"):
            return [_normalise(r, where) for where, r in _records_from_json(path)]
        return [{"text": path.read_text(errors="replace")}]
    if path.suffix in TEXT_SUFFIXES | {".json", ".jsonl"} or source.startswith((".", "/", "~")):
        raise DataError(f"dataset {source!r} does not exist (no such file or folder)")
    try:
        import datasets

        ds = datasets.load_dataset(source, split=split)
    except Exception as err:  # the hub and local scripts raise many types; all mean the same to the user
        raise DataError(f"could not load dataset {source!r} ({type(err).__name__}: {err}); give a local file, folder, "
                        "or a `datasets` name that is cached (HF_HUB_OFFLINE=1 blocks downloads)") from err
    return [_normalise(dict(r), f"{source} record {i}") for i, r in enumerate(ds)]


def _normalise(record: Any, where: str) -> dict[str, Any]:
    """A record as {"text": ...} or {"messages": [{"role", "content"}, ...]}; errors name `where` it was."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    try:
        if "messages" in record:
            return {"messages": [{"role": m["role"], "content": m["content"]} for m in record["messages"]]}
        if "conversations" in record:
            msgs = []
            for turn in record["conversations"]:
                role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
                if role is None:
                    raise DataError(f"{where}: unknown ShareGPT speaker {turn.get('from')!r}")
                msgs.append({"role": role, "content": turn["value"]})
            return {"messages": msgs}
    except (KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{where}: a turn needs `role`/`content` (messages) or `from`/`value` (ShareGPT); "
                        f"{type(e).__name__}: {e}") from None
    if "text" in record:
        return {"text": record["text"]}
    raise DataError(f"{where}: records need a `text`, `messages` or `conversations` field; got {sorted(record)}")


def chat_example(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Render a conversation with the chat template; the loss mask covers assistant turns only.

    Each prefix messages[:i+1] is rendered; an assistant turn owns the characters its rendering adds,
    and a token is trained on when it starts inside such a span.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("conversation data needs a fast tokenizer (character offsets); load it with use_fast=True")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("conversation data needs a tokenizer with a chat template (tokenizer.chat_template is empty)")
    spans, previous = [], ""
    for i, msg in enumerate(messages):
        rendered = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not rendered.startswith(previous):
            raise DataError("this chat template does not render conversations prefix by prefix; cannot mask turns")
        if msg["role"] == "assistant":
            spans.append((len(previous), len(rendered)))
        previous = rendered
    enc = tokenizer(previous, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return enc["input_ids"], mask


def build_examples(records: list[dict[str, Any]], tokenizer, max_length: int) -> dict[str, torch.Tensor]:
    """Plain text is packed into max_length blocks (EOS between documents); conversations are one example each."""
    eos = tokenizer.eos_token_id
    ids_out, mask_out, attn_out = [], [], []
    stream: list[int] = []
    texts = [r["text"] for r in records if "text" in r]
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []:
        stream.extend(enc)
        if eos is not None:
            stream.append(eos)
    for start in range(0, len(stream) - max_length + 1, max_length):
        ids_out.append(stream[start : start + max_length])
        mask_out.append([1] * max_length)
        attn_out.append([1] * max_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    for r in records:
        if "messages" in r:
            ids, mask = chat_example(tokenizer, r["messages"])
            ids, mask = ids[:max_length], mask[:max_length]
            if sum(mask) == 0:
                continue
            padding = max_length - len(ids)
            ids_out.append(ids + [pad] * padding)
            mask_out.append(mask + [0] * padding)
            attn_out.append([1] * len(ids) + [0] * padding)
    if not ids_out:
        raise DataError(f"the dataset yields no example of {max_length} tokens; lower --max_length or add data")
    return {
        "input_ids": torch.tensor(ids_out, dtype=torch.long),  # (N, T)
        "loss_mask": torch.tensor(mask_out, dtype=torch.bool),  # (N, T) True where a token is trained on
        "attention_mask": torch.tensor(attn_out, dtype=torch.long),  # (N, T) 0 on right padding
    }


def _fingerprint(source: str, split: str, tokenizer, max_length: int) -> str:
    h = hashlib.sha1(f"{source}|{split}|{max_length}|{tokenizer.name_or_path}|{len(tokenizer)}".encode())
    h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()[:1_000_000])
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    path = Path(source)
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


def load_examples(source: str, tokenizer, max_length: int, split: str = "train") -> dict[str, torch.Tensor]:
    """Tokenised examples for a source, read from the on-disk cache when the same inputs were seen before."""
    path = cache_dir() / f"{_fingerprint(source, split, tokenizer, max_length)}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)
    examples = build_examples(load_records(source, split), tokenizer, max_length)
    atomic_write(path, lambda tmp: torch.save(examples, tmp))
    return examples


def split_examples(examples: dict[str, torch.Tensor], fraction: float, seed: int) -> tuple[dict, dict]:
    """Hold out a seeded `fraction` of examples (at least one) for validation."""
    n = examples["input_ids"].shape[0]
    if n < 2:
        raise DataError("need at least 2 examples to hold one out for validation; add data or lower --max_length")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    k = max(1, int(n * fraction))
    take = lambda idx: {key: v[idx] for key, v in examples.items()}  # noqa: E731
    return take(order[k:]), take(order[:k])
