"""Keeping the best validation's weights for a method that names a `best_metric` (higher is better): the
weights saved at the end are those of the evaluation where it peaked, not the last step's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file

from selfspec.heads.io import atomic_write

BEST_PATTERN = "best-step-{}.safetensors"  # in output_dir/checkpoints, next to the resumable checkpoints


class BestWeights:
    """The best evaluation so far ({"step", "value", "metrics"}, kept in every checkpoint's state for resume)
    and its weights on disk."""

    def __init__(self, metric: str | None, output_dir: Path, record: dict[str, Any] | None = None) -> None:
        self.metric, self.folder = metric, output_dir / "checkpoints"
        self.record = record

    def resume(self, record: dict[str, Any] | None) -> None:
        """The best evaluation a resumed checkpoint names; its weights must be on disk now, not found missing
        after the training."""
        if record is not None and not self.path(record["step"]).is_file():
            raise FileNotFoundError(
                f"{self.path(record['step'])} (the weights of the best validation, which the "
                "checkpoint resumed names) is missing: copy it from the run's checkpoints/ "
                "folder next to the checkpoint, or train without resuming"
            )
        self.record = record

    def path(self, step: int) -> Path:
        """The weights of the best evaluation at `step`: one file per best step, so that a resume from an
        older checkpoint still finds the best its state names."""
        return self.folder / BEST_PATTERN.format(step)

    def offer(
        self, accelerator: Accelerator, prepared: torch.nn.Module, step: int, metrics: dict[str, float]
    ) -> None:
        """After an evaluation on every rank (the metrics agree across ranks): keep these weights if they are
        the best yet. Gathering them is a collective under ZeRO-3 / FSDP, so every rank calls this."""
        if self.metric is None or self.metric not in metrics:
            return
        if self.record is not None and metrics[self.metric] <= self.record["value"]:
            return
        state = accelerator.get_state_dict(prepared)
        if accelerator.is_main_process:
            tensors = {
                k: v.detach().float().contiguous().cpu() if v.is_floating_point() else v.detach().cpu()
                for k, v in state.items()
            }
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path(step), lambda tmp: save_file(tensors, tmp))
        self.record = {"step": step, "value": metrics[self.metric], "metrics": metrics}
        accelerator.wait_for_everyone()

    def restore(self, module: torch.nn.Module, step: int) -> dict[str, float] | None:
        """Load the best weights into the full module (main process) unless the last step was the best;
        returns the best evaluation's metrics (None without a record)."""
        if self.record is None:
            return None
        if self.record["step"] != step:
            path = self.path(self.record["step"])
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} (the weights of the best validation) is gone: resume from a checkpoint "
                    "that still has it, or train without resuming"
                )
            state = load_file(path, device=str(next(module.parameters()).device))
            module.load_state_dict(
                {k: v.to(module.state_dict()[k].dtype) for k, v in state.items()}, strict=True
            )
            print(
                f"saving the weights of step {self.record['step']}, the best validation "
                f"({self.metric} {self.record['value']:.4f})"
            )
        return self.record["metrics"]

    def prune(self) -> None:
        """Delete the best weights that neither this run nor any kept checkpoint names (main process, after a
        save)."""
        named = {self.record["step"]} if self.record else set()
        for state in self.folder.glob("step-*/trainer_state.json"):
            best = json.loads(state.read_text()).get("best")
            if best:
                named.add(best["step"])
        for path in self.folder.glob(BEST_PATTERN.format("*")):
            if path.name not in {BEST_PATTERN.format(s) for s in named}:
                path.unlink(missing_ok=True)
