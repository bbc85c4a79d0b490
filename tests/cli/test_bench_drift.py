"""The bench reports step time at the start and at the end of long generations (a cache that copies itself
each step shows as late steps slower than early ones)."""

import pytest
import torch

from conftest import VOCAB, tiny_model
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.drafters.proposers import NoDraft
from selfspec.infer.measure.bench import run_bench, speculative_runner, step_drift


def test_step_drift_compares_the_first_and_last_100_steps_of_long_generations():
    growing = {"step_times": [0.001 * (1 + i / 100) for i in range(300)]}  # 1 ms rising to ~4 ms
    short = {"step_times": [1.0] * 150}  # too short to compare: left out
    drift = step_drift([growing, short])
    assert drift["step_ms_first_100"] == pytest.approx(1.495)
    assert drift["step_ms_last_100"] == pytest.approx(3.495)
    assert step_drift([short]) == {}


def test_a_long_bench_run_reports_start_and_end_step_times():
    class Tok:
        def __call__(self, text, return_tensors):
            return type(
                "E",
                (),
                {"input_ids": torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))},
            )

    model = tiny_model("llama")
    runner = speculative_runner(SpeculativeModel(model, NoDraft()), 220, eos=[])
    result = run_bench(model, Tok(), {"plain": runner}, ["p"], warmup=0)
    entry = result["methods"]["plain"]
    assert entry["step_ms_first_100"] > 0 and entry["step_ms_last_100"] > 0
