import pytest
import torch
from safetensors.torch import load_file

import train.eagle as eagle_recipe
from conftest import check_resume, tiny_model
from heads.eagle import EagleDraft
from heads.registry import load_heads
from infer.tune import tune_eagle
from train.config import ConfigError, load_config
from train.eagle import EagleConfig, run


def _args(model_dir, data, out, **extra):
    args = {"model": model_dir, "dataset": data, "output_dir": out, "max_length": 32, "max_steps": 6,
            "per_device_train_batch_size": 4, "eval_steps": 3, "save_steps": 2, "learning_rate": 3e-3,
            "max_minutes": 0, "logging_steps": 1, "self_distill": False, "max_train_examples": 0,
            "mixed_precision": "no", "depth": 3, "top_k": 2, "total_tokens": 6} | extra
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]



@pytest.mark.parametrize("variant", [{}, {"self_distill": True, "max_train_examples": 24, "mixed_precision": "bf16",
                                      "distill_prompt_tokens": 8}], ids=["fp32", "self-distill+bf16"])
def test_training_lowers_loss_changes_the_drafter_only(variant, tiny_model_dir, text_data, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "eagle"
    result = run(load_config(EagleConfig, _args(tiny_model_dir, text_data, out, max_steps=12, **variant)))
    history = result["history"]
    assert history[-1][1]["loss"] < history[0][1]["loss"]
    trained = result["draft"].state_dict()
    assert set(trained) == set(result["initial"])
    unchanged = {name for name, before in result["initial"].items() if torch.equal(trained[name].cpu(), before.cpu())}
    # an RMSNorm gain may legitimately sit still for a few steps; every other parameter must move
    assert all(name.endswith("layernorm.weight") for name in unchanged), unchanged
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    target = result["target"].state_dict()
    assert set(target) == set(original)
    for name, param in target.items():
        assert torch.equal(param.cpu(), original[name].to(param.dtype)), f"target parameter {name} changed"
    loaded = load_heads(out)
    assert isinstance(loaded, EagleDraft)
    assert (loaded.config.depth, loaded.config.top_k, loaded.config.total_tokens) == (3, 2, 6)
    assert not any("embed" in name or "lm_head" in name for name in loaded.state_dict())


def test_cached_features_train_like_online_features(tiny_model_dir, text_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    online = run(load_config(EagleConfig, _args(tiny_model_dir, text_data, tmp_path / "a", noise=0)))
    cached = run(load_config(EagleConfig, _args(tiny_model_dir, text_data, tmp_path / "b", noise=0,
                                                cache_features=True)))
    printed = capsys.readouterr().out
    assert "caching target features for train" in printed and "MiB on disk" in printed
    assert list((tmp_path / "cache").rglob("features-train-*.bin"))
    for name, value in online["draft"].state_dict().items():
        torch.testing.assert_close(cached["draft"].state_dict()[name], value, rtol=1e-4, atol=1e-5)


def test_resume_after_interruption_matches_uninterrupted_run(tiny_model_dir, text_data, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))

    def run_to(out, **extra):
        return run(load_config(EagleConfig, _args(tiny_model_dir, text_data, out, **extra)))

    check_resume(monkeypatch, eagle_recipe.EagleMethod, run_to, tmp_path, "draft")


def test_unknown_options_are_errors():
    with pytest.raises(ConfigError, match="unknown key.*'w_clss'.*Valid keys:.*w_cls"):
        load_config(EagleConfig, ["--w_clss", "0.2"])
    cfg = load_config(EagleConfig, ["--noise", "0.05", "--cache_features"])
    assert cfg.noise == 0.05 and cfg.cache_features is True


def test_training_fits_the_tree_when_none_is_given(tiny_model_dir, text_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    args = _args(tiny_model_dir, text_data, tmp_path / "fit", max_steps=2, depth=0, top_k=0, total_tokens=0,
                 tune_depths="2,3", tune_top_ks=2, tune_totals=4, tune_prompts=2, tune_new_tokens=8)
    run(load_config(EagleConfig, args))
    printed = capsys.readouterr().out
    assert "dynamic tree fitted to this machine" in printed and printed.count("tokens/s") == 2
    chosen = next(line for line in printed.splitlines() if "<- chosen" in line)
    config = load_heads(tmp_path / "fit").config
    assert f"depth {config.depth:2d}  top_k  2  total_tokens   4" in chosen


def test_a_partly_fixed_tree_is_an_error():
    with pytest.raises(ValueError, match="all of depth, top_k and total_tokens"):
        load_config(EagleConfig, ["--depth", "4"])


def test_tune_measures_every_setting_and_keeps_the_fastest():
    model = tiny_model("llama")
    from test_eagle import random_draft

    draft = random_draft(model)
    prompts = [torch.randint(3, 90, (5,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    best, rows = tune_eagle(model, draft, prompts, [(2, 2, 3), (3, 2, 6)], max_new_tokens=12)
    assert [(r["depth"], r["top_k"], r["total_tokens"]) for r in rows] == [(2, 2, 3), (3, 2, 6)]
    assert best is max(rows, key=lambda r: r["tokens_per_s"])
    assert all(r["tau"] >= 1 and r["ms_per_step"] > 0 for r in rows)


def test_eagle3_drafter_starts_with_the_targets_head_rows_of_its_vocabulary():
    model = tiny_model("llama")
    V = model.config.vocab_size
    ids = torch.randint(3, V, (6, 20), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    draft = eagle_recipe.build_drafter(EagleConfig(version=3, draft_vocab_size=V // 4), model, data)
    assert draft.lm_head.weight.shape[0] == V // 4 and not torch.equal(draft.draft_ids, torch.arange(V // 4))
    torch.testing.assert_close(draft.lm_head.weight, model.get_output_embeddings().weight[draft.draft_ids],
                               rtol=0, atol=0)


def test_the_demo_budget_follows_the_version_and_explicit_values_win():
    assert (EagleConfig().max_steps, EagleConfig().max_minutes) == (2400, 10.5)
    assert (EagleConfig(version=3).max_steps, EagleConfig(version=3).max_minutes) == (800, 20.0)
    given = load_config(EagleConfig, ["--version", "3", "--max_steps", "2400", "--max_minutes", "10.5"])
    assert (given.max_steps, given.max_minutes) == (2400, 10.5)
