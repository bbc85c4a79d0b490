"""Tree fitting on a busy machine: interleaved repeats, a low quantile, a curve that never falls, a noise
warning."""

from types import SimpleNamespace

import pytest
import torch

import selfspec.infer.measure.tune as tune_module
from conftest import tiny_model
from selfspec.infer.core.generate import GenerationStats
from selfspec.infer.core.tree import fit_tree
from selfspec.infer.measure.bench import forward_latency
from selfspec.infer.measure.tune import LATENCY_SIZES, format_rows, format_tree_rows, tune_eagle

# 4 heads x 4 ranks; on CLEAN the best tree has 24 nodes, just ahead of 32 and 16
ACCURACY = torch.tensor(
    [[0.8, 0.1, 0.04, 0.02], [0.7, 0.12, 0.05, 0.02], [0.6, 0.12, 0.05, 0.02], [0.55, 0.12, 0.05, 0.02]]
)
PREFIX = 8


def clean(n: int) -> float:
    """A GPU-like forward time: 15 ms, and each node adds half a percent."""
    return 0.015 * (1 + 0.005 * n)


class FakeClock:
    """Time that moves only when the model runs: its k-th forward of n tokens (all rows together) takes
    cost(n, k) seconds (k counts from 0 at the first forward after the prefill). Records the token count and
    the row count of every forward."""

    def __init__(self, model: torch.nn.Module, cost) -> None:
        self.now, self.cost, self.sizes, self.rows = 0.0, cost, [], []
        model.register_forward_pre_hook(self.tick, with_kwargs=True)

    def tick(self, module, args, kwargs) -> None:
        n = kwargs["input_ids"].numel()
        self.now += self.cost(n, len(self.sizes) - 1)
        self.sizes.append(n)
        self.rows.append(kwargs["input_ids"].shape[0])

    def __call__(self) -> float:
        return self.now


def latency(cost, repeats: int = 15, batch_size: int = 1):
    model = tiny_model("llama")
    clock = FakeClock(model, cost)
    return forward_latency(
        model, LATENCY_SIZES, prefix_len=PREFIX, repeats=repeats, timer=clock, batch_size=batch_size
    ), clock


def test_sizes_take_turns_round_by_round_after_one_prefill():
    _, clock = latency(lambda n, k: clean(n), repeats=3)
    assert clock.sizes == [PREFIX] + LATENCY_SIZES * 4  # the warm-up round, then 3 timed rounds


def test_a_batch_times_every_row_s_tree_in_one_forward_and_fits_a_smaller_tree():
    curve, clock = latency(lambda n, k: clean(n), repeats=3, batch_size=8)
    assert clock.rows == [8] * (1 + 4 * len(LATENCY_SIZES))  # the prefill and every timed forward: all 8 rows
    assert clock.sizes == [8 * PREFIX] + [8 * n for n in LATENCY_SIZES] * 4
    assert curve.fitted == pytest.approx({n: clean(8 * n) for n in LATENCY_SIZES})
    choices, _ = fit_tree(ACCURACY, curve)
    assert len(choices) + 1 < 24  # each node costs 8 rows' worth: the tree fitted at batch 1 is too wide


def test_the_curve_is_the_clean_one_when_quiet():
    curve, _ = latency(lambda n, k: clean(n))
    assert list(curve) == LATENCY_SIZES
    assert curve.fitted == pytest.approx({n: clean(n) for n in LATENCY_SIZES})
    assert all(s == pytest.approx(0) for s in curve.spread.values())
    choices, rows = fit_tree(ACCURACY, curve)
    assert len(choices) + 1 == 24
    assert "warning" not in format_tree_rows(rows, choices)


ROUND = len(LATENCY_SIZES)  # forwards per round
AT_24 = (
    ROUND + 4 * ROUND + LATENCY_SIZES.index(24)
)  # size 24's forward in the 5th timed round (after the warm-up)


@pytest.mark.parametrize(
    "stalled",
    [
        {AT_24},  # one forward 13x slower: the 197 ms at 24 nodes
        set(
            range(AT_24, AT_24 + 8 * ROUND)
        ),  # a busy spell over 8 of every size's 15 rounds: their median is slow
    ],
    ids=["one forward", "a busy spell"],
)
def test_a_stall_does_not_change_the_curve_or_the_tree(stalled):
    curve, _ = latency(lambda n, k: 0.197 if k in stalled else clean(n))
    assert curve.measured[24] == pytest.approx(clean(24))
    assert curve.fitted == pytest.approx({n: clean(n) for n in LATENCY_SIZES})
    choices, _ = fit_tree(ACCURACY, curve)
    assert choices == fit_tree(ACCURACY, {n: clean(n) for n in LATENCY_SIZES})[0]
    assert len(choices) + 1 == 24


def test_a_size_slow_in_every_round_is_capped_and_lifts_no_other():
    curve, _ = latency(lambda n, k: 0.197 if n == 24 else clean(n))
    assert curve.measured[24] == pytest.approx(0.197)
    assert curve.fitted[24] == pytest.approx(clean(32))  # as fast as the next bigger size measured
    assert {n: t for n, t in curve.fitted.items() if n != 24} == pytest.approx(
        {n: clean(n) for n in LATENCY_SIZES if n != 24}
    )
    choices, rows = fit_tree(ACCURACY, curve)
    assert "24 nodes:  17.40 ms/forward" in format_tree_rows(rows, choices)
    assert "(measured 197.00: a bigger tree was faster)" in format_tree_rows(rows, choices)


def test_a_busy_machine_is_reported_and_a_quiet_one_is_not():
    busy, _ = latency(
        lambda n, k: clean(n) * (1.6 if k // ROUND % 3 else 1.0)
    )  # two rounds in three 1.6x slower
    choices, rows = fit_tree(ACCURACY, busy)
    last = format_tree_rows(rows, choices).splitlines()[-1]
    assert last.startswith("warning: this machine was too busy to trust the fit: at ")
    assert "the median time was 60% above the 20% quantile (trusted up to 25%)" in last
    quiet, _ = latency(lambda n, k: clean(n) * (1.02 if k // ROUND % 3 else 1.0))
    choices, rows = fit_tree(ACCURACY, quiet)
    assert "warning" not in format_tree_rows(rows, choices)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_forward_latency_on_a_real_clock_is_a_non_decreasing_curve(batch_size):
    curve = forward_latency(
        tiny_model("llama"), [1, 4, 8], prefix_len=PREFIX, repeats=3, batch_size=batch_size
    )
    assert list(curve) == [1, 4, 8]
    assert curve[1] <= curve[4] <= curve[8]
    assert all(curve.fitted[n] <= curve.measured[n] for n in curve)


class FakeSpec:
    """Stands in for SpeculativeModel: a decode of `prompt` with setting (depth, top_k, total) makes 4 steps
    of tau TAU[setting], each taking step_time(setting, prompt) seconds; `log` records the decodes in
    order."""

    log: list[tuple[tuple[int, int, int], int]] = []
    rows: list[int] = []
    step_time = None

    def __init__(self, model, setting) -> None:
        self.setting = setting

    def generate(self, ids, max_new_tokens, eos_token_id, do_sample, attention_mask=None):
        assert (
            do_sample is False
        )  # tuning times greedy decoding, whatever the target's generation_config says
        rows = ids.shape[0]
        # a batch of one gets an all-ones mask (no pad id inferred from chat tokens); a padded batch its own
        assert attention_mask is not None and (rows > 1 or bool(attention_mask.all()))
        FakeSpec.rows.append(rows)
        prompt = int(ids[-1, -3])  # the last row is never padded
        FakeSpec.log.append((self.setting, prompt))
        tau = TAU[self.setting]  # per row and step: a forward makes rows x tau tokens
        self.last_stats = GenerationStats(
            decode_steps=4 * rows,
            decode_tokens=4 * tau * rows,
            step_times=[FakeSpec.step_time(self.setting, prompt)] * 4,
        )
        return ids


WIDE, NARROW = (4, 4, 32), (3, 2, 16)
TAU = {WIDE: 3, NARROW: 2}
STEP = {WIDE: 0.010, NARROW: 0.008}  # 300 vs 250 tokens/s: WIDE is faster


def fake_tune(monkeypatch, step_time, batch_size=1):
    monkeypatch.setattr(tune_module, "SpeculativeModel", FakeSpec)
    settings = SimpleNamespace(
        load=lambda name: lambda draft, model, tree, dynamic, **setting: tuple(setting.values())
    )
    monkeypatch.setattr(
        tune_module, "family", lambda kind: settings
    )  # each "proposer" is its (depth, top_k, total)
    monkeypatch.setattr(FakeSpec, "log", [])
    monkeypatch.setattr(FakeSpec, "rows", [])
    monkeypatch.setattr(FakeSpec, "step_time", staticmethod(step_time))
    prompts = [torch.tensor([p, 5, 6]) for p in range(6)]
    draft = SimpleNamespace(config=SimpleNamespace(kind="eagle3"))
    return tune_eagle(
        tiny_model("llama"), draft, prompts, [WIDE, NARROW], max_new_tokens=8, batch_size=batch_size
    )


@pytest.mark.parametrize("batch_size", [4, 8])
def test_every_eagle_batch_has_batch_size_rows_whatever_the_prompt_count(monkeypatch, batch_size):
    fake_tune(monkeypatch, lambda s, p: STEP[s], batch_size=batch_size)  # 6 prompts: 4 + 2, or 6 of 8
    assert FakeSpec.rows and set(FakeSpec.rows) == {batch_size}
    assert len(FakeSpec.rows) == 2 * (1 + -(-6 // batch_size))  # warm-up + the batches, both settings


def test_eagle_settings_take_turns_batch_by_batch_and_count_every_row(monkeypatch):
    best, rows = fake_tune(monkeypatch, lambda s, p: STEP[s], batch_size=2)
    warmup = [(WIDE, 1), (NARROW, 1)]  # each batch is logged by its last prompt: 1, 3, 5
    assert FakeSpec.log == warmup + [(s, p) for p in (1, 3, 5) for s in (WIDE, NARROW)]
    assert [r["tau"] for r in rows] == [3, 2]  # per row and step, as at batch size 1
    assert best["total_tokens"] == 32 and best["tokens_per_s"] == pytest.approx(600)  # 2 rows x 3 / 10 ms


def test_eagle_settings_take_turns_prompt_by_prompt(monkeypatch):
    fake_tune(monkeypatch, lambda s, p: STEP[s])
    warmup = [(WIDE, 0), (NARROW, 0)]
    assert FakeSpec.log == warmup + [(s, p) for p in range(6) for s in (WIDE, NARROW)]


def test_eagle_keeps_the_faster_setting_through_a_stall(monkeypatch):
    best, rows = fake_tune(
        monkeypatch, lambda s, p: STEP[s] * (20 if s == WIDE and p < 4 else 1)
    )  # 4 of 6 prompts
    assert best["total_tokens"] == 32 and best["tokens_per_s"] == pytest.approx(300)
    assert [r["ms_per_step"] for r in rows] == pytest.approx([10, 8])
    assert format_rows(rows, best).splitlines()[-1].startswith("warning: ")  # but the median was disturbed


def test_eagle_reports_a_busy_machine_and_not_a_quiet_one(monkeypatch):
    best, rows = fake_tune(monkeypatch, lambda s, p: STEP[s] * (1.6 if p % 3 else 1.0))
    last = format_rows(rows, best).splitlines()[-1]
    assert last.startswith("warning: this machine was too busy to trust the fit: at depth ")
    best, rows = fake_tune(monkeypatch, lambda s, p: STEP[s] * (1.02 if p % 3 else 1.0))
    assert "warning" not in format_rows(rows, best)
