"""Two trainings started at the same second on the same data share the self-distillation cache entry: one
writes it, the other waits and reads it; both finish and train on equal data. (They both wrote the same
shards, and one died reading a shard the other's merge had deleted:
`Failed to open local file .../regen-train-<key>/shards/00000.arrow`.)"""

import os
import re
import subprocess
import sys

from conftest import medusa_args


def test_two_runs_on_the_same_data_share_one_regeneration(tiny_model_dir, text_data, tmp_path):
    env = os.environ | {"SELFSPEC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "selfspec.train.medusa",
                *medusa_args(
                    tiny_model_dir,
                    text_data,
                    tmp_path / f"heads-{i}",
                    max_steps=2,
                    self_distill=True,
                    max_train_examples=48,
                    distill_prompt_tokens=8,
                ),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [run.communicate(timeout=900)[0] for run in runs]
    for run, log in zip(runs, logs):
        assert run.returncode == 0, log[-3000:]
    entries = sorted(p.name for p in (tmp_path / "cache").rglob("regen-train-*") if p.is_dir())
    assert len(entries) == 1, entries  # one entry
    # written by one run and read by the other: without the lock both regenerated it into the same folder
    assert sum("already holds this regeneration, complete" in log for log in logs) == 1, logs
    trained = [re.search(r"training [\d.]+ M parameters for \d+ steps \((\d+) examples", log) for log in logs]
    assert all(trained) and trained[0].group(1) == trained[1].group(1)  # on equal data
