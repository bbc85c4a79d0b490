"""--mixed_precision auto: bf16 only where bf16 matmuls are fast (a GPU with bf16, a CPU with AMX), float32
elsewhere, said in one line at the start; an explicit bf16 on a slow CPU warns once with the slowdown measured
there; a run cut by its time budget says how far it got."""

import pytest
import torch

import selfspec.train.loop.precision as precision
from conftest import medusa_args
from selfspec.train.loop.config import load_config
from selfspec.train.medusa import run
from selfspec.train.recipes.medusa import MedusaConfig


@pytest.mark.parametrize("amx, expected", [(False, "no"), (True, "bf16")])
def test_auto_takes_bf16_only_on_a_cpu_with_amx(amx, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert precision.resolve_precision("auto") == expected
    assert precision.resolve_precision("bf16") == "bf16" and precision.resolve_precision("no") == "no"
    config = MedusaConfig()
    assert config.mixed_precision == "auto" and config.precision == expected
    assert config.target_dtype == (torch.bfloat16 if amx else torch.float32)
    line = precision.precision_line("auto", expected)
    assert (
        line == f"mixed precision: {'bf16' if amx else 'float32'} (auto: the CPU "
        f"({torch.backends.cpu.get_cpu_capability()}) has {'' if amx else 'no '}AMX bf16 tiles)"
    )


def test_auto_takes_bf16_on_a_gpu_with_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "H100")
    for supported, expected in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda s=supported: s)
        assert precision.resolve_precision("auto") == expected


def test_explicit_bf16_on_a_cpu_without_amx_warns_with_the_measured_cost(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert precision.bf16_slowdown(size=32, repeats=1) > 0  # the probe itself runs
    monkeypatch.setattr(precision, "bf16_slowdown", lambda: 61.7)
    with pytest.warns(
        UserWarning, match=r"a bf16 matmul ran 61.7x slower than float32 here; --mixed_precision auto"
    ):
        assert precision.precision_line("bf16", "bf16") == "mixed precision: bf16 (as asked)"


def test_a_run_cut_by_its_time_budget_says_how_far_it_got(
    tiny_model_dir, text_data, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    args = medusa_args(
        tiny_model_dir, text_data, tmp_path / "heads", max_steps=40, max_minutes=1e-6, mixed_precision="auto"
    )
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    result = run(load_config(MedusaConfig, args))
    err = capsys.readouterr()
    text = err.out + err.err
    assert "mixed precision: float32 (auto: the CPU" in text
    assert "stopping at step 1 of 40 (2%): the 1e-06-minute budget (--max_minutes) is spent" in text
    assert "--resume latest --max_minutes 0" in text and result["history"][-1][0] == 1
