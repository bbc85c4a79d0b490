"""Additive 4D attention masks for tree attention, allocated once per generation.

Queries always see every prefix column; among the newest columns a boolean block says who sees
whom (a tree's ancestor matrix). Only that block is written per call, so no step rebuilds the
prefix part. Additive rather than bool: eager attention silently misreads a bool mask.
"""

from __future__ import annotations

import torch


class RowMask:
    """The target's additive mask for a batch of rows with ragged prefixes, (B, 1, rows, max_len), kept up to
    date in place. Row b sees its own filled columns (its prompt without left padding, then what it accepted);
    every step's tree is written at one shared column L for all rows, so a row that accepted less than the
    longest one has a gap of stale columns before L, hidden here. Per step only the tree block and the
    accepted columns are written: nothing that grows with the sequence."""

    def __init__(
        self, batch: int, rows: int, max_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.low = torch.finfo(dtype).min
        self.storage = torch.full((batch, 1, rows, max_len), self.low, dtype=dtype, device=device)
        # visible / hidden as device scalars: a Python number in `where` costs a fill kernel per call on a GPU
        self.shown, self.hidden = (torch.full((), v, dtype=dtype, device=device) for v in (0.0, self.low))
        torch._dynamo.mark_static_address(self.storage)  # a compiled verify's CUDA graphs read it in place
        self.buffer = self.storage  # the rows in use (see `select_rows`)

    def select_rows(self, keep: list[int], index: torch.Tensor, columns: int) -> None:
        """Keep only the batch rows `keep` (in that order; `index`: the same on the device) as rows
        0 .. n - 1, moving their first `columns` columns down in place (nothing when they are the first rows
        already)."""
        n = len(keep)
        if keep != list(range(n)):
            self.storage[:n, ..., :columns] = self.buffer[..., :columns].index_select(0, index)
        self.buffer = self.storage[:n]

    def open(self, start: torch.Tensor, stop: int) -> None:
        """Row b sees columns start[b] .. stop - 1 (its prompt after the left padding)."""
        cols = torch.arange(stop, device=self.buffer.device)
        self.buffer[..., :stop] = self.values(cols >= start[:, None])[:, None, None, :]

    def at(self, at: int, block: torch.Tensor, full: bool = False) -> torch.Tensor:
        """block (B, q, n) bool (True = visible), written at columns at .. at + n -> the mask
        (B, 1, q, at + n), or over every column with `full` (B, 1, q, max_len): the same shape at every
        step."""
        q, n = block.shape[1:]
        if at + n > self.buffer.shape[-1] or (full and q > self.buffer.shape[-2]):
            raise ValueError(
                f"a {q}x{n} block after {at} columns does not fit the mask {tuple(self.buffer.shape)}"
            )
        if q > self.buffer.shape[-2]:  # more queries than rows (a drafter fed many confirmed pairs at
            # once): a new mask, the prefix columns from row 0 (every row's prefix is the same between calls)
            prefix = self.buffer[:, :, :1, :at].expand(-1, -1, q, -1)
            return torch.cat([prefix, self.values(block)[:, None]], dim=-1)
        torch.where(block, self.shown, self.hidden, out=self.buffer[:, 0, :q, at : at + n])  # in place
        return self.buffer[:, :, :q] if full else self.buffer[:, :, :q, : at + n]

    def values(self, visible: torch.Tensor) -> torch.Tensor:
        """A boolean visibility (True = visible) as the mask's additive values, in one kernel."""
        return torch.where(visible, self.shown, self.hidden)

    def hide(self, at: int, n: int) -> None:
        """Hide columns at .. at + n from every row again (a tree or draft block that is done with)."""
        self.buffer[..., at : at + n] = self.low

    def commit(self, at: int, n: int, dst: torch.Tensor, keep: torch.Tensor) -> None:
        """After a tree at columns at .. at + n: hide them again, and show row b's columns dst[b] (B, W) where
        keep[b] (B, W) is True (the accepted path's new places)."""
        self.hide(at, n)
        values = self.values(keep)  # hidden where not kept: past the row's end
        B, _, rows, _ = self.buffer.shape
        self.buffer.scatter_(
            3, dst[:, None, None, :].expand(B, 1, rows, -1), values[:, None, None, :].expand(B, 1, rows, -1)
        )


def padding_mask(start: torch.Tensor, length: int) -> torch.Tensor:
    """(B, length) bool for a left-padded prompt batch, False on row b's first start[b] columns: the 2D mask
    model.generate passes, from which the model builds its own causal mask (boolean for "sdpa", not an
    additive float (B, 1, T, T))."""
    return torch.arange(length, device=start.device)[None] >= start[:, None]
