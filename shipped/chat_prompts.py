"""Chat requests the project owns: user turns of the kinds chat models get, built here without any hub.

Four sources, each written as OpenAI `messages` rows (`{"messages": [...], "kind": ...}`) that
`train/regenerate.py` answers with the target:

- **magpie** — the target itself, given only its template's opening of a user turn (the Magpie recipe:
  `<|im_start|>user\\n`, sometimes followed by a lead word such as "Explain" to spread the kinds), sampled
  at temperature 1 and kept when the turn ends with the end-of-turn token, reads as text and is new;
- **code** — standard-library functions and modules (explain this function, write a function from its
  docstring, review it, write its docstring, what a module is for), the split by file of
  `shipped.stdlib_corpus`: training requests from its train split, held-out ones from its test split;
- **math** — short word problems from templates over names, goods and random numbers;
- **followup** — a second user turn after the first answer ("Can you give an example?"), an empty
  assistant turn in between that regeneration fills (in the held-out set: the target's greedy answer).

Requests are de-duplicated on their lower-cased words; the held-out set never shares a request with the
training set. `python -m selfspec.shipped.chat_prompts --model smollm2` writes both files.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from selfspec.shipped.stdlib_corpus import stdlib_files

OUT_DIR = Path(__file__).resolve().parent / "chat"
LEADS = [
    None,
    None,
    None,
    None,
    "Explain",
    "Write",
    "How do I",
    "What is",
    "Can you help me",
    "Give me",
    "Write a short story",
    "Write a poem",
    "Summarize",
    "What are the benefits of",
    "Compare",
    "Write a Python function",
    "How can I",
    "Describe",
    "Suggest",
    "Why does",
]
CODE_FOLLOWUPS = [
    "Can you add comments to the code?",
    "What are the edge cases?",
    "Can you write a test for it?",
    "How would you make it faster?",
    "Explain it line by line.",
    "Can you rewrite it more simply?",
]
TEXT_FOLLOWUPS = [
    "Can you give an example?",
    "Explain it more simply.",
    "Can you make it shorter?",
    "Why is that?",
    "Can you say more about the first point?",
    "Summarize that in one sentence.",
]

# Word problems: (template, how many numbers it takes). Names, goods and numbers are drawn per problem.
NAMES = [
    "Ana",
    "Ben",
    "Chloe",
    "David",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jamal",
    "Kira",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Priya",
    "Quinn",
    "Rosa",
    "Sam",
    "Tariq",
    "Uma",
    "Victor",
    "Wen",
    "Yara",
    "Zoe",
]
GOODS = [
    "apples",
    "pencils",
    "books",
    "cookies",
    "marbles",
    "stickers",
    "oranges",
    "cupcakes",
    "stamps",
    "cards",
]
MATH = [
    "{a} has {x} {g}. {b} gives {a} {y} more. How many {g} does {a} have now?",
    "{a} buys {x} {g} at ${y} each. How much does {a} spend in total?",
    "A train travels {x} miles in {y} hours. What is its average speed in miles per hour?",
    "{a} had {x} {g} and gave {y} to {b}. Then {a} bought {z} more. How many {g} does {a} have?",
    "{a} reads {x} pages a day. How many days does {a} need to finish a book of {w} pages?",
    "A rectangle is {x} cm long and {y} cm wide. What are its area and its perimeter?",
    "{a} saves ${x} every week. How many weeks until {a} has saved ${w}?",
    "There are {x} students in a class and {y} of them are absent. What percentage of the class is present?",
    "{a} is {x} years old. {b} is {y} years older than {a}. How old will {b} be in {z} years?",
    "A shop sells {g} in packs of {y}. {a} needs {w} {g}. How many packs must {a} buy?",
    (
        "{a} runs {x} km on Monday, {y} km on Tuesday and {z} km on Wednesday. "
        "What is the average distance per day?"
    ),
    "A recipe needs {y} eggs for {x} people. How many eggs are needed for {w} people?",
    "{a} and {b} share {w} {g} in the ratio {x}:{y}. How many does each get?",
    "A shirt costs ${w}. It is on sale for {x}% off. What is the sale price?",
]


def words_key(text: str) -> str:
    """What two requests must differ in: their lower-cased words."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def math_requests(rng: random.Random, n: int) -> list[dict[str, Any]]:
    rows = []
    for _ in range(n):
        template = rng.choice(MATH)
        a, b = rng.sample(NAMES, 2)
        x, y, z = rng.randint(2, 40), rng.randint(2, 25), rng.randint(1, 20)
        w = x * y + rng.randint(0, 3) * y if "{w}" in template else 0
        text = template.format(a=a, b=b, g=rng.choice(GOODS), x=x, y=y, z=z, w=max(w, x + y))
        if rng.random() < 0.3:
            text += rng.choice([" Explain each step.", " Show your work.", " Think step by step."])
        rows.append({"messages": user(text), "kind": "math"})
    return rows


def stdlib_functions(split: str) -> list[tuple[str, str, str, str, str]]:
    """(module, name, signature, docstring's first sentence, source) of short documented stdlib functions."""
    found = []
    for path in stdlib_files(split):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = path.stem if path.stem != "__init__" else path.parent.name
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if not doc or not 4 <= length <= 24:
                continue
            first = doc.strip().split("\n\n")[0].replace("\n", " ")
            if not 20 <= len(first) <= 200:
                continue
            src = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
            found.append((module, node.name, ast.unparse(node.args), first, src))
    return found


def strip_docstring(src: str) -> str:
    tree = ast.parse(src)
    fn = tree.body[0]
    fn.body = fn.body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def code_requests(rng: random.Random, split: str, n: int) -> list[dict[str, Any]]:
    functions = stdlib_functions(split)
    rng.shuffle(functions)
    modules = sorted({f[0] for f in functions})
    rows = []
    for module, name, args, first, src in functions[:n]:
        kind = rng.randrange(5)
        if kind == 0:
            text = f"Explain what this Python function does:\n\n```python\n{src}\n```"
        elif kind == 1:
            goal = first[0].lower() + first[1:]
            text = f"Write a Python function `{name}({args})` that does this: {goal}"
        elif kind == 2:
            text = f"How could this Python code be improved?\n\n```python\n{src}\n```"
        elif kind == 3:
            text = f"Write a docstring for this function:\n\n```python\n{strip_docstring(src)}\n```"
        else:
            text = f"What does `{name}` in Python's `{module}` module do, and when would I use it?"
        rows.append({"messages": user(text), "kind": "code"})
    for module in modules[: max(1, n // 10)]:
        rows.append(
            {
                "messages": user(f"What is Python's `{module}` module for? Show a short example."),
                "kind": "code",
            }
        )
    return rows


def magpie_requests(
    model,
    tokenizer,
    rng: random.Random,
    n: int,
    batch_size: int = 64,
    max_new_tokens: int = 64,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """User turns the target writes itself from its template's opening of a user turn (Magpie), sampled at
    temperature 1; a turn counts when it ends with the end-of-turn token within `max_new_tokens`."""
    import torch

    opening = tokenizer.apply_chat_template(user("\ue000"), tokenize=False).split("\ue000")[0]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    end = end if end is not None else tokenizer.eos_token_id
    rows, seen, tries = [], set(), 0
    torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    while len(rows) < n and tries < 4 * n:
        leads = [rng.choice(LEADS) for _ in range(batch_size)]
        texts = [opening + (lead or "") for lead in leads]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **batch,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new_tokens,
                eos_token_id=end,
                pad_token_id=end,
            )
        tries += batch_size
        for lead, row in zip(leads, out[:, batch["input_ids"].shape[1] :].tolist()):
            if end not in row:
                continue  # cut off: not a whole request
            text = ((lead or "") + tokenizer.decode(row[: row.index(end)], skip_special_tokens=False)).strip()
            key = words_key(text)
            if not 15 <= len(text) <= 600 or "<|" in text or key in seen or len(key.split()) < 4:
                continue
            if sum(c.isascii() for c in text) < 0.95 * len(text):
                continue
            seen.add(key)
            rows.append({"messages": user(text), "kind": "magpie"})
        print(f"magpie: {len(rows)} of {n} requests after {tries} samples", file=sys.stderr, flush=True)
    return rows[:n]


def add_followups(rng: random.Random, rows: list[dict[str, Any]], share: float) -> None:
    """Turn a share of the rows into two-turn chats: an answer slot, then a follow-up user turn."""
    for row in rows:
        if rng.random() < share:
            follow = rng.choice(CODE_FOLLOWUPS if row["kind"] == "code" else TEXT_FOLLOWUPS)
            row["messages"] += [{"role": "assistant", "content": ""}, {"role": "user", "content": follow}]
            row["kind"] += "+followup"


def answer_earlier_turns(model, tokenizer, rows: list[dict[str, Any]], max_new_tokens: int = 128) -> None:
    """Fill each empty assistant turn before a follow-up with the target's greedy answer, so that a held-out
    two-turn chat is a prompt (the benchmarks answer its last user turn)."""
    import torch

    for row in rows:
        messages = row["messages"]
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and not m["content"]:
                text = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
                ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
                with torch.no_grad():
                    out = model.generate(
                        ids,
                        max_new_tokens=max_new_tokens,
                        do_sample=False,
                        pad_token_id=tokenizer.pad_token_id,
                    )
                m["content"] = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def dedupe(rows: list[dict[str, Any]], exclude: set[str] = frozenset()) -> list[dict[str, Any]]:
    kept, seen = [], set(exclude)
    for row in rows:
        key = words_key(row["messages"][0]["content"])
        if key not in seen:
            seen.add(key)
            kept.append(row)
    return kept


def build(
    model_name: str,
    out_dir: Path,
    train_magpie: int,
    train_code: int,
    train_math: int,
    heldout: int,
    seed: int = 0,
) -> tuple[Path, Path]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfspec.shipped.models import resolve_model

    path = resolve_model(model_name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(seed)
    # held-out first, from other seeds and the stdlib's test split, so training can exclude its requests
    share = heldout // 8
    held = (
        magpie_requests(model, tokenizer, random.Random(seed + 1), 3 * share, seed=seed + 1)
        + code_requests(random.Random(seed + 2), "test", 2 * share)[: 2 * share]
        + math_requests(random.Random(seed + 3), heldout - 5 * share)
    )
    held = dedupe(held)
    add_followups(random.Random(seed + 4), held, 0.15)
    answer_earlier_turns(model, tokenizer, held)
    train = (
        magpie_requests(model, tokenizer, rng, train_magpie, seed=seed)
        + code_requests(rng, "train", train_code)
        + math_requests(rng, train_math)
    )
    train = dedupe(train, exclude={words_key(r["messages"][0]["content"]) for r in held})
    add_followups(rng, train, 0.15)
    rng.shuffle(train)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for name, rows in (("train", train), ("heldout", held)):
        file = out_dir / f"{model_name}-{name}.jsonl"
        file.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        kinds = {k: sum(r["kind"] == k for r in rows) for k in sorted({r["kind"] for r in rows})}
        print(f"{file}: {len(rows)} requests {kinds}")
        files.append(file)
    return files[0], files[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m selfspec.shipped.chat_prompts", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="smollm2", help="the target that writes the Magpie requests")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument("--magpie", type=int, default=1100, help="training requests the target writes")
    parser.add_argument("--code", type=int, default=700, help="training requests from stdlib functions")
    parser.add_argument("--math", type=int, default=300, help="training word problems")
    parser.add_argument("--heldout", type=int, default=96, help="held-out requests for the benchmarks")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    build(args.model, args.out_dir, args.magpie, args.code, args.math, args.heldout, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
