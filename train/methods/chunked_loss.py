"""What every drafter's training loss shares: the labels a step ahead, and the loss over a vocabulary
projection computed a bounded chunk of positions at a time (with the same number of projection calls on every
rank)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from selfspec.train.data.packing import reaches

CHUNK_ELEMENTS = (
    2**26
)  # float32 logits per loss chunk (256 MiB): positions per chunk = this // vocabulary size


def labels_ahead(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, k: int, seq: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels for head k (0-based): the token k + 2 positions after each input position.

        input    [x0, x1, x2, x3, x4, x5]     hidden h_t has read x0..x_t
        lm_head   h_t -> x_{t+1}               (the target's own prediction)
        head 0    h_t -> x_{t+2}:  labels [x2, x3, x4, x5, -, -]
        head 1    h_t -> x_{t+3}:  labels [x3, x4, x5, -, -, -]

    Returns labels (B, T) and a mask (B, T) that is False where no label exists or the label's
    position is outside the loss mask; with `seq` (B, T) (train.packing.segments of packed rows) also
    where the label belongs to another example than the position.
    """
    shift = k + 2
    labels = torch.zeros_like(input_ids)
    mask = torch.zeros_like(loss_mask, dtype=torch.bool)
    if shift < input_ids.shape[1]:
        labels[:, :-shift] = input_ids[:, shift:]
        mask[:, :-shift] = loss_mask[:, shift:].bool()
    if seq is not None:
        mask &= reaches(seq, shift)
    return labels, mask


def chunk_rows(vocab_size: int) -> int:
    """Positions per loss chunk: a bounded float32 (positions x vocabulary) tensor whatever the vocabulary."""
    return max(1, CHUNK_ELEMENTS // vocab_size)


def chunk_count(rows: int, chunk: int) -> int:
    """How many calls chunked_sum makes on `rows` rows."""
    return -(-rows // chunk)


def chunks(rows: tuple[torch.Tensor, ...], chunk: int, calls: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """The rows split `chunk` at a time, then padded with empty chunks to `calls` chunks."""
    parts = list(zip(*(r.split(chunk) for r in rows)))
    return parts + [tuple(r[:0] for r in rows)] * (calls - len(parts))


def agreed_calls(
    rows: list[int], chunk: int, agree: Callable[[torch.Tensor], torch.Tensor] | None
) -> list[int]:
    """Per group of rows, how many chunks to project (at least one): this rank's own count, or under
    ZeRO-3/FSDP (`agree`, train.distributed.max_over_ranks) the largest over ranks, so every rank calls the
    drafter's own projection equally often."""
    counts = torch.tensor([max(1, chunk_count(n, chunk)) for n in rows])
    return (agree(counts) if agree is not None else counts).tolist()


def chunked_sum(
    fn: Callable[..., torch.Tensor], rows: tuple[torch.Tensor, ...], chunk: int, calls: int = 1
) -> torch.Tensor:
    """fn(*rows) for a fn that sums over rows (a scalar or a vector of sums), computed `chunk` rows at a time.

    Only one chunk's vocabulary-sized tensors are alive at once: with gradients each chunk is
    checkpointed, its logits dropped after the forward pass and recomputed in the backward pass.
    fn runs at least `calls` times (the extra calls on no rows, adding zero): under ZeRO-3 and FSDP every
    rank must run a trainable layer equally often, whatever its share of rows (train.distributed).
    """
    total = None
    for part in chunks(rows, chunk, calls):
        out = checkpoint(fn, *part, use_reentrant=False) if torch.is_grad_enabled() else fn(*part)
        total = out if total is None else total + out
    return total
