"""The confirmed pairs a feature drafter (EAGLE, P-EAGLE) feeds its own cache each step, for a batch of rows.

Each step the target confirms a few positions per row: their features f_t and the tokens x_{t+1} after them.
They are written, right-padded to the longest row's count M, at one shared cache column (`at`: the longest
row's end) in one drafter forward with whatever the family drafts after them; then each row's pairs move down
to its own end (as the target's cache does) and the rest is dropped, so the drafter's cache only ever holds
confirmed positions.
"""

from __future__ import annotations

import dataclasses

import torch

from selfspec.heads.draft_layers import DraftCache
from selfspec.infer.core.mask import RowMask
from selfspec.infer.core.rows import upload
from selfspec.infer.drafters.drafter import newest_pairs


@dataclasses.dataclass
class PairFeed:
    """One step's pairs: features (B, M, ·) and tokens (B, M), right-padded; per row its count, its confirmed
    length before them (B,), which of the M columns are its own (B, M); all written at column `at`."""

    feats: torch.Tensor
    tokens: torch.Tensor
    counts: list[int]
    count_t: torch.Tensor
    lengths: torch.Tensor
    cols: torch.Tensor
    valid: torch.Tensor
    at: int

    @property
    def positions(self) -> torch.Tensor:
        """The pairs' positions (B, M): each row's count on from its own length."""
        return self.lengths[:, None] + self.cols

    @property
    def last(self) -> torch.Tensor:
        """Each row's newest pair's position (B,)."""
        return self.lengths + self.count_t - 1

    def pair_block(self) -> torch.Tensor:
        """Who sees whom among the pairs (B, M, M), True = visible: a pair sees its row's pairs up to itself;
        padding sees itself only (so no attention row is empty)."""
        M, device = self.cols.shape[0], self.cols.device
        causal = torch.ones(M, M, dtype=torch.bool, device=device).tril()
        return (causal[None] & self.valid[:, None, :]) | torch.eye(M, dtype=torch.bool, device=device)

    def newest(self, out: torch.Tensor) -> torch.Tensor:
        """The drafter's outputs over the pairs (B, M + ·, H) -> each row's output at its newest pair
        (B, H)."""
        index = (self.count_t - 1).clamp(min=0)[:, None, None].expand(len(self.counts), 1, out.shape[-1])
        return out.gather(1, index)[:, 0]


class ConfirmedPairs:
    """A batch's drafter cache and its row mask, with each row's confirmed length: row b's pairs sit in
    columns 0 .. lengths[b] - 1."""

    def __init__(self, cache: DraftCache, mask: RowMask, rows: int) -> None:
        self.cache, self.mask = cache, mask
        self.lengths = [0] * rows

    def keep_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """Go on with rows `keep` only, in that order (`index`: the same on the device): their cache and
        mask rows move down."""
        self.cache.select_rows(keep, index)
        self.mask.select_rows(keep, index, self.cache.length)
        self.lengths = [self.lengths[i] for i in keep]

    def feed(
        self,
        active: list[bool],
        contexts: list[torch.Tensor],
        hiddens: list[torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
    ) -> PairFeed:
        """This step's pairs of the `active` rows (the others feed none), moved to the drafter's device."""
        counts = [h.shape[0] if on else 0 for h, on in zip(hiddens, active)]
        feats, tokens = newest_pairs(contexts, hiddens, counts, dtype, device)
        count_t = upload(counts, device)
        cols = torch.arange(max(counts), device=device)
        valid = cols < count_t[:, None]
        return PairFeed(
            feats, tokens, counts, count_t, upload(self.lengths, device), cols, valid, self.cache.length
        )

    def settle(self, feed: PairFeed, written: int) -> torch.Tensor:
        """After the forward that wrote `written` columns at `feed.at` (the pairs first): each row's pairs
        move down to its own end, the rest is hidden and dropped; the shared column becomes the longest row's
        end. Returns the rows' new lengths (B,) on the device."""
        B, M = feed.valid.shape
        dst = feed.positions
        if any(n != feed.at for n in self.lengths):  # else every row already ends at the shared column
            self.cache.keep_rows(feed.at + feed.cols.expand(B, M), dst)
        self.mask.commit(feed.at, written, dst, feed.valid)
        self.lengths = [n + m for n, m in zip(self.lengths, feed.counts)]
        self.cache.length = max(self.lengths)
        return feed.lengths + feed.count_t
