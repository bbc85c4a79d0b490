"""Checkpoints never lose work or resume silently wrong: one run per folder, final-checkpoint resume,
damaged files, changed settings, unwritable folders, readable file modes, one-line errors."""

import json
import os
import shutil
import stat

import pytest
import torch

import selfspec.train.medusa as medusa_recipe
from conftest import medusa_args
from selfspec.heads.registry import load_heads
from selfspec.train.loop.checkpoints import check_rng_files, checkpoints
from selfspec.train.loop.config import load_config
from selfspec.train.medusa import run
from selfspec.train.methods.medusa import MedusaMethod
from selfspec.train.recipes.medusa import MedusaConfig

_args = medusa_args


@pytest.fixture
def train_to(tiny_model_dir, text_data, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))

    def train_to(out, **extra):
        return run(load_config(MedusaConfig, _args(tiny_model_dir, text_data, out, **extra)))

    return train_to


def _crash_at_loss_call(monkeypatch, n):
    original = MedusaMethod.loss
    calls = {"n": 0}

    def crashing(self, batch, step):
        calls["n"] += 1
        if calls["n"] == n:
            raise RuntimeError("simulated crash")
        return original(self, batch, step)

    monkeypatch.setattr(MedusaMethod, "loss", crashing)
    return lambda: monkeypatch.setattr(MedusaMethod, "loss", original)


def test_a_new_run_refuses_a_folder_with_another_runs_checkpoints(train_to, tmp_path, monkeypatch):
    out = tmp_path / "heads"
    train_to(out, max_steps=8)  # an older run: checkpoints step-6, step-8
    assert [p.name for p in checkpoints(out)] == ["step-6", "step-8"]
    with pytest.raises(
        ValueError,
        match=r"already holds checkpoints of an earlier run \(step-6, step-8\).*--resume "
        r"latest.*--overwrite_output_dir true",
    ):
        train_to(out, max_steps=4)
    # with --overwrite_output_dir the old checkpoints go first, so rotation never deletes the new run's own;
    # killed after its step-2 checkpoint and resumed, it continues its own weights, not the old run's
    restore = _crash_at_loss_call(monkeypatch, 4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_to(out, max_steps=4, overwrite_output_dir=True)
    restore()
    assert [p.name for p in checkpoints(out)] == ["step-2"]
    resumed = train_to(out, max_steps=4, resume="latest")
    full = train_to(tmp_path / "uninterrupted", max_steps=4)
    for name, value in full["heads"].state_dict().items():
        torch.testing.assert_close(resumed["heads"].state_dict()[name], value, rtol=0, atol=1e-6)
    assert [p.name for p in checkpoints(out)] == ["step-2", "step-4"]


def test_a_new_run_never_overwrites_a_model_or_drafter(train_to, tiny_model_dir, tmp_path):
    before = {p.name: p.read_bytes() for p in tiny_model_dir.iterdir() if p.is_file()}
    with pytest.raises(ValueError, match="holds the target model .*: saving there could overwrite it"):
        train_to(tiny_model_dir, overwrite_output_dir=True)
    with pytest.raises(
        ValueError, match="holds the target model"
    ):  # Medusa-2 replaces target/ or adapter/ in it
        train_to(tiny_model_dir.parent, overwrite_output_dir=True)
    assert {p.name: p.read_bytes() for p in tiny_model_dir.iterdir() if p.is_file()} == before
    out = tmp_path / "heads"
    train_to(out, max_steps=2)
    shutil.rmtree(out / "checkpoints")  # a finished drafter, its checkpoints cleaned up
    weights = (out / "model.safetensors").read_bytes()
    with pytest.raises(
        ValueError,
        match=r"already holds a saved model's or drafter's files \(README.md, config.json, "
        r"model.safetensors\): choose another --output_dir, or replace them with "
        r"--overwrite_output_dir",
    ):
        train_to(out, max_steps=2, seed=1)
    assert (out / "model.safetensors").read_bytes() == weights
    train_to(out, max_steps=2, seed=1, overwrite_output_dir=True)
    assert (out / "model.safetensors").read_bytes() != weights


def test_resume_from_the_final_checkpoint_keeps_the_tree_and_the_metrics(train_to, tmp_path):
    out = tmp_path / "heads"
    train_to(out)
    before = json.loads((out / "config.json").read_text())
    card = (out / "README.md").read_text()
    assert before["tree"] and len(before["tree"]) == 5
    result = train_to(out, resume="latest")  # nothing left to train: the run only saves again
    after = json.loads((out / "config.json").read_text())
    assert after["tree"] == before["tree"]
    assert (out / "README.md").read_text() == card and "| 0 | 0.000 | 0.000 |" not in card
    assert result["history"] and result["history"][-1][0] == 6


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(train_to, tmp_path, capsys):
    out = tmp_path / "heads"
    train_to(out)
    weights = out / "checkpoints/step-6/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10:] = b"\x00" * 10
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"--resume .*step-6: .*model.safetensors is damaged"):
        train_to(out, resume=str(out / "checkpoints/step-6"))  # a named checkpoint must be intact
    capsys.readouterr()
    result = train_to(out, resume="latest")
    err = capsys.readouterr().err
    assert f"skipping checkpoint step-6: {weights} is damaged" in err
    assert result["history"][0][0] == 4  # resumed from step-4 and trained on to step 6


def test_resume_refuses_changed_settings_unless_allowed(train_to, tmp_path, capsys):
    out = tmp_path / "heads"
    train_to(out, max_steps=4)
    with pytest.raises(
        ValueError, match="per_device_train_batch_size was 4, now 2.*--resume_allow_changes true"
    ):
        train_to(out, max_steps=6, resume="latest", per_device_train_batch_size=2)
    for allow in (False, True):  # other tensor shapes cannot be loaded: refused even when changes are allowed
        with pytest.raises(
            ValueError,
            match=r"--resume .*step-4: num_heads was 2, now 3, which changes the drafter's "
            r"tensors",
        ):  # named, not as the shapes' digest
            train_to(out, max_steps=6, resume="latest", num_heads=3, resume_allow_changes=allow)
    with pytest.raises(ValueError, match="learning_rate was 0.01, now 0.001"):
        train_to(out, max_steps=6, resume="latest", learning_rate=1e-3)
    train_to(out, max_steps=6, resume="latest", per_device_train_batch_size=2, resume_allow_changes=True)
    err = capsys.readouterr().err
    assert "per_device_train_batch_size was 4, now 2 (--resume_allow_changes)" in err
    assert (
        "resuming a run of 4 steps as one of 6: the learning-rate schedule" in err
    )  # a longer run is allowed


def test_a_damaged_random_state_is_an_error_not_a_different_stream(train_to, tmp_path):
    out = tmp_path / "heads"
    train_to(out, max_steps=2)
    checkpoint = out / "checkpoints/step-2"
    (checkpoint / "manifest.json").unlink()  # as a checkpoint written before checksums existed
    (checkpoint / "random_states_0.pkl").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match=r"cannot read the random state .*random_states_0.pkl"):
        check_rng_files(checkpoint, 0)
    with pytest.raises(ValueError, match=r"random_states_0.pkl"):
        train_to(out, max_steps=4, resume="latest")


def test_an_unwritable_output_dir_fails_before_any_work(train_to, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(
        medusa_recipe,
        "load_training_target",
        lambda *a, **k: pytest.fail("the target was loaded before the output folder was checked"),
    )
    with pytest.raises(ValueError, match=r"--output_dir .*a-file/heads cannot be written"):
        train_to(blocker / "heads")


def test_written_files_are_readable_by_others(train_to, tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "heads"
        train_to(out, max_steps=2)
    finally:
        os.umask(old)
    written = [p for p in out.rglob("*") if p.is_file()]
    assert {p.name for p in written} >= {
        "config.json",
        "model.safetensors",
        "README.md",
        "training_args.json",
        "trainer_state.json",
        "manifest.json",
    }
    modes = {p.relative_to(out).as_posix(): oct(stat.S_IMODE(p.stat().st_mode)) for p in written}
    assert set(modes.values()) == {"0o644"}, modes
    assert load_heads(out).config.tree


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_steps", "0"], "--max_steps must be > 0, or -1 to train num_epochs epochs; got 0"),
        (["--learning_rate", "nan"], "--learning_rate must be a finite number, got nan"),
        (["--per_device_train_batch_size", "-1"], "--per_device_train_batch_size must be >= 1, got -1"),
        (["--num_heads", "0"], "--num_heads must be >= 1, got 0"),
        (["--max_train_examples", "-1"], "--max_train_examples must be >= 0, got -1"),
        (["--nmu_heads", "2"], "unknown key(s) 'nmu_heads' in the command line"),
        (["--config", "missing.yaml"], "config file missing.yaml does not exist"),
    ],
)
def test_training_user_errors_end_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        medusa_recipe.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"train/medusa.py: error: {message}" + err[len(f"train/medusa.py: error: {message}") :]
    assert err.count("\n") == 1 and "Traceback" not in err


def test_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="max_steps"):
        medusa_recipe.main(["--max_steps", "0", "--debug"])


@pytest.mark.parametrize("script", ["train/medusa.py", "train/eagle.py", "train/target.py"])
def test_help_lists_every_option_with_default_and_meaning(script, capsys):
    import dataclasses
    import importlib

    module = importlib.import_module("selfspec." + script.removesuffix(".py").replace("/", "."))
    cls = {
        "train/medusa.py": "MedusaConfig",
        "train/eagle.py": "EagleConfig",
        "train/target.py": "TargetConfig",
    }
    config = getattr(module, cls[script])
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for f in dataclasses.fields(config):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        row = next((line for line in lines if line.split()[:2] == [f"--{f.name}", shown]), None)
        assert row is not None, f"--{f.name} {shown} missing from --help"
        assert len(row.split()) > 3, f"--{f.name} has no meaning in --help: {row!r}"


def test_resume_without_a_checkpoint_fails_before_the_data_is_prepared(
    tiny_model_dir, text_data, tmp_path, monkeypatch
):
    """Self-distillation can take an hour: --resume latest with nothing to resume failed only after it."""
    import selfspec.train.data.run_data as run_data
    from selfspec.train.loop.config import load_config
    from selfspec.train.medusa import run as run_medusa
    from selfspec.train.recipes.medusa import MedusaConfig

    def refuse(*args, **kwargs):
        raise AssertionError("the data was prepared before --resume was checked")

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(run_data, "regenerate_with_model", refuse)
    for resume, message in (
        ("latest", "--resume latest: no checkpoint under"),
        (str(tmp_path / "nowhere"), "not a complete checkpoint"),
    ):
        args = medusa_args(
            tiny_model_dir,
            text_data,
            tmp_path / "heads",
            self_distill=True,
            resume=resume,
            distill_prompt_tokens=8,
        )
        with pytest.raises(FileNotFoundError, match=message):
            run_medusa(load_config(MedusaConfig, args))
