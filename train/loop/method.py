"""The contract between the training loop and a recipe's method: what each side hands the other.

The loop builds nothing of the method's and sets nothing on it. It calls `start(run)` once, after the engine
has wrapped the trainable module (DDP, DeepSpeed, FSDP2), then `loss(batch, step)` per micro-batch and
`evaluate` at validation, and finally `save(module, ...)` with the trained module gathered whole. `MethodBase`
gives the defaults every recipe shares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from selfspec.train.loop.step_timer import OFF, StepTimer


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What the loop prepared for the run: the trainable module as the engine wrapped it (call this one in the
    loss: DDP and DeepSpeed synchronise through it), how ranks agree on per-call counts under ZeRO-3/FSDP
    (None elsewhere; train.distributed.max_over_ranks), and the timer the step's parts are timed with."""

    module: torch.nn.Module
    agree: Callable[[list[int]], list[int]] | None = None
    timer: StepTimer = OFF


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Where the run is: the optimizer step being taken (0-based) of `total_steps` (losses that change over
    the run read it: Medusa-2's heads weight)."""

    step: int = 0
    total_steps: int = 1


FIRST_STEP = StepContext()  # what a loss called outside the loop (a test) is at


class StepOutput(NamedTuple):
    """A micro-batch's loss to backpropagate (its gradient is the objective's) and detached scalars to log
    (read only at logging steps: no sync per step)."""

    loss: torch.Tensor
    logs: dict[str, torch.Tensor]


class Method(Protocol):
    """What a recipe gives the loop."""

    trainable: torch.nn.Module  # what the optimizer trains (before the engine wraps it)
    target: torch.nn.Module  # the frozen target (checked unchanged at the end)
    label: str  # what is saved, for the closing message ("Medusa heads")
    best_metric: (
        str | None
    )  # a validation metric (higher is better) whose best weights are saved; None: the last

    def param_groups(self, lr: float) -> list:
        """The optimizer's parameter groups at learning rate `lr`."""
        ...

    def start(self, run: RunContext) -> None:
        """The run begins (or resumes) with the module as the engine wrapped it."""
        ...

    def loss(self, batch: dict[str, torch.Tensor], step: StepContext = FIRST_STEP) -> StepOutput:
        """The micro-batch's loss and logs at `step`."""
        ...

    def evaluate(self, batches: list[dict[str, torch.Tensor]], total=None) -> dict[str, float]:
        """Metrics over `batches`; every accumulated sum goes through `total` (a sum across ranks) once."""
        ...

    def save(self, module: torch.nn.Module, output_dir: Path, metrics: dict[str, float]) -> None:
        """Write the trained `module` (gathered whole, unwrapped) with what `metrics` says about it."""
        ...


class MethodBase:
    """Defaults of `Method`: every trainable parameter at one learning rate, the last weights kept, and the
    run's context read through `module`, `agree` and `timer` (before `start`: the bare module, no agreement,
    no timing, as a test calling `loss` directly has it)."""

    label = "drafter"
    best_metric: str | None = None
    trainable: torch.nn.Module
    _run: RunContext | None = None

    def param_groups(self, lr: float) -> list:
        return [p for p in self.trainable.parameters() if p.requires_grad]

    def start(self, run: RunContext) -> None:
        self._run = run

    @property
    def module(self) -> torch.nn.Module:
        """The trainable module to call in the loss: as the engine wrapped it once the run started."""
        return self._run.module if self._run is not None else self.trainable

    @property
    def agree(self) -> Callable[[list[int]], list[int]] | None:
        return self._run.agree if self._run is not None else None

    @property
    def timer(self) -> StepTimer:
        return self._run.timer if self._run is not None else OFF
