"""The rows of a decoding batch: each row's place in the cache, its budget and whether it stopped, kept on the
host and, for what a step computes with, on the device, always in step with each other.

Row b's tokens sit in cache columns starts[b] .. filled[b] - 1 (its left padding before them). A step writes
every row's tree at one shared column (`tree_column`); each row's accepted path then moves down to its own
end, so rows accept different lengths without any copy of the prefix. The device learns that a row stopped
once, when it stops; otherwise a step sends the device nothing (a copy from the host would wait for it).
"""

from __future__ import annotations

import torch

from selfspec.infer.core.verify import SamplingParams, sample_token

PER_ROW = ("slots", "starts", "budgets", "filled", "produced", "done", "generators", "hiddens")


def cut(new: list[int], budget: int, eos: set[int]) -> tuple[list[int], bool]:
    """A step's new tokens cut where plain decoding would stop (the budget, or an EOS, kept), and whether it
    did."""
    done = len(new) >= budget
    new = new[:budget]
    for i, tok in enumerate(new):
        if tok in eos:
            return new[: i + 1], True
    return new, done


def upload(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values as a tensor on `device`, without waiting for the device: a tensor made from host data
    straight on an accelerator (torch.tensor(..., device=)) waits for all work queued there first; a
    non-blocking copy from pageable host memory is staged at once and does not."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def first_tokens(
    logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Each row's first new token from its prompt's last logits (B, V), as plain decoding chooses it."""
    if params.greedy:
        return logits.argmax(-1)
    return torch.stack([sample_token(row, params, g) for row, g in zip(logits, generators)])


class Rows:
    """Per-row state of one generation. Host lists are indexed by slot (the rows still in the batch, in
    order); `slots[s]` is the caller's row a slot holds, and `emitted` holds every caller row's new tokens."""

    def __init__(
        self,
        starts: list[int],
        budgets: list[int],
        prompt_width: int,
        first: list[int],
        eos: set[int],
        generators: list[torch.Generator | None],
        hiddens: list[torch.Tensor],
        device: torch.device,
    ) -> None:
        count = len(starts)
        self.eos, self.device = eos, device
        self.slots = list(range(count))
        self.starts, self.budgets, self.generators, self.hiddens = (
            list(starts),
            list(budgets),
            generators,
            hiddens,
        )
        self.filled = [
            prompt_width
        ] * count  # cache columns used (padding included); the root is at context[filled]
        self.produced = [1] * count
        self.done = [tok in eos or budget == 1 for tok, budget in zip(first, budgets)]
        self.emitted = [[tok] for tok in first]
        self.start_t = upload(starts, device)
        self.filled_t = torch.full((count,), prompt_width, dtype=torch.long, device=device)
        self._tell_device()

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def finished(self) -> bool:
        return all(self.done)

    def _tell_device(self) -> None:
        self.stopped = list(self.done)  # what the device copy says
        self.stopped_t = upload(self.stopped, self.device, torch.bool)

    def drop_stopped(self) -> tuple[list[int], torch.Tensor]:
        """Remove the rows that stopped; return the slots kept and the same as an index on the device, for the
        caller to select the cache, mask and drafter rows with."""
        keep = [s for s, off in enumerate(self.done) if not off]
        index = upload(keep, self.device)
        for name in PER_ROW:
            values = getattr(self, name)
            setattr(self, name, [values[s] for s in keep])
        self.start_t, self.filled_t = self.start_t[index], self.filled_t[index]
        self._tell_device()
        return keep, index

    def drafting(self, last_tree_at: int | None) -> list[bool]:
        """Which rows draft a tree this step: running, and with room for one before the model's position limit
        (the others verify their root alone, as plain decoding would)."""
        return [
            not off and (last_tree_at is None or f - s <= last_tree_at)
            for off, f, s in zip(self.done, self.filled, self.starts)
        ]

    def tree_column(self) -> int:
        """The column every row's tree is written at this step: past each running row's tokens. A stopped row
        stands there too, so that its leftover writes stay inside the tree block."""
        at = max(f for f, off in zip(self.filled, self.done) if not off)
        self.filled = [at if off else f for f, off in zip(self.filled, self.done)]
        if any(self.stopped):  # (the device's copy: no launch while every row runs)
            self.filled_t = torch.where(self.stopped_t, at, self.filled_t)
        return at

    def positions(self, depths: torch.Tensor) -> torch.Tensor:
        """Each tree node's position id (B, N); a stopped row's padding tree sits at 0, as its place in the
        cache may be past the model's limit."""
        running = (self.filled_t - self.start_t)[:, None] + depths
        return torch.where(self.stopped_t[:, None], depths, running) if any(self.stopped) else running

    def take(self, host: list[list[int]], tree_sizes: list[int]) -> tuple[list[list[int]], list[int], dict]:
        """Each running row's new tokens from the step's host copy (per row: accepted depth, path tokens,
        bonus), cut at its EOS or budget; the accepted lengths (0 for stopped rows) and the step's
        counters."""
        new_rows, lengths = [], []
        counts: dict[str, list[int]] = {"drafted": [], "accepted": [], "made": []}
        for b, values in enumerate(host):
            if self.done[b]:
                lengths.append(0)
                new_rows.append([])
                continue
            length = values[0] + 1
            new, self.done[b] = cut(
                values[2 : 1 + length] + [values[-1]], self.budgets[b] - self.produced[b], self.eos
            )
            lengths.append(length)
            new_rows.append(new)
            self.produced[b] += len(new)
            self.emitted[self.slots[b]].extend(new)
            counts["drafted"].append(tree_sizes[b] - 1)
            counts["accepted"].append(length - 1)
            counts["made"].append(len(new))
        return new_rows, lengths, counts

    def advance(
        self, lengths: list[int], end_depths: torch.Tensor, columns: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Move each row's end past its accepted path; return where the path's columns go (B, W) and which of
        them are kept (the rows that had stopped before this step keep none)."""
        lengths_t = end_depths[:, 0] + 1
        if any(self.stopped):
            lengths_t = lengths_t.masked_fill(self.stopped_t, 0)
        dst = self.filled_t[:, None] + columns
        kept = columns[None] < lengths_t[:, None]
        self.filled = [f + n for f, n in zip(self.filled, lengths)]
        self.filled_t = self.filled_t + lengths_t
        return dst, kept

    def cache_end(self) -> int:
        """The columns the cache must keep: up to the furthest running row (every row's, once all stopped)."""
        return (
            max(f for f, off in zip(self.filled, self.done) if not off)
            if not self.finished
            else max(self.filled)
        )

    def end_step(self) -> None:
        """The device learns which rows stopped in this step (once per row)."""
        if self.done != self.stopped:
            self._tell_device()

    def in_caller_order(self, new_rows: list[list[int]]) -> list[list[int]]:
        """A step's new tokens per caller row, [] for the rows that left the batch."""
        if len(self.slots) == len(self.emitted):
            return new_rows
        by_row: list[list[int]] = [[] for _ in self.emitted]
        for slot, new in zip(self.slots, new_rows):
            by_row[slot] = new
        return by_row
