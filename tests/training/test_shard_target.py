"""The frozen target sharded over the ranks (`--shard_target true`), as users launch it: 2 CPU processes over
gloo stand in for 2 GPUs, under ZeRO-3 (DS_ACCELERATOR=cpu) and FSDP2.

What a user relies on: each rank holds about half of the target (the line it prints, and the bytes behind it),
the drafter trained with the sharded target is the one a replicated target trains, a run killed with -9
resumes to the uninterrupted run's weights, the tree is fitted at the end on every rank in step, and the saved
drafter decodes exactly in one process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import types
from pathlib import Path

import pytest
import torch
from accelerate.utils import DistributedType

from distributed_runs import (
    ACCELERATE,
    ROOT,
    assert_decodes_like_target,
    assert_same_weights,
    free_port,
    launch,
    run_args,
)
from selfspec.train.loop.config import ConfigError
from selfspec.train.parallel.memory_plan import load_recipe, memory_plan, target_config
from selfspec.train.parallel.target_shard import check_shard_target

ENGINES = {"fsdp": "FSDP2", "deepspeed-zero3": "DeepSpeed ZeRO-3"}
LINE = re.compile(
    r"target on this rank: ([\d.]+) MiB of ([\d.]+) MiB \((\d+) of (\d+) bytes; rank (\d) of 2\)"
)


def expected_share(model_dir: Path) -> float:
    """The fraction of the target's bytes a rank of 2 holds: half of the decoder layers and norm, and the
    whole embedding and lm_head (one tensor when tied)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    heads = {
        id(p): p.numel()
        for m in (target.get_input_embeddings(), target.get_output_embeddings())
        for p in m.parameters()
    }
    whole = sum(p.numel() for p in target.parameters())
    return (sum(heads.values()) + (whole - sum(heads.values())) / 2) / whole


def shares(log: str) -> dict[int, float]:
    """Each rank's printed share of the target, checked against its bytes."""
    found = {}
    for mib, whole_mib, local, whole, rank in LINE.findall(log):
        assert (
            abs(float(mib) - int(local) / 2**20) < 0.01 and abs(float(whole_mib) - int(whole) / 2**20) < 0.01
        )
        found[int(rank)] = int(local) / int(whole)
    return found


@pytest.mark.parametrize("config", list(ENGINES))
def test_a_sharded_target_trains_the_replicated_targets_drafter(config, tiny_model_dir, text_data, tmp_path):
    """EAGLE-1 backpropagates through the frozen lm_head every step: the hardest case for a sharded target."""
    replicated, sharded = tmp_path / "replicated", tmp_path / "sharded"
    launch(config, "eagle", run_args("eagle", tiny_model_dir, text_data, replicated, batch=2))
    log = launch(
        config, "eagle", run_args("eagle", tiny_model_dir, text_data, sharded, batch=2, shard_target="true")
    )
    assert f"2 processes x 1 accumulation; {ENGINES[config]}" in log
    found = shares(log)
    assert sorted(found) == [0, 1], log[-2000:]
    for share in found.values():  # ZeRO-3 pads each partition to a multiple of the ranks: a few bytes over
        assert expected_share(tiny_model_dir) - 0.005 < share < expected_share(tiny_model_dir) + 0.02
    assert_same_weights(replicated, sharded, atol=1e-6)
    assert_decodes_like_target(tiny_model_dir, sharded)
    # the memory plan's target share, from the config alone, is what each rank measured
    plan = memory_plan(
        load_recipe(ROOT / "configs/medusa/demo.yaml", ["--mixed_precision", "no"]),
        target_config(str(tiny_model_dir)),
        "zero3" if "deepspeed" in config else "fsdp",
        2,
        [32],
        shard_target=True,
    )
    local = [int(m[2]) for m in LINE.findall(log)]
    assert all(abs(plan.target - b) <= 0.01 * b for b in local), (plan.target, local)


@pytest.mark.parametrize(
    "config, kind", [("fsdp", "eagle3"), ("deepspeed-zero3", "medusa"), ("fsdp", "dflash")]
)
def test_a_sharded_runs_tree_is_fitted_in_step_or_left_to_tune(
    config, kind, tiny_model_dir, text_data, tmp_path
):
    """No fixed tree: Medusa's fit times forwards with the sharded target on both ranks; EAGLE-3's and
    DFlash's would decode prompts (an EAGLE fit of a 30-step run took 14 minutes after 31 s of training), so
    they keep the default tree and say how to fit it."""
    out = tmp_path / "out"
    args = run_args(kind, tiny_model_dir, text_data, out, batch=2, shard_target="true")
    for name in ("depth", "top_k", "total_tokens", "tree_nodes"):
        args.pop(name, None)
    if kind == "medusa":
        args |= {"tree_nodes": 0}
    else:
        args |= {
            "tune_depths": 2,
            "tune_top_ks": 2,
            "tune_totals": 4,
            "tune_prompts": 2,
            "tune_new_tokens": 8,
        }
    log = launch(config, {"eagle3": "eagle"}.get(kind, kind), args)
    if kind == "medusa":  # its fit times a few target forwards: done in step on every rank
        assert "fitted" in log, log[-2000:]
    else:  # a fit decodes prompts, gathering the target at every forward: left to `selfspec tune` on one copy
        assert "the tree is not fitted at the end of this run" in log and "fitted to this machine" not in log
        assert f"selfspec tune --heads {out}" in log
    assert len(shares(log)) == 2
    assert_decodes_like_target(tiny_model_dir, out)


@pytest.mark.parametrize("config", list(ENGINES))
def test_a_sharded_run_killed_with_minus_9_resumes_to_the_uninterrupted_weights(
    config, tiny_model_dir, text_data, tmp_path
):
    full, killed = tmp_path / "full", tmp_path / "killed"
    args = run_args(
        "eagle3", tiny_model_dir, text_data, full, batch=2, shard_target="true", max_steps=40, eval_steps=40
    )
    launch(config, "eagle", args)
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        str(ACCELERATE),
        "launch",
        "--config_file",
        f"configs/accelerate/{config}.yaml",
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        "train/eagle.py",
    ]
    cmd += [x for k, v in (args | {"output_dir": killed}).items() for x in (f"--{k}", str(v))]
    run = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "step-4").is_dir() and run.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    assert not (killed / "model.safetensors").exists(), "the run ended before it was killed"
    launch(config, "eagle", args | {"output_dir": killed, "resume": "latest"})
    assert_same_weights(full, killed, atol=1e-6)


def test_a_sharded_target_under_ddp_is_refused_in_one_line(tiny_model_dir, text_data, tmp_path):
    log = launch(
        "cpu-2proc",
        "medusa",
        run_args("medusa", tiny_model_dir, text_data, tmp_path / "out", batch=2, shard_target="true"),
        succeed=False,
    )
    assert (
        "train/medusa.py: error: --shard_target true needs an engine that shards weights: launch with" in log
    )
    assert "step 0:" not in log and "target on this rank" not in log


def fake_accelerator(engine: str) -> types.SimpleNamespace:
    plugin = types.SimpleNamespace(zero_stage=3) if engine == "zero3" else None
    kind = DistributedType.FSDP if engine == "fsdp" else DistributedType.MULTI_CPU
    return types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=plugin), distributed_type=kind)


@pytest.mark.parametrize("option", ["self_distill", "cache_features", "medusa2"])
@pytest.mark.parametrize("engine", ["zero3", "fsdp"])
def test_what_a_sharded_target_cannot_do_is_refused_before_it_loads(option, engine):
    cfg = types.SimpleNamespace(shard_target=True, **{option: True})
    with pytest.raises(ConfigError, match=f"--{option} true does not work with --shard_target true"):
        check_shard_target(cfg, fake_accelerator(engine))
    check_shard_target(types.SimpleNamespace(shard_target=True), fake_accelerator(engine))  # alone: fine
    with pytest.raises(ConfigError, match="needs an engine that shards weights"):
        check_shard_target(types.SimpleNamespace(shard_target=True), fake_accelerator("ddp"))


def _fsdp2_worker(rank: int, arch: str, port: int, results: dict) -> None:
    """One of 2 ranks: the tiny `arch` target's outputs (every hidden state, and the logits) before and after
    fsdp2_target, and its share of the bytes."""
    import torch.distributed as dist

    from conftest import tiny_model
    from selfspec.train.parallel.target_shard import fsdp2_target, resident_bytes

    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        model = tiny_model(arch).eval()
        ids = torch.tensor([[3, 17, 8, 40, 22, 9, 11], [5, 6, 7, 8, 9, 10, 12]])
        with torch.no_grad():
            want = model.base_model(input_ids=ids, output_hidden_states=True).hidden_states
            want_logits = model(input_ids=ids).logits
            fsdp2_target(model, torch.device("cpu"))
            got = model.base_model(input_ids=ids, output_hidden_states=True).hidden_states
            got_logits = model(input_ids=ids).logits
        local, whole = resident_bytes(model)
        results[rank] = {
            "same": len(got) == len(want)
            and all(torch.equal(a, b) for a, b in zip(got, want))
            and torch.equal(got_logits, want_logits),
            "share": local / whole,
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2", "gemma"])
def test_fsdp2_sharding_keeps_every_architectures_outputs(arch):
    """The hidden states the drafters read (output_hidden_states: FSDP2 renames the model's class, which
    transformers looks its recording hooks up by) and the logits decoding reads, equal before and after."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_fsdp2_worker, args=(arch, free_port(), results), nprocs=2)
        results = dict(results)
    assert sorted(results) == [0, 1]
    for rank in results.values():
        assert rank["same"], f"{arch}: sharded outputs differ"
        assert 0.3 < rank["share"] < 0.8, rank["share"]
