"""`selfspec bench --batch-size 1 4 16`: prompts decoded in left-padded batches, every row counted up to its
own EOS (the padding after it is no token), one result and one table block per batch size."""

import json

import pytest
import torch
import transformers

from conftest import VOCAB, tiny_model, tiny_tokenizer
from selfspec.infer.cli.commands import main as cli
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.drafters.proposers import NoDraft
from selfspec.infer.measure.bench import (
    hf_runner,
    left_pad,
    new_rows,
    run_bench,
    speculative_runner,
    top2_margin,
)
from selfspec.infer.measure.bench_report import format_table, format_tables

PAD = 0  # the tiny configs' pad token
PROMPTS = ["def add(a, b):", "x", "class Point:\n    x = 0"]


def test_left_pad_is_the_tokenizers_left_padding():
    tok = tiny_tokenizer()
    rows = [tok(p, return_tensors="pt").input_ids[0] for p in PROMPTS]
    assert len({row.numel() for row in rows}) == 3  # three lengths: two rows are padded
    ids, mask = left_pad(rows, tok.pad_token_id)
    ref = tok(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    assert torch.equal(ids, ref.input_ids) and torch.equal(mask, ref.attention_mask)


def test_new_rows_are_cut_after_each_rows_first_eos():
    out = torch.tensor(
        [
            [9, 9, 5, 2, 0, 0],  # stopped at EOS 2, then padded
            [9, 9, 5, 6, 7, 8],  # ran to the budget
            [9, 9, 2, 2, 2, 2],  # EOS first, padded with the EOS (the pad of a tokenizer that has none)
        ]
    )
    assert new_rows(out, 2, {2}) == [[5, 2], [5, 6, 7, 8], [2]]
    assert new_rows(out, 2, {2, 6}) == [[5, 2], [5, 6], [2]]
    assert new_rows(out, 2, set()) == [[5, 2, 0, 0], [5, 6, 7, 8], [2, 2, 2, 2]]


@pytest.fixture
def batch():
    """A tiny Llama (no EOS in its generation_config), three random prompts of different lengths, and an EOS
    token that stops the first prompt's greedy continuation early and never appears in the second's: a batch
    of them has rows that stop at different steps."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (4, 7, 10)]
    free = [
        hf_runner(model, 12, None, PAD)(p[None], torch.ones(1, p.numel(), dtype=torch.long))[0][0]
        for p in prompts
    ]
    eos = next(
        (row[k] for row in free[:1] for k in range(2, 8) if row[k] not in row[:k] and row[k] not in free[1]),
        None,
    )
    assert eos is not None, free
    return model, prompts, eos


def test_batched_generate_rows_equal_each_prompt_alone_and_pads_are_not_counted(batch):
    model, prompts, eos = batch
    run = hf_runner(model, 12, eos, PAD)
    alone = [run(p[None], torch.ones(1, p.numel(), dtype=torch.long))[0][0] for p in prompts]
    rows, stats = run(*left_pad(prompts, PAD))
    assert rows == alone
    assert rows[0][-1] == eos and len(rows[0]) < 12 and len(rows[1]) == 12  # row 0 was padded after its EOS
    tokens = sum(len(row) - 1 for row in rows)
    assert stats == {
        "target_forwards": len(rows[1]),
        "decode_steps": tokens,
        "decode_tokens": tokens,
    }  # tau 1


def test_speculative_runner_batched_equals_batched_generate(batch):
    """Waits for batched speculative decoding (infer/core/generate.py)."""
    model, prompts, eos = batch
    ids, mask = left_pad(prompts, PAD)
    expected, _ = hf_runner(model, 12, eos, PAD)(ids, mask)
    rows, stats = speculative_runner(SpeculativeModel(model, NoDraft()), 12, eos, PAD)(ids, mask)
    assert rows == expected
    tokens = sum(len(row) - 1 for row in rows)
    assert (stats["decode_steps"], stats["decode_tokens"]) == (tokens, tokens)  # row-steps: one token each
    assert len(stats["step_times"]) == max(map(len, rows)) - 1  # one per batched step


def test_run_bench_feeds_left_padded_batches_in_turns_and_counts_each_row_to_its_eos(batch):
    model, prompts, eos = batch
    text = {str(i): p for i, p in enumerate(prompts)}

    def tokenizer(p, return_tensors):
        return type("Encoding", (), {"input_ids": text[p][None]})

    base = hf_runner(model, 12, eos, PAD)
    calls = []

    def baseline(ids, mask):
        calls.append(("hf", ids.shape[0]))
        return base(ids, mask)

    def rowwise(ids, mask):
        """Each row alone, its padding taken off (the mask must say where it is)."""
        calls.append(("rowwise", ids.shape[0]))
        return [base(row[m.bool()][None], m[m.bool()][None])[0][0] for row, m in zip(ids, mask)], None

    # batches [0, 1] (0 stops at its EOS: padded after it while 1 goes on) and [2]
    result = run_bench(
        model, tokenizer, {"hf": baseline, "rowwise": rowwise}, list(text), batch_size=2, pad_token_id=PAD
    )
    # a warm-up batch, the first batch again with its kernel launches counted, then the batches in turns
    assert calls == [("hf", 2), ("rowwise", 2)] * 3 + [("hf", 1), ("rowwise", 1)]
    assert result["methods"]["hf"]["launches_per_step"]["inside"] > 0
    alone = [base(p[None], None)[0][0] for p in prompts]
    assert alone[0][-1] == eos and len(alone[0]) < len(alone[1]) == 12
    for name in ("hf", "rowwise"):
        m = result["methods"][name]
        assert m["new_tokens"] == sum(map(len, alone)) and m["identical_to_baseline"] is True
    assert result["num_prompts"] == 3 and result["methods"]["hf"]["tau"] == 1.0


def test_a_mismatch_in_a_padded_row_is_measured_on_its_prompt_without_padding():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    base = hf_runner(model, 6, None, PAD)

    def off_in_row_1(ids, mask):
        rows, stats = base(ids, mask)
        rows[1][2] = (rows[1][2] + 1) % VOCAB  # PROMPTS[1], one token long, is the padded row
        return rows, stats

    result = run_bench(
        model, tok, {"hf": base, "off": off_in_row_1}, PROMPTS[:2], warmup=0, batch_size=2, pad_token_id=PAD
    )
    (mismatch,) = result["methods"]["off"]["mismatches"]
    prompt = tok(PROMPTS[1], return_tensors="pt").input_ids
    expected_new = base(prompt, None)[0][0]
    assert len(expected_new) > 2
    margin, tie = top2_margin(model, prompt, expected_new, 2)
    padded = left_pad([tok(p, return_tensors="pt").input_ids[0] for p in PROMPTS[:2]], PAD)[0][1:]
    assert top2_margin(model, padded, expected_new, 2)[0] != margin  # the padding would change it
    assert mismatch == {"prompt": 1, "position": 2, "top2_logit_margin": margin, "near_tie": tie}


def test_ms_per_step_is_per_batched_step_and_tau_per_row_step():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    base = hf_runner(model, 4, None, PAD)
    stats = {
        "target_forwards": 4,
        "decode_steps": 6,
        "decode_tokens": 9,
        "draft_s": 0.3,
        "verify_s": 0.6,
        "bookkeeping_s": 0.0,
        "step_times": [0.3] * 3,
        "accept_lengths": [1, 2],
    }

    def method(ids, mask):
        return base(ids, mask)[0], dict(stats)

    result = run_bench(
        model, tok, {"hf": base, "spec": method}, PROMPTS[:2], warmup=0, batch_size=2, pad_token_id=PAD
    )
    m = result["methods"]["spec"]
    assert m["tau"] == 1.5 and m["target_forwards"] == 4
    assert m["ms_per_step"] == pytest.approx({"draft": 100.0, "verify": 200.0, "bookkeeping": 0.0})


def test_batches_of_several_prompts_need_a_pad_token():
    with pytest.raises(ValueError, match="pass pad_token_id"):
        run_bench(tiny_model("llama"), tiny_tokenizer(), {}, PROMPTS, batch_size=2)


def entry(tps: float) -> dict:
    return {
        "tokens_per_s": tps,
        "speedup": 1.0,
        "median_speedup": 1.0,
        "new_tokens": 8,
        "identical_to_baseline": True,
        "tau": 1.0,
        "target_forwards": 8,
    }


def test_the_table_prints_one_block_per_batch_size():
    one = {
        "baseline": "hf_generate",
        "num_prompts": 4,
        "methods": {"hf_generate": entry(11.0), "plain": entry(12.0)},
    }
    four = {
        "baseline": "hf_generate",
        "num_prompts": 4,
        "methods": {"hf_generate": entry(41.0), "plain": entry(42.0)},
    }
    assert format_tables({1: one}) == format_table(one)  # one batch size: the table as it was
    blocks = format_tables({1: one, 4: four}).split("\n\n")
    assert blocks == [f"batch size 1\n{format_table(one)}", f"batch size 4\n{format_table(four)}"]
    assert "41.0" in blocks[1] and "41.0" not in blocks[0]


def bench_prompts(tmp_path, count: int):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (PROMPTS * 2)[:count]))
    return str(path)


def test_bench_json_of_one_batch_size_keeps_its_schema(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    cli(
        [
            "bench",
            "--model",
            str(tiny_model_dir),
            "--prompt-lookup",
            "--prompts",
            bench_prompts(tmp_path, 2),
            "--max-new-tokens",
            "6",
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert set(result) == {
        "baseline",
        "num_prompts",
        "methods",
        "dtype",
        "max_new_tokens",
        "threads",
        "tree_nodes",
    }
    assert list(result["methods"]) == ["hf_generate", "plain", "hf_prompt_lookup", "prompt_lookup"]
    captured = capsys.readouterr()
    assert "batch size 1\n" not in captured.out and "skipped" not in captured.err


def test_bench_several_batch_sizes(tiny_model_dir, tmp_path, capsys):
    """Waits for batched speculative decoding (infer/core/generate.py)."""
    draft = tmp_path / "tiny-draft"
    tiny_model("gpt2", seed=1).save_pretrained(draft)
    out = tmp_path / "bench.json"
    cli(
        [
            "bench",
            "--model",
            str(tiny_model_dir),
            "--draft-model",
            str(draft),
            "--prompt-lookup",
            "--prompts",
            bench_prompts(tmp_path, 3),
            "--max-new-tokens",
            "8",
            "--batch-size",
            "1",
            "2",
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert set(result) == {"by_batch_size", "dtype", "max_new_tokens", "threads", "tree_nodes"}
    assert list(result["by_batch_size"]) == ["1", "2"]
    for size, run in result["by_batch_size"].items():
        assert set(run) == {"baseline", "num_prompts", "methods"} and run["num_prompts"] == 3, size
        for name, m in run["methods"].items():
            assert m["identical_to_baseline"] is True, (size, name)
    drafters = ["draft_model", "prompt_lookup"]
    assert list(result["by_batch_size"]["1"]["methods"]) == [
        "hf_generate",
        "plain",
        "hf_assisted",
        "hf_prompt_lookup",
        *drafters,
    ]
    assert list(result["by_batch_size"]["2"]["methods"]) == ["hf_generate", "plain", *drafters]
    captured = capsys.readouterr()
    assert "note: hf_assisted and hf_prompt_lookup skipped at batch size 2" in captured.err
    blocks = captured.out.split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == ["batch size 1", "batch size 2"]
    assert "hf_assisted" in blocks[0] and "hf_assisted" not in blocks[1]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--batch-size", "1", "2", "1"], "--batch-size 1 2 1: give each batch size once"),
        (["--batch-size", "4"], "--batch-size 4 is more than the 3 prompts"),
        (["--batch-size", "1", "2", "--plot", "bench.png"], "--plot draws the run of one batch size"),
        (["--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got 0"),
    ],
)
def test_bad_batch_sizes_are_one_line_errors_before_loading(
    extra, message, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    def refuse(*args, **kwargs):
        raise AssertionError("the model's weights were loaded before the check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli(
            [
                "bench",
                "--model",
                str(tiny_model_dir),
                "--prompt-lookup",
                "--prompts",
                bench_prompts(tmp_path, 3),
                *extra,
            ]
        )
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
