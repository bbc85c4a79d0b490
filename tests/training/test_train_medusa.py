import pytest
import torch
from safetensors.torch import load_file

from conftest import check_resume, medusa_args
from selfspec.heads.registry import load_heads
from selfspec.train.loop.config import ConfigError, load_config
from selfspec.train.medusa import run
from selfspec.train.methods.chunked_loss import labels_ahead
from selfspec.train.methods.medusa import MedusaMethod
from selfspec.train.recipes.medusa import MedusaConfig


def test_labels_ahead_shift():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 1]]).bool()
    labels, ok = labels_ahead(ids, mask, 0)
    assert labels[0, :4].tolist() == [12, 13, 14, 15]
    assert ok[0].tolist() == [True, True, False, True, False, False]
    labels, ok = labels_ahead(ids, mask, 1)
    assert labels[0, :3].tolist() == [13, 14, 15] and ok[0].tolist() == [
        True,
        False,
        True,
        False,
        False,
        False,
    ]
    assert not labels_ahead(ids, mask, 4)[1].any()


_args = medusa_args


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {
            "share_lm_head": True,
            "self_distill": True,
            "max_train_examples": 24,
            "mixed_precision": "bf16",
            "distill_prompt_tokens": 8,
        },
    ],
    ids=["medusa1", "shared-lm-head+self-distill+bf16"],
)
def test_training_lowers_loss_changes_heads_and_freezes_target(
    variant, tiny_model_dir, text_data, tmp_path, monkeypatch
):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "heads"
    result = run(load_config(MedusaConfig, _args(tiny_model_dir, text_data, out, max_steps=12, **variant)))
    history = result["history"]
    assert history[-1][1]["loss"] < history[0][1]["loss"]
    trained = result["heads"].state_dict()
    for name, before in result["initial"].items():
        assert not torch.equal(trained[name].cpu(), before.cpu()), f"{name} did not change"
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    target = result["target"].state_dict()
    assert set(target) == set(original)
    for name, param in target.items():
        # loaded in the run's precision (bf16 for mixed precision), then never touched
        assert torch.equal(param.cpu(), original[name].to(param.dtype)), f"target parameter {name} changed"
    loaded = load_heads(out)
    assert loaded.config.tree and len(loaded.config.tree) == 5
    assert set(loaded.state_dict()) == set(trained)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, trained[name].cpu().to(value.dtype))  # loaded in the config's dtype
    assert len(list((out / "checkpoints").glob("step-*"))) == 2  # save_total_limit


def test_resume_after_interruption_matches_uninterrupted_run(
    tiny_model_dir, text_data, tmp_path, monkeypatch
):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))

    def run_to(out, **extra):
        return run(load_config(MedusaConfig, _args(tiny_model_dir, text_data, out, **extra)))

    check_resume(monkeypatch, MedusaMethod, run_to, tmp_path, "heads")


def test_unknown_and_mistyped_options_are_errors():
    with pytest.raises(ConfigError, match="unknown key.*'num_hedas'.*Valid keys:.*num_heads"):
        load_config(MedusaConfig, ["--num_hedas", "3"])
    with pytest.raises(ConfigError, match="--max_steps expects int"):
        load_config(MedusaConfig, ["--max_steps", "ten"])
    with pytest.raises(ValueError, match="report_to"):
        load_config(MedusaConfig, ["--report_to", "mlflow"])
    cfg = load_config(MedusaConfig, ["--num_heads=3", "--share_lm_head", "--resume", "latest"])
    assert cfg.num_heads == 3 and cfg.share_lm_head is True and cfg.resume == "latest"


@pytest.mark.parametrize(
    "reporter, written",
    [("wandb", "wandb/**/offline-run-*"), ("tensorboard", "heads/**/events.out.tfevents.*")],
)
def test_logging_backends_write_runs_offline(
    reporter, written, tiny_model_dir, text_data, tmp_path, monkeypatch
):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    (tmp_path / "wandb").mkdir()
    out = tmp_path / "heads"
    run(load_config(MedusaConfig, _args(tiny_model_dir, text_data, out, max_steps=2, report_to=reporter)))
    assert list(tmp_path.glob(written))
