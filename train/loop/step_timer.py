"""Where a training step's time goes: the frozen target's forward, the drafter's forward + backward, the
optimizer.

The loop times its sections and hands the timer to the method (`method.timer`), which puts `section("target")`
around its target forward. On CPU a section adds wall time as it ends. On CUDA it records a pair of events on
the stream and nothing waits: `seconds()`, called at logging steps and at the end, waits for the recorded
events and reads their elapsed times, so timing never adds a host sync to a step.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch


class StepTimer:
    """Seconds spent per named section, summed since the start."""

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = True) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.enabled = enabled
        self.totals: dict[str, float] = defaultdict(float)
        self.pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: not yet read

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within: nothing is timed (validation and tree fits call the target too, outside any training step,
        which made the target's share exceed the step and the drafter's come out negative)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pending.append((name, start, end))
            return
        began = time.perf_counter()
        yield
        self.totals[name] += time.perf_counter() - began

    def seconds(self) -> dict[str, float]:
        """Each section's total seconds so far (CUDA: waits for the events recorded since the last call)."""
        for name, start, end in self.pending:
            end.synchronize()
            self.totals[name] += start.elapsed_time(end) / 1000
        self.pending.clear()
        return dict(self.totals)


OFF = StepTimer(enabled=False)  # a method's timer until the loop gives it one: times nothing


def step_report(seconds: dict[str, float], steps: int, tokens: int, slots: int, busy: float) -> str:
    """One line: tokens/s, the padding fraction, and the mean step split into target forward, drafter
    forward + backward (the forward and backward sections less the target's part) and optimizer."""
    per = {k: v / max(steps, 1) * 1000 for k, v in seconds.items()}  # ms per optimizer step
    target, both, opt = per.get("target", 0.0), per.get("forward_backward", 0.0), per.get("optimizer", 0.0)
    return (
        f"throughput: {tokens / max(busy, 1e-9):,.0f} tok/s, padding {padding(tokens, slots):.1%}; step time "
        f"{both + opt:.0f} ms: target forward {target:.0f} ms, drafter forward+backward {both - target:.0f} "
        f"ms, optimizer {opt:.0f} ms"
    )


def padding(tokens: int, slots: int) -> float:
    """The fraction of the trained batches' positions (rows x row length) that were padding."""
    return 1 - tokens / slots if slots else 0.0


class Pace:
    """This rank's training throughput: real tokens and positions (padding included) since the start, and the
    seconds spent training (validation and saving paused)."""

    def __init__(self, start: float, first_step: int, device: torch.device) -> None:
        self.start, self.first_step, self.paused_s = start, first_step, 0.0
        self.tokens = torch.zeros(
            (), dtype=torch.long, device=device
        )  # summed on the device: no sync per step
        self.slots = 0

    def count(self, batch: dict[str, torch.Tensor]) -> None:
        self.tokens += batch["attention_mask"].sum()
        self.slots += batch["attention_mask"].numel()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        began = time.time()
        try:
            yield
        finally:
            self.paused_s += time.time() - began

    def training_seconds(self) -> float:
        return time.time() - self.start - self.paused_s
