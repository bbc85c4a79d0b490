import json

import datasets
import pytest
import torch

import selfspec.train.data.examples as data_module
from conftest import TOKENIZER_TEXT, tiny_tokenizer
from selfspec.train.data.examples import (
    Examples,
    build_examples,
    chat_example,
    examples_from_lists,
    load_examples,
    pad_batch,
    split_examples,
)
from selfspec.train.data.records import DataError, iter_records
from selfspec.train.data.run_data import subset

MSGS = [
    {"role": "user", "content": "add a b"},
    {"role": "assistant", "content": "return a + b"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "x = 1"},
]


def straightforward(records: list[dict], tok, max_length: int) -> list[tuple[list[int], list[int]]]:
    """The examples as the old in-memory builder made them, unpadded: every text into one stream (EOS after
    each) cut into full blocks, then every conversation with a trained token, cut to max_length."""
    stream = [
        i
        for r in records
        if "text" in r
        for i in tok(r["text"], add_special_tokens=False).input_ids + [tok.eos_token_id]
    ]
    out = [
        (stream[s : s + max_length], [1] * max_length)
        for s in range(0, len(stream) - max_length + 1, max_length)
    ]
    for r in records:
        if "messages" in r:
            ids, mask = chat_example(tok, r["messages"])
            if sum(mask[:max_length]):
                out.append((ids[:max_length], mask[:max_length]))
    return out


def rows_of(examples: Examples | datasets.Dataset) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) of every row, as Examples gives them to the DataLoader (or a saved dataset holds
    them)."""
    if isinstance(examples, datasets.Dataset):
        return list(zip(examples["input_ids"], examples["loss_mask"]))
    return [
        (examples[i]["input_ids"].tolist(), examples[i]["loss_mask"].tolist()) for i in range(len(examples))
    ]


def test_text_is_packed_with_eos_between_documents_across_map_batches(tmp_path):
    tok = tiny_tokenizer()
    for i in range(5):  # documents of different lengths, so blocks straddle documents and map batches
        (tmp_path / f"{i}.txt").write_text(TOKENIZER_TEXT * (i + 1))
    records = list(iter_records(str(tmp_path)))
    ex = build_examples(iter(records), tok, 16, tmp_path / "cache", batch_size=2)
    expected = straightforward(records, tok, 16)
    assert rows_of(ex) == expected and len(expected) > 10
    stream = tok(TOKENIZER_TEXT, add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert ex["input_ids"][0] == stream[:16]
    assert (
        ex.features["input_ids"].feature.dtype == "int32" and ex.features["loss_mask"].feature.dtype == "int8"
    )


def test_conversations_round_trip_one_example_each(tmp_path):
    tok = tiny_tokenizer()
    chats = [{"messages": MSGS[: 2 + 2 * (i % 2)]} for i in range(7)]
    chats.insert(3, {"messages": MSGS[:1]})  # no assistant turn: nothing to train on, dropped
    chats.append({"messages": MSGS * 5})  # longer than max_length: cut
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    ex = build_examples(iter_records(str(path)), tok, 64, tmp_path / "cache", batch_size=3)
    rows = rows_of(ex)
    assert rows == straightforward(list(iter_records(str(path))), tok, 64)
    assert (
        len(rows) == 8 and len(rows[-1][0]) == 64 and len(rows[0][0]) < 64
    )  # variable length, nothing padded
    assert tok.decode([i for i, m in zip(*rows[0]) if m]) == "<|assistant|>return a + b<eos>"


def test_chat_loss_mask_covers_assistant_turns_only(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    tok = tiny_tokenizer()
    ids, mask = chat_example(tok, MSGS)
    assert len(ids) == len(mask)
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "<|assistant|>return a + b<eos><|assistant|>x = 1<eos>"
    sharegpt = tmp_path / "chats.json"
    sharegpt.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "human", "value": "add a b"},
                        {"from": "gpt", "value": "return a + b"},
                    ]
                }
            ]
        )
    )
    openai = tmp_path / "chats.jsonl"
    openai.write_text(json.dumps({"messages": MSGS[:2]}) + "\n")
    a, b = load_examples(str(sharegpt), tok, 64), load_examples(str(openai), tok, 64)
    assert rows_of(a) == rows_of(b) and len(a[0]["input_ids"]) < 64


def test_batches_are_padded_to_their_longest_row():
    ex = examples_from_lists([[5, 6, 7], [8, 9, 10, 11, 12], [13]], [[0, 1, 1], [1, 1, 1, 1, 1], [1]])
    batch = pad_batch([ex[0], ex[1]])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]]
    assert batch["input_ids"].dtype == torch.long and batch["attention_mask"].dtype == torch.long
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert batch["loss_mask"].dtype == torch.bool
    assert batch["loss_mask"].tolist() == [[False, True, True, False, False], [True] * 5]
    assert pad_batch([ex[0], ex[2]])["input_ids"].shape == (2, 3)  # each batch to its own longest row
    rows = [ex[0] | {"features": torch.ones(3, 4)}, ex[2] | {"features": torch.full((1, 4), 2.0)}]
    feats = pad_batch(rows)["features"]
    assert (
        feats.shape == (2, 3, 4)
        and feats[0].eq(1).all()
        and feats[1, 0].eq(2).all()
        and feats[1, 1:].eq(0).all()
    )


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        list(iter_records(str(tmp_path / "missing.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(DataError, match="need a `text`, `messages` or `conversations`"):
        list(iter_records(str(bad)))
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError, match="chat template"):
        chat_example(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(DataError, match="chat template"):  # raised inside datasets.map, unchanged
        build_examples([{"messages": MSGS}], tok, 16, tmp_path / "chat")
    with pytest.raises(DataError, match="no example of 4096 tokens"):
        build_examples([{"text": "short"}], tiny_tokenizer(), 4096, tmp_path / "short")
    assert not (tmp_path / "short").exists() and not list(tmp_path.glob(".short*"))  # no half-written entry


def test_tokenised_data_is_cached_and_memory_mapped(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "code.txt"
    data.write_text(TOKENIZER_TEXT * 5)
    first = load_examples(str(data), tiny_tokenizer(), 16)
    entries = list((tmp_path / "cache" / "tokenized").iterdir())
    assert len(entries) == 1 and (entries[0] / "state.json").is_file()
    assert first.rows.cache_files and all(
        f["filename"].startswith(str(entries[0])) for f in first.rows.cache_files
    )
    calls = []
    monkeypatch.setattr(data_module.Packer, "__call__", lambda self, batch: calls.append(batch))
    again = load_examples(str(data), tiny_tokenizer(), 16)
    assert calls == [] and rows_of(again) == rows_of(first) and again.key == first.key
    monkeypatch.undo()
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    data.write_text(TOKENIZER_TEXT * 6)  # a changed file is a new cache entry
    changed = load_examples(str(data), tiny_tokenizer(), 16)
    assert len(list((tmp_path / "cache" / "tokenized").iterdir())) == 2 and changed.key != first.key


def test_split_and_subset_select_the_seeded_permutation():
    ids = [[i, i + 1] for i in range(50)]
    ex = examples_from_lists(ids)
    train, held = split_examples(ex, 0.1, seed=3)
    order = torch.randperm(50, generator=torch.Generator().manual_seed(3)).tolist()
    assert [r[0][0] for r in rows_of(held)] == order[:5] and [r[0][0] for r in rows_of(train)] == order[5:]
    small = subset(ex, 7, seed=1)
    expected = sorted(torch.randperm(50, generator=torch.Generator().manual_seed(1))[:7].tolist())
    assert [r[0][0] for r in rows_of(small)] == expected
    assert len({ex.key, train.key, held.key, small.key, subset(ex, 7, seed=2).key}) == 5
    assert subset(ex, 50, seed=1) is ex


def test_a_folder_saved_with_save_to_disk_is_read_as_a_dataset(tmp_path):
    texts = ["def f(a):\n    return a\n", "class A:\n    x = 1\n"]
    chats = [[{"role": "user", "content": "add a b"}, {"role": "assistant", "content": "return a + b"}]]
    table = datasets.Dataset.from_dict({"text": texts + [None], "messages": [None, None] + chats})
    table.save_to_disk(str(tmp_path / "one"))
    (tmp_path / "one" / "stray.json").write_text('{"not": "a record"}')  # never globbed as data
    assert list(iter_records(str(tmp_path / "one"))) == [{"text": t} for t in texts] + [
        {"messages": chats[0]}
    ]
    datasets.DatasetDict({"train": table.select([0]), "validation": table.select([1])}).save_to_disk(
        str(tmp_path / "two")
    )
    assert list(iter_records(str(tmp_path / "two"), split="validation")) == [{"text": texts[1]}]
    with pytest.raises(DataError, match="holds the splits train, validation, not 'test'"):
        list(iter_records(str(tmp_path / "two"), split="test"))


def test_examples_without_a_label_are_dropped_and_none_at_all_is_refused(capsys):
    import datasets

    from selfspec.train.data.examples import Examples
    from selfspec.train.data.run_data import labelled
    from selfspec.train.loop.config import ConfigError
    from selfspec.train.loop.train_config import TrainConfig

    rows = datasets.Dataset.from_dict(
        {
            "input_ids": [[1, 2, 3, 4], [1, 2], [1, 2, 3], [5, 6, 7, 8]],
            "loss_mask": [[0, 0, 0, 1], [1, 1], [1, 1, 0], [1, 1, 1, 1]],
        }
    )
    kept = labelled(Examples(rows, "k"), TrainConfig(max_length=4), "training")
    assert kept.rows["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert "2 of 4 training examples carry no label within --max_length 4" in capsys.readouterr().err
    short = datasets.Dataset.from_dict({"input_ids": [[1], [2]], "loss_mask": [[1], [1]]})
    with pytest.raises(ConfigError, match="no training example carries a label .* raise --max_length"):
        labelled(Examples(short, "s"), TrainConfig(max_length=1), "training")
