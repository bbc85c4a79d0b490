"""`python -m selfspec.infer.measure.step_bench` (what `make bench-gpu` runs on a full-size random target):
every family's random drafter decodes token-identically to `generate`, with its step time and launches
reported."""

import json

import pytest

from selfspec.infer.measure import step_bench


def test_every_drafter_is_timed_counted_and_identical_to_generate(tmp_path, capsys):
    out = tmp_path / "steps.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--batch-size", "2"]
    step_bench.main([*argv, "--new-tokens", "6", "--prompt-length", "8", "--json", str(out)])
    runs = json.loads(out.read_text())["runs"]["2"]
    assert runs["generate"]["ms_per_token"] > 0
    assert set(runs) == {"generate", *step_bench.DRAFTERS}
    for name in step_bench.DRAFTERS:
        run = runs[name]
        assert run["identical"], name
        assert run["ms_per_step"] > 0 and run["vs_generate"] > 0, name
        assert 0 < run["launches_per_step"]["outside"] < run["launches_per_step"]["inside"] + 500, name
    assert "output identical: True" in capsys.readouterr().out


def test_a_cuda_device_without_cuda_is_one_line(capsys):
    if step_bench.torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exit:
        step_bench.main(["--shape", "tiny", "--device", "cuda"])
    assert exit.value.code == 2
    assert "sees no CUDA device; use --device cpu" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--batch-size", "--new-tokens", "--prompt-length"])
def test_sizes_below_one_are_one_line(option, capsys):
    with pytest.raises(SystemExit) as exit:
        step_bench.main(["--shape", "tiny", "--device", "cpu", option, "0"])
    assert exit.value.code == 2
    assert f"{option}: must be an integer >= 1, got 0" in capsys.readouterr().err
