"""Training with several processes, as users launch it:
`accelerate launch --config_file configs/accelerate/<x>.yaml`.

Two CPU processes over gloo stand in for two GPUs (DeepSpeed with DS_ACCELERATOR=cpu). Each run trains a
tiny target's drafter for a few steps; the checks are what a user relies on: the same result as one
process with the same global batch, a target that never changes, a drafter that loads in one process and
decodes exactly, and a resumed run that ends where the uninterrupted one does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed_runs import (
    ACCELERATE,
    ROOT,
    assert_decodes_like_target,
    assert_same_weights,
    assert_target_untouched,
    final_state,
    launch,
    run_args,
)


def test_ddp_two_processes_equal_one_with_the_same_global_batch(tiny_model_dir, text_data, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    launch("cpu", "medusa", run_args("medusa", tiny_model_dir, text_data, one, batch=4), processes=1)
    log = launch("cpu-2proc", "medusa", run_args("medusa", tiny_model_dir, text_data, two, batch=2))
    assert "global batch 4 = 2 per device x 2 processes x 1 accumulation" in log
    assert_same_weights(one, two, atol=1e-5)
    m1, m2 = final_state(one)["metrics"], final_state(two)["metrics"]
    for key in ("loss", "head0_top1", "head1_loss"):  # validation split over 2 ranks, reduced = 1 rank's
        assert m1[key] == pytest.approx(m2[key], abs=1e-5), key


def test_medusa2_ddp_two_processes_equal_one(tiny_model_dir, text_data, tmp_path):
    """Medusa-2 under DDP: the LoRA inside the target and the heads train as one process would (the adapted
    lm_head is called outside the wrapped forward, chunk by chunk); ZeRO-3 is refused in one line."""
    medusa2 = {
        "medusa2": "true",
        "share_lm_head": "true",
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "learning_rate": 5e-3,
        "heads_only_steps": 2,
    }  # a heads-only stage: DDP still sees every tensor
    one, two = tmp_path / "one", tmp_path / "two"
    launch(
        "cpu", "medusa", run_args("medusa", tiny_model_dir, text_data, one, batch=4, **medusa2), processes=1
    )
    launch("cpu-2proc", "medusa", run_args("medusa", tiny_model_dir, text_data, two, batch=2, **medusa2))
    assert_same_weights(one, two, atol=1e-5)
    a, b = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (one, two))
    assert a.keys() == b.keys() and any(v.abs().sum() > 0 for n, v in a.items() if "lora_B" in n)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=f"{name} differs")
    saved = load_file(
        two / "checkpoints" / "step-6" / "model.safetensors"
    )  # adapters and heads, no frozen target
    assert saved and all("lora_" in n or n.startswith("heads.") for n in saved)
    log = launch(
        "deepspeed-zero3",
        "medusa",
        run_args("medusa", tiny_model_dir, text_data, tmp_path / "z3", batch=2, **medusa2),
        succeed=False,
    )
    assert "error: Medusa-2 trains a LoRA inside the target" in log


def test_two_processes_share_the_self_distillation(tiny_model_dir, text_data, tmp_path):
    """Each rank regenerates its own shards of the items with its copy of the target (no rank waits while
    another does it all), and the merged result trains."""
    cache = tmp_path / "cache"
    env_args = run_args(
        "medusa",
        tiny_model_dir,
        text_data,
        tmp_path / "out",
        batch=2,
        self_distill="true",
        distill_prompt_tokens=8,
        max_train_examples=24,
        max_steps=2,
        eval_steps=2,
    )
    log = launch("cpu-2proc", "medusa", env_args, env={"SELFSPEC_CACHE": str(cache)})
    assert "step 2:" in log
    records = [json.loads(p.read_text()) for p in cache.glob("tokenized/regen-train-*/regeneration.json")]
    assert len(records) == 1 and records[0]["complete"] and records[0]["rows"] == 24


ENGINES = {"deepspeed-zero2": "DeepSpeed ZeRO-2", "deepspeed-zero3": "DeepSpeed ZeRO-3", "fsdp": "FSDP2"}


@pytest.mark.parametrize("config", ["deepspeed-zero3", "fsdp"])
def test_sharded_training_smoke(config, tiny_model_dir, text_data, tmp_path):
    """The default run's smoke test of the engines that shard the drafter, on EAGLE-3 (its loss calls the
    drafter's lm_head a data-dependent number of times: the case that hangs if ranks disagree). The full
    matrix runs under `slow`."""
    check_sharded_run(config, "eagle3", tiny_model_dir, text_data, tmp_path)


def test_dflash_trains_under_fsdp_and_resumes_exactly(tiny_model_dir, text_data, tmp_path):
    """DFlash on the shared loop under a sharding engine: its random anchors come from the resumed RNG state,
    and its validation drafts a block at every position on each rank."""
    check_sharded_run("fsdp", "dflash", tiny_model_dir, text_data, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "dflash"])
@pytest.mark.parametrize("config", list(ENGINES))
def test_sharded_training(config, kind, tiny_model_dir, text_data, tmp_path):
    check_sharded_run(config, kind, tiny_model_dir, text_data, tmp_path)


def check_sharded_run(config: str, kind: str, model_dir: Path, data: Path, tmp_path: Path) -> None:
    """Loss falls, the target is untouched, the drafter decodes exactly in one process, and resuming from
    the step-2 checkpoint ends with the uninterrupted run's weights."""
    script = {"medusa": "medusa", "dflash": "dflash"}.get(kind, "eagle")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    log = launch(config, script, run_args(kind, model_dir, data, full, batch=2, eval_steps=3))
    assert f"2 processes x 1 accumulation; {ENGINES[config]}" in log
    at_step_0 = json.loads((full / "checkpoints/step-2/trainer_state.json").read_text())[
        "metrics"
    ]  # the last eval
    assert final_state(full)["metrics"]["loss"] < at_step_0["loss"]
    assert_target_untouched(model_dir, full)
    assert_decodes_like_target(model_dir, full)
    shutil.copytree(full / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    for best in (full / "checkpoints").glob(
        "best-step-*.safetensors"
    ):  # DFlash keeps its best validation's weights
        shutil.copy(best, resumed / "checkpoints" / best.name)
    launch(config, script, run_args(kind, model_dir, data, resumed, batch=2, eval_steps=3, resume="latest"))
    assert_same_weights(full, resumed, atol=1e-6)


def test_fsdp_version_1_is_refused_in_one_line_before_training(tiny_model_dir, text_data, tmp_path):
    config = (ROOT / "configs/accelerate/fsdp.yaml").read_text().replace("fsdp_version: 2", "fsdp_version: 1")
    (tmp_path / "fsdp1.yaml").write_text(config)
    log = launch(
        str(tmp_path / "fsdp1.yaml"),
        "medusa",
        run_args("medusa", tiny_model_dir, text_data, tmp_path / "o", 2),
        succeed=False,
    )
    assert "train/medusa.py: error: FSDP version 1 is not supported: set `fsdp_version: 2`" in log
    assert "step 0:" not in log


def test_deepspeed_dropped_by_cpu_is_refused_in_one_line(tiny_model_dir, text_data, tmp_path):
    """`accelerate launch --cpu` with a DeepSpeed config starts one plain process without DeepSpeed; the run
    must not go on as if it had ZeRO-3 on two processes."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        str(ACCELERATE),
        "launch",
        "--config_file",
        "configs/accelerate/deepspeed-zero3.yaml",
        "--num_processes",
        "2",
        "--cpu",
        "train/medusa.py",
    ]
    cmd += [
        x
        for k, v in run_args("medusa", tiny_model_dir, text_data, tmp_path / "o", 2).items()
        for x in (f"--{k}", str(v))
    ]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode != 0
    assert (
        "train/medusa.py: error: accelerate launch --config_file configs/accelerate/deepspeed-zero3.yaml "
        "asks for DeepSpeed, but it is not in effect (--cpu drops that config): "
        "drop --cpu and set DS_ACCELERATOR=cpu"
    ) in log
    assert "step 0:" not in log


@pytest.mark.parametrize(
    "cmdline, env, message",
    [
        (
            [
                "python",
                "/x/bin/accelerate",
                "launch",
                "--config_file",
                "configs/accelerate/fsdp.yaml",
                "--cpu",
                "t.py",
            ],
            {},
            "asks for FSDP, but it is not in effect",
        ),
        (
            [
                "python",
                "/x/bin/accelerate",
                "launch",
                "--config_file",
                "configs/accelerate/cpu-2proc.yaml",
                "t.py",
            ],
            {"WORLD_SIZE": "1"},
            "asks for 2 processes, but 1 is running",
        ),
        (
            ["python", "/x/bin/accelerate", "launch", "--num_processes=3", "t.py"],
            {"WORLD_SIZE": "2"},
            "asks for 3 processes, but 2 is running",
        ),
    ],
)
def test_a_launch_not_in_effect_is_named(cmdline, env, message):
    from selfspec.train.loop.config import ConfigError
    from selfspec.train.parallel.distributed import check_launch_in_effect, launch_request

    with pytest.raises(ConfigError, match=message):
        check_launch_in_effect(launch_request(cmdline, str(ROOT)), env, gpus=0, cores=2)


def test_a_gpu_config_on_a_machine_without_gpus_is_refused_before_it_starts_8_cpu_processes():
    from selfspec.train.loop.config import ConfigError
    from selfspec.train.parallel.distributed import check_launch_in_effect, launch_request

    request = launch_request(
        [
            "python",
            "/x/bin/accelerate",
            "launch",
            "--config_file",
            "configs/accelerate/ddp.yaml",
            "train/medusa.py",
        ],
        str(ROOT),
    )
    with pytest.raises(
        ConfigError,
        match=r"ddp.yaml asks for 8 processes, but this machine has no GPU and 2 CPU "
        r"cores, so they would all share those: launch with configs/accelerate/cpu",
    ):
        check_launch_in_effect(request, {"WORLD_SIZE": "8"}, gpus=0, cores=2)
    check_launch_in_effect(request, {"WORLD_SIZE": "8"}, gpus=8, cores=2)  # where it belongs
    check_launch_in_effect(request, {"WORLD_SIZE": "8"}, gpus=0, cores=64)  # a big CPU machine may run them


def test_a_gpu_config_asking_for_more_gpus_than_the_machine_has_is_one_line():
    """ddp.yaml says 8; on a 2-GPU machine ranks 2..7 each died in accelerate: 'invalid device ordinal'."""
    from selfspec.train.loop.config import ConfigError
    from selfspec.train.parallel.distributed import check_launch_in_effect, launch_request

    ddp = "configs/accelerate/ddp.yaml"
    cmdline = ["python", "/x/bin/accelerate", "launch", "--config_file", ddp, "t.py"]
    request = launch_request(cmdline, str(ROOT))
    env = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}
    with pytest.raises(
        ConfigError,
        match=r"^accelerate launch --config_file configs/accelerate/ddp.yaml starts 8 processes on this "
        r"machine, but it has 2 GPUs \(each process needs its own\): pass --num_processes 2$",
    ):
        check_launch_in_effect(request, env, gpus=2, cores=16)
    check_launch_in_effect(request, env, gpus=8, cores=16)
    two_nodes = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    check_launch_in_effect(request, two_nodes, gpus=8, cores=16)
    on_cpu = launch_request([*cmdline[:3], "--cpu", *cmdline[3:]], str(ROOT))
    check_launch_in_effect(on_cpu, env, gpus=2, cores=16)  # --cpu: processes need no GPU


def test_regeneration_checks_the_launch_before_loading_anything(tmp_path, monkeypatch):
    """train/regenerate.py is launched like training and costs as much: the same launch check, first."""
    import selfspec.train.parallel.distributed as distributed
    import selfspec.train.regeneration.run as regeneration
    from selfspec.train.loop.config import ConfigError
    from selfspec.train.regeneration.config import RegenerateConfig

    def refuse():
        raise ConfigError("refused")

    monkeypatch.setattr(distributed, "check_launch", refuse)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="^refused$"):
        regeneration.run(RegenerateConfig(model="nowhere/model", dataset="none.jsonl", output_dir=str(out)))
    assert not out.exists()


@pytest.mark.parametrize(
    "cmdline, env",
    [
        (
            [
                "python",
                "/x/bin/accelerate",
                "launch",
                "--config_file",
                "configs/accelerate/deepspeed-zero3.yaml",
                "--num_processes",
                "2",
                "t.py",
            ],
            {"ACCELERATE_USE_DEEPSPEED": "true", "WORLD_SIZE": "2"},
        ),
        (
            ["python", "/x/bin/accelerate", "launch", "--config_file", "configs/accelerate/cpu.yaml", "t.py"],
            {},
        ),
        (["python", "-m", "pytest", "-n", "2"], {}),  # not launched by accelerate: nothing to check
    ],
)
def test_a_launch_in_effect_passes(cmdline, env):
    from selfspec.train.parallel.distributed import check_launch_in_effect, launch_request

    check_launch_in_effect(launch_request(cmdline, str(ROOT)), env, gpus=0, cores=2)
