"""train/loop/best.py: the weights saved at the end are the best validation's, their files survive what a kept
checkpoint names, and a resume whose best weights are missing fails at its start."""

import json

import pytest
import torch
from accelerate import Accelerator

from selfspec.train.loop.best import BestWeights


def test_the_best_evaluation_is_kept_restored_and_pruned(tmp_path):
    acc = Accelerator(cpu=True)
    module = torch.nn.Linear(3, 2)
    best = BestWeights("sim_accept", tmp_path)
    snapshots = {}
    for step, value in ((0, 1.0), (2, 1.5), (4, 1.2)):  # step 2 is the best
        with torch.no_grad():
            module.weight.fill_(step)
        snapshots[step] = module.weight.clone()
        best.offer(acc, module, step, {"sim_accept": value, "loss": -value})
    assert best.record["step"] == 2 and best.record["value"] == 1.5
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "best-step-0.safetensors",
        "best-step-2.safetensors",
    ]
    (tmp_path / "checkpoints" / "step-1").mkdir()  # a kept checkpoint from before step 2 names step 0
    (tmp_path / "checkpoints" / "step-1" / "trainer_state.json").write_text(json.dumps({"best": {"step": 0}}))
    best.prune()
    assert (tmp_path / "checkpoints" / "best-step-0.safetensors").is_file()
    (tmp_path / "checkpoints" / "step-1" / "trainer_state.json").write_text(json.dumps({"best": None}))
    best.prune()
    assert not (tmp_path / "checkpoints" / "best-step-0.safetensors").exists()
    assert best.restore(module, 4) == {"sim_accept": 1.5, "loss": -1.5}
    assert torch.equal(module.weight, snapshots[2])  # the last step's weights replaced by the best's
    BestWeights(None, tmp_path).offer(acc, module, 6, {"sim_accept": 9.0})  # no metric named: nothing kept


def test_a_resume_whose_best_weights_are_gone_fails_before_training(tmp_path):
    best = BestWeights("sim_accept", tmp_path)
    with pytest.raises(
        FileNotFoundError, match=r"best-step-3.safetensors \(the weights of the best validation"
    ) as e:
        best.resume({"step": 3, "value": 2.0, "metrics": {}})
    assert "\n" not in str(e.value)
    best.resume(None)  # a run that never evaluated
    assert best.record is None
