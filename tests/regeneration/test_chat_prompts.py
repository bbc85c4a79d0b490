"""The project's own chat requests (shipped/chat_prompts.py) and chat prompts for bench/tune (--prompts)."""

import json
import random

import pytest

from selfspec.infer.measure.bench import load_prompts, render_prompts
from selfspec.shipped import chat_prompts as cp
from selfspec.train.regeneration.chat import answer_slots


def test_math_problems_are_filled_and_varied():
    rows = cp.math_requests(random.Random(0), 200)
    texts = [r["messages"][0]["content"] for r in rows]
    assert all("{" not in t and "}" not in t for t in texts)
    assert len({cp.words_key(t) for t in texts}) > 190  # numbers and names make them distinct
    assert {r["kind"] for r in rows} == {"math"}


def test_code_requests_come_from_their_split_only():
    train = cp.code_requests(random.Random(0), "train", 60)
    test = cp.code_requests(random.Random(0), "test", 60)
    assert len(train) >= 60 and len(test) >= 30
    train_keys = {cp.words_key(r["messages"][0]["content"]) for r in train}
    test_keys = {cp.words_key(r["messages"][0]["content"]) for r in test}
    # the corpus splits by file: only a question about a module name both splits hold may repeat
    assert all(
        key.startswith("what is python s") and key.endswith("module for show a short example")
        for key in train_keys & test_keys
    )


def test_a_docstring_request_shows_the_function_without_its_docstring():
    src = 'def f(x):\n    """Double x."""\n    return 2 * x'
    stripped = cp.strip_docstring(src)
    assert "Double" not in stripped and "return 2 * x" in stripped


def test_followups_leave_an_answer_slot_regeneration_fills():
    rows = [{"messages": cp.user("Explain recursion."), "kind": "magpie"} for _ in range(50)]
    cp.add_followups(random.Random(0), rows, 0.5)
    followed = [r for r in rows if r["kind"].endswith("+followup")]
    assert 10 < len(followed) < 40
    slots = answer_slots(followed[0]["messages"])
    assert [s if s is None else s["role"] for s in slots] == ["user", None, "user", None]  # two answers


def test_dedupe_drops_repeats_and_the_excluded():
    rows = [
        {"messages": cp.user(t), "kind": "k"} for t in ["Hi there!", "hi, there", "Other one", "Held out"]
    ]
    kept = cp.dedupe(rows, exclude={cp.words_key("held out")})
    assert [r["messages"][0]["content"] for r in kept] == ["Hi there!", "Other one"]


@pytest.mark.parametrize("name", ["smollm2-train.jsonl", "smollm2-heldout.jsonl"])
def test_the_shipped_request_sets(name):
    rows = [json.loads(line) for line in (cp.OUT_DIR / name).read_text().splitlines()]
    keys = [cp.words_key(r["messages"][0]["content"]) for r in rows]
    assert len(keys) == len(set(keys))
    kinds = {r["kind"].split("+")[0] for r in rows}
    assert kinds == {"magpie", "code", "math"}
    assert any(r["kind"].endswith("+followup") for r in rows)
    assert len(rows) >= (2000 if "train" in name else 80)


def requests(name: str) -> set[str]:
    return {
        cp.words_key(json.loads(line)["messages"][0]["content"])
        for line in (cp.OUT_DIR / name).read_text().splitlines()
    }


def test_held_out_requests_are_never_trained_on():
    assert not requests("smollm2-train.jsonl") & requests("smollm2-heldout.jsonl")


def test_bench_prompts_take_chats_and_render_them_with_the_template(tmp_path):
    path = tmp_path / "p.jsonl"
    chat = [{"role": "user", "content": "Hello?"}]
    path.write_text(json.dumps({"prompt": "def f():"}) + "\n" + json.dumps({"messages": chat}) + "\n")
    prompts = load_prompts(path)
    assert prompts == ["def f():", chat]

    class Templated:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return "<s>" + messages[0]["content"] + "<a>"

    assert render_prompts(prompts, Templated()) == ["def f():", "<s>Hello?<a>"]
    with pytest.raises(ValueError, match="no chat template"):
        render_prompts(prompts, object())


@pytest.mark.parametrize(
    "line, match",
    [
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user"}]}, "non-empty list"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            "ends on an assistant",
        ),
        ({"text": "x"}, 'no "prompt" string or "messages"'),
    ],
)
def test_bad_chat_prompts_are_named(tmp_path, line, match):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=match):
        load_prompts(path)
