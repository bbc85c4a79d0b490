"""What a generate call measured: tokens, target forwards, tau, and where the time went."""

from __future__ import annotations

import dataclasses
import time

import torch
from transformers.utils import ModelOutput

from selfspec.infer.core.timing import Clock, Mark


@dataclasses.dataclass
class GenerationStats:
    """Counters of one generate call. tau counts decode steps only (bonus token included)."""

    new_tokens: int = 0
    target_forwards: int = 0  # prefill included
    decode_steps: int = 0
    decode_tokens: int = 0
    accept_lengths: list[int] = dataclasses.field(default_factory=list)  # tokens produced per decode step
    accepted_drafts: list[int] = dataclasses.field(
        default_factory=list
    )  # drafted tokens accepted, before any cut
    drafted: list[int] = dataclasses.field(
        default_factory=list
    )  # tree nodes drafted per step (root excluded)
    step_times: list[float] = dataclasses.field(default_factory=list)  # seconds per decode step
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0

    @property
    def tau(self) -> float:
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["tau"] = self.tau
        return out

    def record_prefill(self, seconds: float, rows: int = 1) -> None:
        """The prompt's forward, which also chose each row's first new token."""
        self.target_forwards += 1
        self.new_tokens = rows
        self.prefill_s = seconds

    def record_step(
        self,
        drafted: list[int],
        accepted: list[int],
        produced: list[int],
        began: float,
        marks: tuple[Mark, Mark, Mark],
        clock: Clock,
    ) -> None:
        """One decode step (one target forward) of the rows still decoding: per row a tree of `drafted` nodes
        (root excluded), `accepted` of them on the accepted path (before the budget/EOS cut), `produced` new
        tokens; each row counts as a decode step of its own, so tau is tokens per row and forward. `began` is
        the step's perf_counter start; `marks` the clock's marks when it began, had proposed, and had
        verified + accepted (completed: read after the step's host sync); the rest of the step, until now, is
        bookkeeping."""
        now = time.perf_counter()
        self.target_forwards += 1
        self.decode_steps += len(produced)
        self.decode_tokens += sum(produced)
        self.new_tokens += sum(produced)
        self.accept_lengths.extend(produced)
        self.accepted_drafts.extend(accepted)
        self.drafted.extend(drafted)
        draft, verify = clock.seconds(marks[0], marks[1]), clock.seconds(marks[1], marks[2])
        self.draft_s += draft
        self.verify_s += verify
        self.bookkeeping_s += max(0.0, now - began - draft - verify)
        self.step_times.append(now - began)


@dataclasses.dataclass
class GenerateOutput(ModelOutput):
    """What `generate(..., return_dict_in_generate=True)` returns: the sequences, as transformers' generate
    output holds them, and the call's decoding statistics. A transformers ModelOutput: `out.sequences`,
    `out["sequences"]`, `out[0]`, `"sequences" in out`, `len(out)` and `sequences, stats = out.to_tuple()` all
    work."""

    sequences: torch.Tensor | None = None
    stats: GenerationStats | None = None
