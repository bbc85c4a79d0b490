"""Marks for the per-step time split that are right on accelerators too.

On CPU a mark is `time.perf_counter()`. On CUDA a mark is an event recorded in the stream: host time
there says when work was queued, not when it ran, so draft and verify times read from the host would
go to whichever later call waits for the GPU. The loop reads the events after its one host sync per
step, when they have completed: measuring adds no sync.
"""

from __future__ import annotations

import time

import torch

Mark = float | torch.cuda.Event


class Clock:
    """`mark()` now; `seconds(a, b)` between two marks (b must have completed: after a host sync on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events = device.type == "cuda"

    def mark(self) -> Mark:
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record(
                torch.cuda.current_stream(self.device)
            )  # the target's stream, whatever device is current
            return event
        return time.perf_counter()

    def seconds(self, start: Mark, end: Mark) -> float:
        if self.events:
            return start.elapsed_time(end) / 1000.0
        return end - start
