"""The memory plan (train/parallel/memory_plan.py) against memory measured in real CPU training steps.

The prediction comes from the target's config alone (meta device); the measurement from a training run of the
same recipe through the real loop: at its second step, the bytes of every live tensor (each storage once) plus
the peak of the bytes allocated and not yet freed during the step (loss, backward, clipping, AdamW step),
counted by a TorchDispatchMode that sees every tensor an op makes and a weak reference that sees its storage
freed. That counts tensors, not the allocator's or the libraries' overhead that RSS would add
(docs/memory.md).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

import selfspec.train.loop.training as loop
from conftest import TOKENIZER_TEXT
from live_bytes import live_tensor_bytes, measuring_step
from selfspec.train.loop.config import load_config
from selfspec.train.parallel.memory_plan import (
    SHIPPED_CONFIGS,
    memory_plan,
    meta_drafter,
    meta_target,
    target_config,
)

TOLERANCE = 0.2


def measured_peak(run, cfg, monkeypatch, step: int = 1) -> tuple[int, dict]:
    """Run the recipe `run(cfg)` and return the tensor bytes at the peak of its training step `step` (0-based:
    the second, when AdamW's states exist), and the run's result. Tensors alive before the run (what earlier
    tests in this process still hold) are not the run's: they are left out."""
    found = {}
    monkeypatch.setattr(loop, "batches_keeping_rng", measuring_step(found, step))
    before = live_tensor_bytes()
    result = run(cfg)
    assert "peak" in found, "the run ended before the measured step"
    return found["peak"] - before, result


@pytest.fixture
def code_text(tmp_path):
    path = tmp_path / "code.txt"
    path.write_text(TOKENIZER_TEXT * 800)
    return path


def common(data, out, **extra) -> list[str]:
    args = {
        "model": "demo",
        "dataset": data,
        "output_dir": out,
        "max_steps": 3,
        "max_minutes": 0,
        "eval_steps": 1000,
        "eval_batches": 1,
        "save_steps": 1000,
        "self_distill": False,
        "max_train_examples": 0,
        "mixed_precision": "bf16",
    } | extra
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


def within(predicted: int, measured: int) -> bool:
    return abs(predicted - measured) <= TOLERANCE * measured


def test_eagle3_plan_matches_the_measured_peak(code_text, tmp_path, monkeypatch):
    """EAGLE-3 on the demo target, 8 rows of 192 tokens in bf16: activations dominate (7 unrolled steps)."""
    from selfspec.train.eagle import run
    from selfspec.train.recipes.eagle import EagleConfig

    cfg = load_config(
        EagleConfig,
        common(
            code_text,
            tmp_path / "out",
            version=3,
            max_length=192,
            per_device_train_batch_size=8,
            depth=3,
            top_k=2,
            total_tokens=6,
        ),
    )
    measured, result = measured_peak(run, cfg, monkeypatch)
    config = target_config(cfg.model)
    plan = memory_plan(cfg, config, "single", 1, [cfg.max_length], foreach=False)
    # the meta-device shapes are the run's
    assert plan.drafter_params == sum(p.numel() for p in result["draft"].parameters())
    assert plan.target_params == sum(p.numel() for p in result["target"].parameters())
    predicted = plan.total(cfg.max_length)
    print(f"EAGLE-3 demo: predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert within(predicted, measured), (predicted, measured)
    # a model that forgot the training-time test's unrolled steps (one step, not 7) is caught
    one_step = memory_plan(
        dataclasses.replace(cfg, ttt_steps=1), config, "single", 1, [cfg.max_length], foreach=False
    )
    assert not within(one_step.total(cfg.max_length), measured)


def test_medusa_plan_matches_the_measured_peak(code_text, tmp_path, monkeypatch):
    """Medusa with its own vocabulary projections on short rows: the drafter's states dominate (the peak is
    AdamW's step), so a plan without AdamW's states is off by more than the tolerance."""
    from selfspec.train.medusa import run
    from selfspec.train.recipes.medusa import MedusaConfig

    cfg = load_config(
        MedusaConfig,
        common(
            code_text,
            tmp_path / "out",
            max_length=64,
            per_device_train_batch_size=2,
            share_lm_head=False,
            tree_nodes=4,
        ),
    )
    measured, result = measured_peak(run, cfg, monkeypatch)
    plan = memory_plan(cfg, target_config(cfg.model), "single", 1, [cfg.max_length], foreach=False)
    assert plan.drafter_params == sum(p.numel() for p in result["heads"].parameters())
    predicted = plan.total(cfg.max_length)
    print(f"Medusa demo: predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert within(predicted, measured), (predicted, measured)
    assert not within(predicted - plan.drafter["adam"], measured)


def test_the_shipped_target_configs_are_the_published_models():
    """Llama-3.1-8B and Llama-3.3-70B built on the meta device have their published parameter counts."""
    counts = {
        name: sum(p.numel() for p in meta_target(target_config(name)).parameters())
        for name in SHIPPED_CONFIGS
    }
    assert counts == {
        "meta-llama/Llama-3.1-8B-Instruct": 8_030_261_248,
        "meta-llama/Llama-3.3-70B-Instruct": 70_553_706_496,
    }


def test_sharding_divides_the_target_and_the_states():
    from selfspec.train.parallel.memory_plan import load_recipe

    cfg = load_recipe("configs/eagle/llama3.1-8b-eagle3.yaml")
    config = target_config(cfg.model)
    whole = memory_plan(cfg, config, "fsdp", 8, [2048])
    sharded = memory_plan(cfg, config, "fsdp", 8, [2048], shard_target=True)
    assert 0 <= whole.target - 2 * whole.target_params < 2**20  # bf16, whole (and the rotary buffers)
    embed_and_head = 2 * 2 * 128256 * 4096  # bf16, untied: they stay whole on every rank
    assert sharded.target == -(-(whole.target - embed_and_head) // 8) + embed_and_head
    assert whole.drafter["adam"] == -(-8 * whole.drafter_params // 8)
    draft = meta_drafter(cfg, meta_target(config))
    assert draft.lm_head.out_features == 32000 and draft.config.feature_layers == [2, 16, 29]
    with pytest.raises(ValueError, match="ZeRO-3 or FSDP2"):
        memory_plan(cfg, config, "ddp", 8, [2048], shard_target=True)


# (launch config, engine, recipe, target sharded): the peak each of 2 gloo processes measures at its second
# step
RANK_RUNS = [
    ("fsdp", "fsdp", "eagle3", True),
    ("deepspeed-zero3", "zero3", "eagle3", True),
    ("fsdp", "fsdp", "medusa", True),
    ("deepspeed-zero3", "zero3", "medusa", True),
    ("deepspeed-zero2", "zero2", "medusa", False),
]


@pytest.mark.parametrize("config, engine, kind, sharded", RANK_RUNS)
def test_the_per_rank_plan_matches_each_ranks_measured_peak(
    config, engine, kind, sharded, code_text, tmp_path
):
    """2 CPU processes under the shipped launch configs, bf16: the plan for one rank against the peak each
    rank measures (tests/helpers/rank_peak.py). EAGLE-3's activations dominate; Medusa's peak is the engine's
    drafter states (sharded weights and AdamW, gathered bf16 weights, gradient buckets)."""
    from distributed_runs import launch
    from selfspec.train.recipes.eagle import EagleConfig
    from selfspec.train.recipes.medusa import MedusaConfig

    if kind == "eagle3":
        cls, extra = (
            EagleConfig,
            dict(version=3, max_length=192, per_device_train_batch_size=8, depth=3, top_k=2, total_tokens=6),
        )
    else:
        cls, extra = (
            MedusaConfig,
            dict(max_length=64, per_device_train_batch_size=2, share_lm_head=False, tree_nodes=4),
        )
    out = tmp_path / "out"
    argv = common(code_text, out, shard_target=sharded, **extra)
    options = {name.removeprefix("--"): value for name, value in zip(argv[::2], argv[1::2])}
    launch(config, "tests/helpers/rank_peak.py", {"kind": kind.rstrip("3")} | options)
    peaks = [json.loads((out / f"peak-rank{r}.json").read_text())["peak"] for r in range(2)]
    cfg = load_config(cls, argv)
    predicted = memory_plan(
        cfg, target_config(cfg.model), engine, 2, [cfg.max_length], shard_target=sharded, foreach=False
    ).total(cfg.max_length)
    print(
        f"{kind} {engine}{' sharded' if sharded else ''}: predicted {predicted / 2**20:.1f} MiB, measured "
        f"{', '.join(f'{p / 2**20:.1f}' for p in peaks)} MiB"
    )
    assert all(within(predicted, p) for p in peaks), (predicted, peaks)
