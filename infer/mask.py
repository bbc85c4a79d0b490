"""Additive 4D attention masks for tree attention, allocated once per generation.

Queries always see every prefix column; among the newest columns a boolean block says who sees
whom (a tree's ancestor matrix). Only that block is written per call, so no step rebuilds the
prefix part. Additive rather than bool: eager attention silently misreads a bool mask.
"""

from __future__ import annotations

import torch


class PrefixMask:
    """(1, 1, rows, max_len) buffer; `at` returns the view for one call."""

    def __init__(self, rows: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.buffer = torch.zeros(1, 1, rows, max_len, dtype=dtype, device=device)
        self.low = torch.finfo(dtype).min
        self.placed: tuple[int, int] | None = None  # columns the last block occupied

    def at(self, prefix_len: int, block: torch.Tensor) -> torch.Tensor:
        """block (q, n) bool, True = visible -> mask (1, 1, q, prefix_len + n): prefix visible, then `block`."""
        q, n = block.shape
        if prefix_len + n > self.buffer.shape[-1] or q > self.buffer.shape[-2]:
            raise ValueError(f"a {q}x{n} block after {prefix_len} columns does not fit the mask {tuple(self.buffer.shape)}")
        if self.placed is not None:
            start, width = self.placed
            self.buffer[..., start : start + width] = 0
        self.buffer[0, 0, :q, prefix_len : prefix_len + n].masked_fill_(~block, self.low)
        self.placed = (prefix_len, n)
        return self.buffer[..., :q, : prefix_len + n]
