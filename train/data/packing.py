"""Packing: several examples in one row of at most max_length tokens, attention never crossing their
boundaries.

A packed row holds examples back to back, with the padding of the batch after the last one:

    input_ids     [a0 a1 a2 b0 b1 c0 c1 c2 c3  -  -]
    position_ids  [ 0  1  2  0  1  0  1  2  3  0  1]    restart per example (the padding too)
    seq_ids       [ 0  0  0  1  1  2  2  2  2 -1 -1]    the example of each token; -1: padding

The target runs with those position_ids and no 2D mask: transformers then builds the block-diagonal causal
mask itself (sdpa, eager, flex; masking_utils.find_packed_sequence_indices) or attends varlen (flash
attention), exactly as if each example ran alone (tests/training/test_packing.py checks every tested
architecture; `check_packed_target` checks the run's own target once). The drafters attend through
`block_causal_mask` of the same seq_ids, and no label is taken from another example (`reaches`). An unpacked
batch is the case of one example per row: every helper here reads it too (its seq_ids are 0 on tokens, -1 on
padding).
"""

from __future__ import annotations

import numpy as np
import torch

from selfspec.train.data.examples import Examples


def pack_rows(lengths: np.ndarray, max_length: int, seed: int) -> list[list[int]]:
    """Greedy best fit in a seeded random order: each example goes into the open row with the least room left
    that still holds it, else starts a row. Returns each row's example indices, in the order they sit in the
    row."""
    if len(lengths) and int(lengths.max()) > max_length:
        raise ValueError(f"an example of {int(lengths.max())} tokens does not fit a row of {max_length}")
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    with_room = np.zeros(max_length + 1, dtype=np.int64)  # how many open rows have exactly c tokens of room
    rows_by_room: list[list[int]] = [[] for _ in range(max_length + 1)]
    rows: list[list[int]] = []
    for i in order:
        n = int(lengths[i])
        fits = np.flatnonzero(with_room[n:])
        if fits.size:
            room = n + int(fits[0])
            r = rows_by_room[room].pop()
            with_room[room] -= 1
        else:
            room, r = max_length, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - n > 0:
            rows_by_room[room - n].append(r)
            with_room[room - n] += 1
    return rows


class PackedExamples(torch.utils.data.Dataset):
    """`examples` packed into rows of at most `max_length` tokens (`pack_rows`, once, seeded): row r
    concatenates its examples' input_ids, loss_mask (and cached features), with position_ids and seq_ids
    (module docstring)."""

    def __init__(self, examples: Examples, max_length: int, seed: int) -> None:
        self.examples = examples
        self.rows = pack_rows(examples.lengths(), max_length, seed)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int) -> dict[str, torch.Tensor]:
        parts = [self.examples[i] for i in self.rows[r]]
        row = {
            key: torch.cat([p[key] for p in parts]) for key in parts[0]
        }  # input_ids, loss_mask (, features)
        row["position_ids"] = torch.cat([torch.arange(len(p["input_ids"])) for p in parts])
        row["seq_ids"] = torch.cat([torch.full((len(p["input_ids"]),), j) for j, p in enumerate(parts)])
        return row


def segments(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The example of each token (B, T) long, -1 on padding; an unpacked batch has one example per row (0)."""
    if "seq_ids" in batch:
        return batch["seq_ids"]
    return batch["attention_mask"].long() - 1


def positions(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each token's position in its example (B, T): the packed position_ids, else 0 .. T-1."""
    if "position_ids" in batch:
        return batch["position_ids"]
    B, T = batch["input_ids"].shape
    return torch.arange(T, device=batch["input_ids"].device)[None].expand(B, T)


def target_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The attention arguments of the target's forward: the padding mask, or for packed rows the restarting
    position_ids and no 2D mask (transformers then keeps every example to itself: module docstring)."""
    if "position_ids" in batch:
        return {"attention_mask": None, "position_ids": batch["position_ids"]}
    return {"attention_mask": batch["attention_mask"]}


def reaches(seq: torch.Tensor, shift: int) -> torch.Tensor:
    """(B, T) bool: token t + shift exists and is a real token of t's example (seq (B, T) as `segments`).

    seq        [0 0 0 1 1 -1]
    shift 1    [T T F T F  F]
    shift 2    [T F F F F  F]
    """
    out = torch.zeros_like(seq, dtype=torch.bool)
    if shift < seq.shape[1]:
        out[:, : seq.shape[1] - shift] = (seq[:, shift:] == seq[:, :-shift]) & (seq[:, shift:] >= 0)
    return out


def pair_segments(seq: torch.Tensor) -> torch.Tensor:
    """EAGLE's pairs (f_t, x_{t+1}), t = 0 .. T-2: the example of each pair (B, T-1), -1 where x_{t+1} is not
    in f_t's example (padding, or the next example's first token)."""
    return torch.where(reaches(seq, 1)[:, :-1], seq[:, :-1], -1)


def block_causal_mask(seq: torch.Tensor) -> torch.Tensor:
    """(B, T) example ids (-1: not a real position) -> boolean (B, 1, T, T) mask (True = visible): causal
    within each example; every position sees at least itself, so no row is empty (an empty row makes attention
    NaN)."""
    T = seq.shape[1]
    eye = torch.eye(T, dtype=torch.bool, device=seq.device)
    causal = torch.ones(T, T, dtype=torch.bool, device=seq.device).tril()
    same = (seq[:, :, None] == seq[:, None, :]) & (seq[:, None, :] >= 0)  # (B, T, T): query, key
    return ((causal & same) | eye)[:, None]


@torch.no_grad()
def check_packed_target(target, length: int = 12) -> None:
    """Refuse a target whose forward lets a packed example see its neighbour (a custom attention that ignores
    restarting position_ids): two random examples packed in one row must give each one's features alone."""
    device = next(target.parameters()).device
    vocab = target.get_input_embeddings().weight.shape[0]
    ids = torch.randint(vocab, (1, 2 * length), generator=torch.Generator().manual_seed(0)).to(device)
    pos = torch.arange(length, device=device).repeat(2)[None]
    packed = target.base_model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    alone = target.base_model(input_ids=ids[:, length:], use_cache=False).last_hidden_state
    tol = 1e-2 if packed.dtype in (torch.float16, torch.bfloat16) else 1e-4
    alone = alone.float()
    if (packed[:, length:].float() - alone).norm() > tol * alone.norm():  # a leak moves them by O(1)
        raise ValueError(
            f"this target's attention ({target.config._attn_implementation}) lets packed examples "
            "see each other: train without --packing, or load it with attn_implementation sdpa"
        )
