"""Training runs started the way users start them, `accelerate launch` with two CPU processes over gloo, and
the checks on what a run leaves: its weights, its state, a drafter that decodes like the target, a target
that never changed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from recipe_args import short_run

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = Path(sys.executable).with_name("accelerate")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    config: str, script: str, args: dict, processes: int = 2, succeed: bool = True, env: dict | None = None
) -> str:
    """Run `accelerate launch --config_file <config> train/<script>.py` with `args` (a name means
    configs/accelerate/<name>.yaml; a script ending in .py is a path from the repository root); returns its
    output, failing the test with the output's tail when it fails (or, with succeed=False, when it does
    not)."""
    env = (
        os.environ
        | {
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "TOKENIZERS_PARALLELISM": "false",
        }
        | (env or {})
    )
    path = config if config.endswith(".yaml") else f"configs/accelerate/{config}.yaml"
    cmd = [
        str(ACCELERATE),
        "launch",
        "--config_file",
        path,
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(free_port()),
        script if script.endswith(".py") else f"train/{script}.py",
    ]
    cmd += [x for k, v in args.items() for x in (f"--{k}", str(v))]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert (out.returncode == 0) == succeed, f"{' '.join(cmd)} exited {out.returncode}:\n{text[-4000:]}"
    return text


def run_args(kind: str, model_dir: Path, data: Path, out: Path, batch: int, **extra) -> dict:
    """A seconds-long run on the tiny target; `batch` per device."""
    args = short_run(
        model_dir,
        data,
        out,
        per_device_train_batch_size=batch,
        eval_steps=6,
        save_total_limit=0,
        learning_rate=1e-2,
        self_distill="false",
        eval_batches=4,
        per_device_eval_batch_size=2,
    )
    if kind == "medusa":
        args |= {"num_heads": 2, "tree_nodes": 5, "share_lm_head": "false"}
    elif kind == "dflash":
        args |= {"depth": 3, "top_k": 2, "total_tokens": 6, "block_size": 4, "anchors": 8, "num_layers": 1}
    else:
        args |= {"depth": 3, "top_k": 2, "total_tokens": 6, "noise": 0.0}
        if kind == "eagle3":
            args |= {"version": 3, "ttt_steps": 3, "draft_vocab_size": 48}
    return args | extra


def final_state(out: Path) -> dict:
    return json.loads(
        sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))[-1]
        .joinpath("trainer_state.json")
        .read_text()
    )


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def assert_same_weights(a: Path, b: Path, atol: float) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=atol, msg=f"{name} differs")


def assert_decodes_like_target(model_dir: Path, heads: Path) -> None:
    """The saved drafter loads in this (single) process and greedy decoding equals the target's own."""
    from transformers import AutoModelForCausalLM

    from selfspec.infer.core.generate import SpeculativeModel

    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    spec = SpeculativeModel.from_pretrained(heads, model=target)
    prompt = torch.tensor([[1, 5, 9, 13, 7]])
    want = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)  # both stop at EOS
    got = spec.generate(prompt, max_new_tokens=24)
    assert got.tolist() == want.tolist()


def assert_target_untouched(model_dir: Path, out: Path) -> None:
    """The run recorded the target's weights fingerprint at its start, equal to the weights on disk; the loop
    itself fails the run if they changed by the end."""
    from transformers import AutoModelForCausalLM

    from selfspec.train.data.fingerprints import weights_fingerprint

    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert final_state(out)["fingerprint"]["target_weights"] == weights_fingerprint(target)
