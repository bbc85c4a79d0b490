"""Two trainings started at the same second on the same data share the self-distillation cache entry: one writes it,
the other waits and reads it; both finish and train on equal data. (They both wrote the same shards, and one died
reading a shard the other's merge had deleted: `Failed to open local file .../regen-train-<key>/shards/00000.arrow`.)"""

import os
import subprocess
import sys

from safetensors.torch import load_file

from conftest import medusa_args


def test_two_runs_on_the_same_data_share_one_regeneration(tiny_model_dir, text_data, tmp_path):
    env = os.environ | {"SELFSPEC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen([sys.executable, "-m", "selfspec.train.medusa",
                              *medusa_args(tiny_model_dir, text_data, tmp_path / f"heads-{i}", max_steps=2,
                                           self_distill=True, max_train_examples=48, distill_prompt_tokens=8)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(2)]
    logs = [run.communicate(timeout=900)[0] for run in runs]
    for run, log in zip(runs, logs):
        assert run.returncode == 0, log[-3000:]
    entries = sorted(p.name for p in (tmp_path / "cache").rglob("regen-train-*") if p.is_dir())
    assert len(entries) == 1, entries  # one entry, written once and read by both
    first, second = (load_file(str(tmp_path / f"heads-{i}" / "model.safetensors")) for i in range(2))
    assert first.keys() == second.keys() and all(first[k].equal(second[k]) for k in first)  # the same data
