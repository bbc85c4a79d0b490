"""Slow: the demo recipes themselves, end to end (about 8 + 14 minutes on 2 cores). Run with
`pytest -m slow`."""

import pytest

from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.measure.bench import default_prompts
from selfspec.shipped.models import resolve_model
from selfspec.train.eagle import run as run_eagle
from selfspec.train.medusa import run as run_medusa
from selfspec.train.recipes.eagle import EagleConfig
from selfspec.train.recipes.medusa import MedusaConfig


def demo_tau(heads_dir) -> float:
    """Tokens per decode-step target forward on 4 demo prompts, in the heads' dtype (bf16), 128 new tokens."""
    from transformers import AutoTokenizer

    spec = SpeculativeModel.from_pretrained(heads_dir)
    tok = AutoTokenizer.from_pretrained(resolve_model("demo"))
    forwards = tokens = 0
    for prompt in default_prompts(4):
        spec.generate(tok(prompt, return_tensors="pt").input_ids, max_new_tokens=128)
        forwards += spec.last_stats.decode_steps
        tokens += spec.last_stats.decode_tokens
    return tokens / forwards


@pytest.mark.slow
def test_demo_recipe_reaches_its_acceptance(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    result = run_medusa(MedusaConfig(output_dir=str(tmp_path / "medusa-demo")))
    assert result["history"][-1][1]["head0_top1"] > 0.5
    assert demo_tau(tmp_path / "medusa-demo") > 2.5  # measured 3.17 on 16 prompts


@pytest.mark.slow
def test_eagle_demo_recipe_reaches_its_acceptance(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    result = run_eagle(EagleConfig(output_dir=str(tmp_path / "eagle-demo")))
    assert result["history"][-1][1]["top1"] > 0.8
    assert demo_tau(tmp_path / "eagle-demo") > 3.5  # measured 4.86 on 16 prompts
