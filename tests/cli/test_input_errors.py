"""Damaged or mistyped input files fail with one message naming the file (and the line or field)."""

import json

import pytest

from selfspec.heads.config import HeadsConfig
from selfspec.heads.registry import load_heads
from selfspec.train.data.records import DataError, iter_records
from selfspec.train.loop.train_config import TrainConfig


def test_a_bad_jsonl_line_is_named(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "fine"}\n{"text": broken}\n')
    with pytest.raises(DataError, match=rf"{path} line 4 is not valid JSON \(Expecting value at column 10\)"):
        list(iter_records(str(path)))


def test_a_bad_json_file_is_named_with_its_line(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[\n  {"text": "a"},\n  {"text": "b",}\n]\n')
    with pytest.raises(DataError, match=rf"{path} line 3 is not valid JSON"):
        list(iter_records(str(path)))


@pytest.mark.parametrize(
    "record, problem",
    [
        ({"messages": [{"role": "user"}]}, r"line 2: a turn needs `role`/`content`"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "gpt", "content": "yo"}]},
            (
                r"line 2: unknown message role 'gpt'; use one of system, developer, user, "
                r"assistant, tool, function"
            ),
        ),
        ({"conversations": [{"from": "alien", "value": "hi"}]}, r"line 2: unknown ShareGPT speaker 'alien'"),
        (
            {"prompt": "x"},
            r"line 2: records need a `text`, `messages` or `conversations` field; got \['prompt'\]",
        ),
        (["not", "an", "object"], r"line 2: a record must be a JSON object, got list"),
    ],
)
def test_a_bad_record_is_named_with_its_line(tmp_path, record, problem):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError, match=rf"{path} {problem}"):
        list(iter_records(str(path)))


@pytest.mark.parametrize(
    "field, value, problem",
    [
        ("num_heads", "4", r"num_heads must be int, got '4' \(str\)"),
        ("hidden_size", 64.0, r"hidden_size must be int, got 64.0 \(float\)"),
        ("tree", [[0], ["1"]], r"tree must be a list of lists of ints"),
        ("share_lm_head", "yes", r"share_lm_head must be bool"),
        ("dtype", "fp8", r"unknown dtype 'fp8'"),
    ],
)
def test_a_mistyped_heads_config_names_file_and_field(tmp_path, field, value, problem):
    config = HeadsConfig(hidden_size=64, vocab_size=96).to_dict() | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}: {problem}"):
        load_heads(tmp_path)


def test_damaged_heads_files_are_named(tmp_path):
    (tmp_path / "config.json").write_text('{"kind": "medusa",\n "hidden_size": }')
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'} is not readable JSON .*line 2"):
        load_heads(tmp_path)
    (tmp_path / "config.json").write_text(HeadsConfig(hidden_size=64, vocab_size=96).to_json())
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{truncated")
    with pytest.raises(ValueError, match=rf"cannot read the weights in {tmp_path / 'model.safetensors'}"):
        load_heads(tmp_path)


def test_a_model_path_that_holds_no_model_is_named(tmp_path):
    from selfspec.shipped.models import resolve_model

    with pytest.raises(
        FileNotFoundError, match=r"the model folder .*missing does not exist: give a model's folder"
    ):
        resolve_model(str(tmp_path / "missing"))  # not sent to the hub as a repo id
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(HeadsConfig(hidden_size=64, vocab_size=96).to_json())
    with pytest.raises(
        ValueError,
        match=r"holds a drafter \(medusa\), not a target model: give the target it "
        r"was trained on \(see its base_model\) as the model",
    ):
        resolve_model(str(heads))
    assert resolve_model("org/model") == "org/model"  # a hub name passes through


@pytest.mark.parametrize(
    "name, content, problem",
    [
        ("blob.bin", bytes(range(256)) * 64, "is a binary file, not text"),
        ("notes.txt", b"\xff\xfe\xfa" * 400 + b"some text", "does not read as UTF-8 text"),
        ("chat.jsonl", b'["a", "list"]\n', "line 1: a record must be a JSON object, got list"),
        (
            "chat.jsonl",
            b'{"question": "q", "answer": "a"}\n',
            "records need a `text`, `messages` or `conversations`",
        ),
    ],
)
def test_data_that_is_not_text_is_refused_before_any_model_loads(
    tmp_path, monkeypatch, name, content, problem
):
    import selfspec.train.loop.training as train_loop

    path = tmp_path / name
    path.write_bytes(content)
    loaded = []
    monkeypatch.setattr(train_loop, "make_accelerator", lambda cfg: loaded.append(cfg))
    with pytest.raises(DataError, match=problem) as error:
        train_loop.start_run(TrainConfig(dataset=str(path), output_dir=str(tmp_path / "out")))
    assert str(path) in str(error.value) and not loaded


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.txt"])
def test_an_empty_data_file_is_called_empty(tmp_path, monkeypatch, name):
    """It said 'lower --max_length', which cannot help."""
    from conftest import tiny_tokenizer
    from selfspec.train.data.examples import load_examples

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    (tmp_path / name).write_text("")
    with pytest.raises(DataError, match=rf"{name} holds no text and no conversation: it is empty"):
        load_examples(str(tmp_path / name), tiny_tokenizer(), 32)


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.txt"])
def test_an_empty_data_file_is_called_empty_when_regenerated(tmp_path, monkeypatch, name):
    """train/regenerate.py and --self_distill read work items: these said 'lower --max_length'."""
    from conftest import tiny_tokenizer
    from selfspec.train.regeneration.items import load_items

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    (tmp_path / name).write_text("")
    with pytest.raises(DataError, match=rf"{name} holds no text and no conversation: it is empty; give"):
        load_items(str(tmp_path / name), "train", tiny_tokenizer(), 32)
