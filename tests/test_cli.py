import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from infer.cli import main as cli
from train.config import load_config
from train.medusa import MedusaConfig, run


@pytest.fixture
def trained_heads(tiny_model_dir, tmp_path, monkeypatch):
    from conftest import TOKENIZER_TEXT

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data.txt"
    data.write_text(TOKENIZER_TEXT * 30)
    out = tmp_path / "heads"
    args = {"model": tiny_model_dir, "dataset": data, "output_dir": out, "max_length": 32, "max_steps": 4,
            "per_device_train_batch_size": 4, "eval_steps": 4, "num_heads": 3, "max_minutes": 0, "tree_nodes": 8,
            "self_distill": False, "max_train_examples": 0, "mixed_precision": "no"}
    run(load_config(MedusaConfig, [x for k, v in args.items() for x in (f"--{k}", str(v))]))
    return out


def test_generate_json_equals_transformers_greedy(trained_heads, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "gen.json"
    cli(["generate", "--heads", str(trained_heads), "--prompt", "def add(a, b):", "--max-new-tokens", "30",
         "--json", str(out)])
    record = json.loads(out.read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("def add(a, b):", return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1]:].tolist()
    assert record["token_ids"] == ref
    assert record["stats"]["new_tokens"] == len(ref)
    assert record["text"] == tok.decode(ref, skip_special_tokens=True)
    assert record["text"] in capsys.readouterr().out


def test_bench_writes_every_method(trained_heads, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "class Point:"}\n')
    out = tmp_path / "bench.json"
    cli(["bench", "--heads", str(trained_heads), "--prompts", str(prompts), "--max-new-tokens", "12",
         "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["baseline"] == "hf_generate"
    assert set(result["methods"]) == {"hf_generate", "plain", "medusa"}
    for m in result["methods"].values():
        assert m["identical_to_baseline"] is True
        assert {"tokens_per_s", "tau", "target_forwards", "new_tokens"} <= set(m)
    assert "medusa" in capsys.readouterr().out


def test_missing_heads_dir_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no config.json"):
        cli(["generate", "--heads", str(tmp_path / "nope"), "--prompt", "x"])
