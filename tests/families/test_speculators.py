"""Loaded by vllm-project/speculators' own loader: our speculators-eagle3 export drafts what ours drafts.

speculators 0.9.0 runs in its own virtual environment under ~/.cache/selfspec (built on first use, about two
minutes; override with SELFSPEC_SPECULATORS_VENV), torch pinned to 2.13.0 so pip keeps the CPU build. Its
`Eagle3DraftModel` lists embed_tokens.weight among the keys it may find missing, so an export without the
target's embedding loads without a word and drafts from an uninitialised one: the logits of every
training-time step are compared, in float32, with our drafter's on the same target features and tokens.
"""

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from peer_envs import peer_python
from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.formats import export_heads
from selfspec.shipped.models import resolve_model

SPECULATORS = "speculators==0.9.0"
STEPS = 3
FEATURE_LAYERS = [1, 4, 6]  # hidden_states indices of the demo's 8 layers, not the default (2, 4, 5)


def random_eagle3(target, draft_vocab: int) -> Eagle3Draft:
    c = target.config
    torch.manual_seed(0)
    draft = Eagle3Draft(
        HeadsConfig(
            kind="eagle3",
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            layer=layer_fields(c),
            feature_layers=FEATURE_LAYERS,
            draft_vocab_size=draft_vocab,
            depth=STEPS,
            top_k=2,
            total_tokens=6,
            base_model=resolve_model("demo"),
        )
    )
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.05)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(1)  # norms near one, as trained ones are: the draft layer's output stays in range
    draft.set_draft_vocab(
        torch.randperm(c.vocab_size, generator=torch.Generator().manual_seed(0))[:draft_vocab]
    )
    return draft.eval()


def test_speculators_loads_our_export_and_drafts_our_logits(tmp_path):
    python = peer_python(SPECULATORS, "SELFSPEC_SPECULATORS_VENV", torch_pin="torch==2.13.0")
    target = AutoModelForCausalLM.from_pretrained(resolve_model("demo"), dtype=torch.float32).eval()
    draft = random_eagle3(target, 1024)
    with pytest.warns(UserWarning, match="a path on this machine"):  # demo has no Hub id
        export_heads(draft, "speculators-eagle3", tmp_path / "export", target)

    ids = torch.randint(3, target.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in FEATURE_LAYERS], -1)  # (1, T, 3H)
        next_ids = torch.roll(ids, -1, 1)  # x_{t+1} at t; the last column is never compared
        ours = [
            draft.logits(o)[0]
            for o in draft.unrolled(
                features, next_ids, target.get_input_embeddings(), torch.ones_like(ids), STEPS
            )
        ]
    save_file(
        {"features": features.contiguous(), "input_ids": next_ids.contiguous()},
        tmp_path / "inputs.safetensors",
    )
    script = Path(__file__).parents[1] / "helpers" / "speculators_draft.py"
    done = subprocess.run(
        [
            str(python),
            str(script),
            str(tmp_path / "export"),
            str(tmp_path / "inputs.safetensors"),
            str(tmp_path / "theirs.safetensors"),
            str(STEPS),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = load_file(tmp_path / "theirs.safetensors")
    assert torch.equal(
        theirs["embed_tokens"], target.get_input_embeddings().weight
    )  # the target's, not a random one
    for step in range(STEPS):
        width = ids.shape[1] - 1 - step  # positions whose step-`step` token is a real one
        a, b = ours[step][:width], theirs[f"step{step}"][:width]
        assert (a - b).abs().max() < 1e-4, step
        assert torch.equal(a.argmax(-1), b.argmax(-1)), step
