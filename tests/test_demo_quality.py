"""Slow: the demo recipes themselves, end to end (about 8 + 14 minutes on 2 cores). Run with `pytest -m slow`."""

import pytest

from heads.demo import resolve_model
from infer.bench import default_prompts
from infer.generate import SpeculativeModel
from train.medusa import MedusaConfig, run


@pytest.mark.slow
def test_demo_recipe_reaches_its_acceptance(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "medusa-demo"
    result = run(MedusaConfig(output_dir=str(out)))
    assert result["history"][-1][1]["head0_top1"] > 0.5
    spec = SpeculativeModel.from_pretrained(out)  # the demo target in the heads' dtype (bf16)
    tok = AutoTokenizer.from_pretrained(resolve_model("demo"))
    forwards = tokens = 0
    for prompt in default_prompts(4):
        spec.generate(tok(prompt, return_tensors="pt").input_ids, max_new_tokens=128)
        forwards += spec.last_stats.decode_steps
        tokens += spec.last_stats.decode_tokens
    assert tokens / forwards > 2.5  # measured 3.17 on 16 prompts


@pytest.mark.slow
def test_eagle_demo_recipe_reaches_its_acceptance(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from train.eagle import EagleConfig
    from train.eagle import run as run_eagle

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "eagle-demo"
    result = run_eagle(EagleConfig(output_dir=str(out)))
    assert result["history"][-1][1]["top1"] > 0.8
    spec = SpeculativeModel.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(resolve_model("demo"))
    forwards = tokens = 0
    for prompt in default_prompts(4):
        spec.generate(tok(prompt, return_tensors="pt").input_ids, max_new_tokens=128)
        forwards += spec.last_stats.decode_steps
        tokens += spec.last_stats.decode_tokens
    assert tokens / forwards > 3.5
