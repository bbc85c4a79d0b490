"""The one interface between the decode loop and a drafter: every call covers the whole batch of rows.

Per generation the loop calls `start` once, `observe` with each row's prompt and first token, then per step
`propose` for the running rows, `observe` with what each row's context grew by (host lists, from the step's
one read) and, when rows stop, `keep_rows`. The families that draft a batch in one set of calls
(Medusa, EAGLE, DFlash, P-EAGLE) implement it directly. A drafter of one sequence at a time (prompt lookup, a
draft model) implements `SequenceDrafter` and is wrapped once by `PerRow`, which gives each row a copy with
its own state. A drafter never calls the target: the loop verifies what it drafts.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import itertools
from typing import Protocol

import torch
from torch import nn

from selfspec.infer.core.rows import upload
from selfspec.infer.core.tree import Tree
from selfspec.infer.core.verify import SamplingParams


@dataclasses.dataclass
class Draft:
    """What a drafter drafts for one row in one step."""

    tokens: torch.Tensor  # (N,) the tree's tokens, root first
    tree: Tree
    # (N, V) the distribution each node's token was sampled from (row 0 unused), for rejection
    # sampling with min(1, p/q); None when tokens were picked deterministically (point proposals)
    probs: torch.Tensor | None = None


class Drafter(abc.ABC):
    """A drafter as the decode loop drives it (see the module docstring). Subclasses set the attributes."""

    name: str
    max_nodes: int  # the largest tree it drafts, root included: sizes the target's cache and mask
    feature_layers: list[int] | None = (
        None  # the target hidden_states it reads (None: the last layer's output)
    )
    holds_state = (
        True  # keeps one generation's state between calls: a second, interleaved generation is refused
    )
    weights_device: torch.device | None = (
        None  # where weights that read the target's features sit (None: none do)
    )

    @abc.abstractmethod
    def start(
        self, rows: int, max_length: int, params: SamplingParams, generators: list[torch.Generator | None]
    ) -> None:
        """A batch of `rows` sequences of at most `max_length` tokens starts, decoded with `params`
        (row b draws from generators[b]): drop the last generation's state."""

    @abc.abstractmethod
    def propose(
        self, active: list[bool], contexts: list[torch.Tensor], hiddens: list[torch.Tensor]
    ) -> list[Draft | None]:
        """Each active row's next tree; None for the others (stopped, or verifying their root alone).

        contexts[b] (L_b,): row b's tokens so far, ending with its root (the target's newest token, not yet in
        its cache); it only ever grows at the end. hiddens[b] (m_b, ·): the target features that produced the
        row's newest m_b tokens (the prompt's at the first call, the accepted path's after that), where they
        came out. An inactive row's features are dropped: the loop makes a row inactive only once it drafts no
        more."""

    def observe(self, new: list[list[int]]) -> None:  # noqa: B027 (optional: most drafters read only `propose`'s)
        """What each row's context grew by, on the host: the prompt and first token, then each step's
        tokens."""

    def keep_rows(self, keep: list[int], index: torch.Tensor) -> None:  # noqa: B027 (optional: stateless drafters)
        """The batch goes on with rows `keep` only, in that order (`index`: the same on the drafter's
        device)."""

    def finish(self) -> None:  # noqa: B027 (optional: drafters whose layers join nothing)
        """The generation ended or was abandoned: let go of what only decoding needs (joined weights,
        heads/joined.py)."""


class SequenceDrafter(Protocol):
    """A drafter of one sequence at a time; `PerRow` makes it a `Drafter`."""

    name: str
    max_nodes: int

    def reset(self, max_length: int, params: SamplingParams, generator: torch.Generator | None) -> None:
        """A new sequence of at most `max_length` tokens starts (decoded with `params`): drop old state."""
        ...

    def propose(self, context: torch.Tensor, hiddens: torch.Tensor) -> Draft:
        """One row's next tree (see `Drafter.propose`)."""
        ...

    def observe(self, new: list[int]) -> None:
        """What the row's context grew by (see `Drafter.observe`)."""
        ...


class PerRow(Drafter):
    """A `SequenceDrafter` driven row by row: each row gets a shallow copy (shared weights and settings, its
    own per-sequence state), made at every `start`, so the copies follow changes to the wrapped drafter."""

    def __init__(self, drafter: SequenceDrafter) -> None:
        self.drafter = drafter
        self.name, self.max_nodes = drafter.name, drafter.max_nodes
        self.rows: list[SequenceDrafter] = []

    def start(
        self, rows: int, max_length: int, params: SamplingParams, generators: list[torch.Generator | None]
    ) -> None:
        self.rows = [self.drafter, *(copy.copy(self.drafter) for _ in range(rows - 1))]
        for row, generator in zip(self.rows, generators):
            row.reset(max_length, params, generator)

    def propose(
        self, active: list[bool], contexts: list[torch.Tensor], hiddens: list[torch.Tensor]
    ) -> list[Draft | None]:
        return [
            row.propose(c, h) if on else None for row, c, h, on in zip(self.rows, contexts, hiddens, active)
        ]

    def observe(self, new: list[list[int]]) -> None:
        for row, tokens in zip(self.rows, new):
            row.observe(tokens)

    def keep_rows(self, keep: list[int], index: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in keep]


def right_padded(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """parts[b] (m_b, ...) stacked and right-padded with zeros to the longest, (B, M, ...) on `device`, in
    launches that do not grow with the batch: a stack when all are as long (a view for one), else one gather
    from every part in a row followed by a zero."""
    counts = [p.shape[0] for p in parts]
    M = max(counts)
    if all(m == M for m in counts):
        return (parts[0][None] if len(parts) == 1 else torch.stack(parts)).to(device)
    starts = list(itertools.accumulate(counts, initial=0))
    index = [[starts[b] + j if j < m else starts[-1] for j in range(M)] for b, m in enumerate(counts)]
    flat = torch.cat(parts).to(device)
    flat = nn.functional.pad(flat, (0, 0) * (flat.dim() - 1) + (0, 1))
    return flat[upload(index, device)]


def newest_features(
    hiddens: list[torch.Tensor], counts: list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Row b's newest counts[b] target features, right-padded with zeros to the longest row: (B, M, ·)."""
    return right_padded([h[:m] for h, m in zip(hiddens, counts)], device).to(dtype)


def newest_pairs(
    contexts: list[torch.Tensor],
    hiddens: list[torch.Tensor],
    counts: list[int],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row b's newest counts[b] target features and the tokens they produced (the confirmed pairs a drafter
    with a cache of its own feeds), right-padded with zeros to the longest row: (B, M, ·) and (B, M)."""
    tokens = right_padded([c[len(c) - m :] for c, m in zip(contexts, counts)], device)
    return newest_features(hiddens, counts, dtype, device), tokens


def as_drafter(drafter: Drafter | SequenceDrafter) -> Drafter:
    """`drafter` as the decode loop drives it: itself, or wrapped by `PerRow` when it drafts one sequence."""
    return drafter if isinstance(drafter, Drafter) else PerRow(drafter)
