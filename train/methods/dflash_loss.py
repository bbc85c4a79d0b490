"""DFlash training: anchors, their blocks' labels, the position-weighted loss and the validation metrics.

A sequence x_0 .. x_{T-1} with the target's fused features F_t gives up to `anchors` blocks. Block n at anchor
a is [x_a, MASK × (Bk − 1)] at positions a .. a + Bk − 1 after the context F_0 .. F_{a-1} (what decoding
feeds the drafter when x_a is the newest token the target produced); its position j predicts x_{a+j}:

    tokens       x0  x1  x2  x3  x4  x5  x6
    anchor a=2   context F0 F1 | block [x2, M, M, M] -> labels x3, x4, x5 at j = 1, 2, 3

A label counts where its position is loss-bearing (an answer token) and inside the sequence. Loss: the
cross-entropy with the label token (`ce`) or the KL divergence from the target's distribution there (`kl`),
weighted per block position by exp(−(j − 1)/γ) (`decay`) or by D-PACE (`dpace`): with
q̃_i = (1 − α)·exp(−loss_i) + α, w_j = Σ_{m≥j} Π_{i≤m} q̃_i (detached), the expected number of accepted
tokens a position's error costs; the weighted mean over the batch's labels. In packed rows (train.packing) an
anchor has its own example's tokens before it as context, sits at its position there (>= 1), and only labels
of that example count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from selfspec.train.data.packing import positions, reaches, segments
from selfspec.train.methods.chunked_loss import chunked_sum, chunks

LOSSES = ("ce", "kl")
WEIGHTINGS = ("decay", "dpace")


def sample_anchors(
    carries: torch.Tensor, count: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` random anchors per row among the positions a whose next token carries a loss
    (`carries` (B, T) bool at a), without repeats -> anchors (B, N) and whether each is real (B, N), N =
    min(count, T); a row with fewer candidates fills the rest with position 1, marked not real."""
    B, T = carries.shape
    n = min(count, T)
    noise = torch.rand(B, T, device=carries.device, generator=generator)
    picked = noise.masked_fill(~carries, -1.0).topk(n, dim=1)
    real = picked.values >= 0
    return torch.where(real, picked.indices, 1), real


def anchor_carries(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, T) bool: anchor a (at position >= 1 of its example, so the block has context) predicts a
    loss-bearing x_{a+1} of its example."""
    carries = torch.zeros_like(batch["loss_mask"], dtype=torch.bool)
    carries[:, :-1] = batch["loss_mask"][:, 1:].bool()
    return carries & reaches(segments(batch), 1) & (positions(batch) >= 1)


def block_labels(
    batch: dict[str, torch.Tensor], anchors: torch.Tensor, real: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The label token of each block position j >= 1, x_{a+j}, and whether it counts (B, N, block − 1) each: a
    loss-bearing token of the anchor's own example."""
    T = batch["input_ids"].shape[1]
    at = anchors[..., None] + torch.arange(1, block, device=anchors.device)  # (B, N, Bk - 1)
    inside = at < T
    at = at.clamp(max=T - 1)
    flat = at.flatten(1)
    keep = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    seq = segments(batch)
    same = seq.gather(1, flat).view_as(at) == seq.gather(1, anchors)[..., None]
    counts = keep.gather(1, flat).view_as(at) & inside & same & real[..., None]
    return batch["input_ids"].gather(1, flat).view_as(at), counts


def decay_weights(block: int, gamma: float, device: torch.device) -> torch.Tensor:
    """exp(−(j − 1)/γ) for block positions j = 1 .. block − 1 (block − 1,)."""
    return torch.exp(-torch.arange(block - 1, device=device, dtype=torch.float32) / gamma)


def dpace_weights(losses: torch.Tensor, counts: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights (..., Bk − 1) from per-position losses where `counts`: q̃_i = (1 − α) exp(−loss_i) + α
    (0 where a position has no label, ending the prefix), w_j = Σ_{m>=j} Π_{i<=m} q̃_i. Detached."""
    q = torch.where(counts, (1 - alpha) * torch.exp(-losses.detach()) + alpha, 0.0)
    prefix = torch.cumprod(q, dim=-1)
    return prefix.flip(-1).cumsum(-1).flip(-1)


class DFlashLoss:
    """The loss and validation sums for one batch of block outputs. `lm_head` is the target's frozen head; the
    outputs' label rows are projected onto the vocabulary `chunk` rows at a time (checkpointed with
    gradients)."""

    def __init__(
        self,
        lm_head: torch.nn.Module,
        block: int,
        loss: str = "ce",
        weighting: str = "decay",
        gamma: float = 7.0,
        alpha: float = 0.5,
        chunk: int = 256,
        agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.lm_head, self.block, self.kind, self.weighting = lm_head, block, loss, weighting
        self.gamma, self.alpha, self.chunk, self.agree = gamma, alpha, chunk, agree

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rows.to(self.lm_head.weight.dtype)).float()

    def _per_row(self, out: torch.Tensor, label: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        """Each row's loss (C,): cross-entropy with its label token, or KL from the target's distribution at
        the target's states (C, H) that predict it."""
        return self._loss_of(self.logits(out), label, target)

    def _loss_of(
        self, logits: torch.Tensor, label: torch.Tensor, target: torch.Tensor | None
    ) -> torch.Tensor:
        logq = torch.log_softmax(logits, dim=-1)
        if target is None:
            return -logq.gather(1, label[:, None])[:, 0]
        with torch.no_grad():
            logp = torch.log_softmax(self.logits(target), dim=-1)
        return (logp.exp() * (logp - logq)).sum(-1)

    def weights(self, per: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
        """Per-position weights (B, N, Bk − 1): the decay, or D-PACE's from the per-position losses `per`."""
        if self.weighting == "decay":
            return decay_weights(self.block, self.gamma, counts.device).expand_as(counts)
        return dpace_weights(per, counts, self.alpha)

    def _weighted_sum(self, out, label, target, weight) -> torch.Tensor:
        return (self._per_row(out, label, target if target.numel() else None) * weight).sum()

    def rows(
        self,
        outputs: torch.Tensor,
        batch: dict[str, torch.Tensor],
        anchors: torch.Tensor,
        real: torch.Tensor,
        last: torch.Tensor | None,
    ):
        """The label rows: block outputs (R, H), label tokens (R,), the target's states before each label
        (R, H) (KL only, else (R, 0)) and where each row sits in counts (B, N, Bk − 1)."""
        labels, counts = block_labels(batch, anchors, real, self.block)
        b, n, j = counts.nonzero(as_tuple=True)
        out = outputs[b, n, j + 1]
        target = last[b, anchors[b, n] + j] if self.kind == "kl" else out.new_zeros(out.shape[0], 0)
        return out, labels[b, n, j], target, counts

    def loss(
        self,
        outputs: torch.Tensor,
        batch: dict[str, torch.Tensor],
        anchors: torch.Tensor,
        real: torch.Tensor,
        last: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """outputs (B, N, Bk, H) of `DFlashDraft.packed`, the batch, its anchors (B, N) and which are real,
        the target's last hidden states (B, T, H) for KL -> the weighted mean loss and its logs."""
        out, label, target, counts = self.rows(outputs, batch, anchors, real, last)
        per = None
        if self.weighting != "decay":
            with torch.no_grad():
                per = torch.zeros(counts.shape, dtype=torch.float32, device=out.device)
                per[counts] = torch.cat(
                    [
                        self._per_row(o, lab, t if t.numel() else None)
                        for o, lab, t in chunks((out, label, target), self.chunk)
                    ]
                    or [per.new_zeros(0)]
                )
        weights = self.weights(per, counts)
        w = weights[counts]
        total = chunked_sum(self._weighted_sum, (out, label, target, w), self.chunk)
        loss = total / w.sum().clamp(min=1e-6) if out.shape[0] else outputs.sum() * 0.0
        return loss, {"loss": loss.detach()}

    @torch.no_grad()
    def argmax_tokens(self, last: torch.Tensor) -> torch.Tensor:
        """The target's greedy next token at every position (B, T), from its last hidden states (B, T, H)."""
        rows = last.flatten(0, 1)
        return torch.cat([self.logits(r).argmax(-1) for (r,) in chunks((rows,), self.chunk)]).view(
            last.shape[:2]
        )

    @torch.no_grad()
    def metrics(
        self,
        outputs: torch.Tensor,
        batch: dict[str, torch.Tensor],
        anchors: torch.Tensor,
        real: torch.Tensor,
        last: torch.Tensor,
        target_next: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation sums (float64): [loss sum, 1, hits per position (Bk − 1), counted per position
        (Bk − 1)], and each block's streak (B, N): its leading right positions, −1 where its first drafted
        position has no label. A position is right when the drafter's top-1 is the target's own next token
        (its argmax at the position before)."""
        out, label, target, counts = self.rows(outputs, batch, anchors, real, last)
        losses, guesses = [out.new_zeros(0)], [label[:0]]
        for o, lab, t in chunks((out, label, target), self.chunk):  # one projection per row for both
            logits = self.logits(o)
            losses.append(self._loss_of(logits, lab, t if t.numel() else None))
            guesses.append(logits.argmax(-1))
        per = torch.zeros(counts.shape, dtype=torch.float32, device=out.device)
        per[counts] = torch.cat(losses).float()
        w = self.weights(per, counts)[counts]
        loss = (per[counts] * w).sum() / w.sum().clamp(min=1e-6)
        b, n, j = counts.nonzero(as_tuple=True)
        guess = torch.cat(guesses)
        wanted = target_next[b, anchors[b, n] + j]
        right = torch.zeros(counts.shape, dtype=torch.bool, device=counts.device)
        right[b, n, j] = guess == wanted
        streak = torch.cumprod(right.long(), dim=-1).sum(-1)  # (B, N): leading right positions
        streak = torch.where(real & counts[..., 0], streak, -1)
        counted = 1.0 if len(b) else 0.0  # a batch without labels (a rank's filler) counts for nothing
        sums = torch.stack([loss.double() * counted, loss.new_tensor(counted, dtype=torch.float64)])
        return torch.cat([sums, right.sum((0, 1)).double(), counts.sum((0, 1)).double()]), streak


def walk(row: list[int]) -> list[tuple[int, int]]:
    """Teacher-forced chain decoding of one sequence from its block streaks at every anchor (−1 where no block
    is drafted) -> the (anchor, streak) of each draft step. As decoding does, the first block of a generated
    stretch sits one past its first anchor (the target's own forward gave that token), and a step at anchor a
    accepts its streak plus the target's token, so the next step is at a + streak + 1."""
    steps, a, fresh = [], 0, True
    while a < len(row):
        if row[a] < 0:
            a, fresh = a + 1, True
        elif fresh:
            a, fresh = a + 1, False
        else:
            steps.append((a, row[a]))
            a += row[a] + 1
    return steps


def decode_walk(streaks: torch.Tensor) -> tuple[int, int]:
    """(draft steps, tokens) of `walk` over every row of streaks (B, T): tokens per step is the chain's tau on
    these sequences, which a mean over all anchors overstates (one step jumps a whole predictable run)."""
    steps = [step for row in streaks.tolist() for step in walk(row)]
    return len(steps), sum(s + 1 for _, s in steps)
