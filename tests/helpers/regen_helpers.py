"""What tests/regeneration/test_regenerate.py and tests/regeneration/test_regenerate_resume.py share: a tiny
target saved with a chat template that has a generation prompt, the chats it regenerates, and a run's options
and output rows."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

from conftest import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
# the conftest template with a generation prompt (what chat models ship): "<|assistant|>" opens each answer
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SYSTEM = {"role": "system", "content": "be brief"}
CHATS = [
    {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "add a b"},
            {"role": "assistant", "content": "return a + b"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "x = 1"},
        ]
    },
    {"conversations": [{"from": "human", "value": "print(i)"}, {"from": "gpt", "value": "ok"}]},
    {"messages": [{"role": "user", "content": "for i"}]},  # cut after the user turn: it gets an answer
    {"messages": [{"role": "assistant", "content": "hello"}]},  # nothing asked: skipped
    {
        "messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "y"}]
    },  # an empty user turn
]


def save_target(tmp_path: Path, monkeypatch) -> Path:
    """The tiny Llama and a tokenizer whose template has a generation prompt, saved; a private cache."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "target"
    tiny_model("llama").save_pretrained(path)
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def options(target_dir: Path, data: Path, out: Path, **extra) -> dict:
    return {
        "model": str(target_dir),
        "dataset": str(data),
        "output_dir": str(out),
        "temperature": 0.0,
        "max_new_tokens": 6,
        "max_length": 160,
        "prompt_tokens": 8,
        "batch_size": 2,
        "shard_size": 2,
    } | extra


def args_of(opts: dict) -> list[str]:
    return [x for k, v in opts.items() for x in (f"--{k}", str(v))]


def rows_of(out: Path) -> list[dict]:
    return list(datasets.load_from_disk(str(out)))
