"""The per-step soft-label loss of drafters whose step (or depth) i at position t predicts x_{t+2+i} over a
draft vocabulary: EAGLE-3's training-time test (train/eagle.py --version 3) and P-EAGLE's parallel depths
(train/peagle.py).

    tokens      x0   x1   x2   x3   x4   x5
    step 0, t=0 reads (F0, x1)       -> predicts x2   label p(. | x0..x1) = target logits at 1
    step 1, t=0                      -> predicts x3   label target logits at 2
    step i, t                        -> x_{t+2+i},    label target logits at t+1+i

Loss = sum_i 0.8^i * soft cross-entropy against the target's distribution restricted to the draft vocabulary
and renormalised; positions whose label token is outside the loss mask, or whose target argmax is outside the
draft vocabulary, are left out. In packed rows (train.packing) step i at t counts only where x_{t+2+i} is in
t's example.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from selfspec.train.data.packing import block_causal_mask, pair_segments, positions, segments
from selfspec.train.methods.chunked_loss import agreed_calls, chunk_rows, chunked_sum, chunks

STEP_DECAY = 0.8  # weight of step i's loss is STEP_DECAY ** i


class Labels:
    """The label rows of a batch: positions p whose next token x_{p+1} is loss-bearing and visible, where the
    target's prediction is a label, and the target's choice there (argmax over its whole vocabulary).

        label row p   the target's prediction at p, for x_{p+1}       (1 <= p <= T-2)
        step i at t   predicts x_{t+2+i}: label row p = t + 1 + i     (t >= 0)

    Only these rows are projected onto the target's vocabulary, `chunk` rows at a time, and only their target
    states (R, H) are kept: the soft labels are recomputed chunk by chunk where they are needed.
    """

    def __init__(
        self,
        target: torch.Tensor,
        batch: dict[str, torch.Tensor],
        target_logits: Callable[[torch.Tensor], torch.Tensor],
        chunk: int,
    ) -> None:
        carries = (
            batch["loss_mask"][:, 2:].bool() & batch["attention_mask"][:, 2:].bool()
        )  # (B, T-2): p = 1..T-2
        self.b, p = carries.nonzero(as_tuple=True)
        self.p = p + 1  # (R,) each
        self.seq = segments(batch)  # (B, T): a path from t reaches label row p only inside t's example
        self.states = target[self.b, self.p]  # (R, H)
        with torch.no_grad():
            self.argmax = torch.cat([target_logits(s).argmax(-1) for s in self.states.split(chunk)])  # (R,)

    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The label rows step `step` reaches, as indices into the rows (n,), with their batch row and the
        drafter's position t = p - 1 - step, (n,) each."""
        rows = (self.p > step).nonzero().squeeze(1)
        b, t = self.b[rows], self.p[rows] - 1 - step
        inside = self.seq[b, t] == self.seq[b, self.p[rows] + 1]  # x_{t+2+step} is in t's example
        return rows[inside], b[inside], t[inside]


class StepLoss:
    """The per-step loss and validation metrics of a fused-feature drafter (an Eagle3Draft or a PEagleDraft).

    `target` arguments are the target's last hidden states (B, T, H), read through its frozen `lm_head`;
    without an lm_head they are the target's logits (B, T, V) already. Positions are projected onto a
    vocabulary `chunk` at a time (default: a bounded float32 chunk, train.medusa_method.chunk_rows). `runner`
    is the drafter as the training engine wrapped it (DDP, DeepSpeed): the unroll goes through its forward,
    while `draft` (the module itself) answers attribute reads.
    """

    def __init__(
        self,
        draft: torch.nn.Module,
        steps: int,
        lm_head: torch.nn.Module | None = None,
        chunk: int | None = None,
        runner: torch.nn.Module | None = None,
        agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.draft, self.steps, self.lm_head, self.agree = draft, steps, lm_head, agree
        self.runner = runner if runner is not None else draft
        self.chunk = chunk or chunk_rows(draft.t2d.numel())
        self.draft_ids = draft.draft_ids  # (N,) target ids
        # The soft labels need the target's logits over the draft vocabulary only: its lm_head's rows of them.
        self.label_weight = self.label_bias = None
        if lm_head is not None:
            bias = getattr(lm_head, "bias", None)
            with torch.no_grad():
                if self.draft_ids.numel() == lm_head.weight.shape[0]:  # the whole vocabulary, in order
                    self.label_weight, self.label_bias = lm_head.weight, bias
                else:
                    ids = self.draft_ids.to(lm_head.weight.device)
                    self.label_weight, self.label_bias = (
                        lm_head.weight[ids],
                        None if bias is None else bias[ids],
                    )

    def target_logits(self, states: torch.Tensor) -> torch.Tensor:
        """The target's float32 logits over its whole vocabulary (C, V) at these states (C, H)."""
        if self.lm_head is None:
            return states.float()
        return self.lm_head(states.to(self.lm_head.weight.dtype)).float()

    def label_logits(self, states: torch.Tensor) -> torch.Tensor:
        """The target's float32 logits over the draft vocabulary only (C, N), in draft order."""
        if self.label_weight is None:
            return states.float().index_select(-1, self.draft_ids)
        return F.linear(states.to(self.label_weight.dtype), self.label_weight, self.label_bias).float()

    def unroll(
        self, features: torch.Tensor, batch: dict[str, torch.Tensor], embed, **options
    ) -> list[torch.Tensor]:
        """The drafter's outputs per step (B, T-1, H) each over the pairs (F_t, x_{t+1}); in packed rows each
        pair attends within its example (train.packing.block_causal_mask), at its position there. `options` go
        to the drafter's forward (EAGLE-3: unroll=steps; P-EAGLE: depths and anchors)."""
        context = block_causal_mask(pair_segments(segments(batch)))  # (B, 1, T-1, T-1)
        dtype = next(self.draft.parameters()).dtype
        return self.runner(
            features[:, :-1].to(dtype),
            batch["input_ids"][:, 1:],
            embed,
            context,
            positions(batch)[:, :-1],
            **options,
        )

    def _calls(self, rows: list[int]) -> list[int]:
        return agreed_calls(rows, self.chunk, self.agree)

    def _soft_ce_sum(self, outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Summed over a chunk of positions: the cross-entropy of the drafter's distribution at its outputs
        (C, H) against the target's, renormalised over the draft vocabulary, at the label rows' states."""
        with torch.no_grad():
            probs = torch.softmax(self.label_logits(target), dim=-1)  # (C, N)
        logq = torch.log_softmax(self.draft.logits(outputs).float(), dim=-1)  # (C, N)
        return -(probs * logq).sum()

    def loss(
        self,
        outputs: list[torch.Tensor],
        target: torch.Tensor,
        batch: dict[str, torch.Tensor],
        keep: list[torch.Tensor | None] | None = None,
    ):
        """The weighted sum of the steps' soft cross-entropies and each step's, for logging; `keep` (B, T)
        bool per step (None: every position) limits a step to the positions its outputs were computed at."""
        total = outputs[0].sum() * 0.0
        logs = {}
        labels = Labels(target, batch, self.target_logits, self.chunk)
        steps = []
        for i in range(len(outputs)):
            rows, b, t = labels.step(i)
            draftable = self.draft.t2d[labels.argmax[rows]]  # the target's choice must be draftable
            if keep is not None and keep[i] is not None:
                draftable &= keep[i][b, t]
            steps.append((rows[draftable], b[draftable], t[draftable]))
        calls = self._calls([rows.numel() for rows, _, _ in steps])
        for i, (out, (rows, b, t)) in enumerate(zip(outputs, steps)):
            ce = chunked_sum(self._soft_ce_sum, (out[b, t], labels.states[rows]), self.chunk, calls[i])
            ce = ce / max(rows.numel(), 1)
            total = total + STEP_DECAY**i * ce
            logs[f"step{i}_loss"] = ce.detach()
        logs["loss"] = total.detach()
        return total, logs

    @torch.no_grad()
    def agreement(self, outputs: list[torch.Tensor], target: torch.Tensor, batch: dict[str, torch.Tensor]):
        """Per step: agreeing positions and counted positions (steps,), and the simulated acceptance length
        summed over positions: 1 + the number of leading steps whose top-1 (as a target id) is the target's
        argmax; then the number of positions. float64 tensors, on the outputs' device."""
        labels = Labels(target, batch, self.target_logits, self.chunk)
        B, T = outputs[0].shape[:2]
        device = outputs[0].device
        hits = torch.zeros(self.steps, dtype=torch.float64, device=device)
        counts = torch.zeros(self.steps, dtype=torch.float64, device=device)
        streak = torch.zeros(B, T, dtype=torch.bool, device=device)  # (B, T): every earlier step agreed at t
        _, b, t = labels.step(0)
        streak[b, t] = True
        positions = streak.sum(dtype=torch.float64)
        accepted = positions.clone()  # the bonus token of every counted position
        calls = self._calls([labels.step(i)[0].numel() for i in range(len(outputs))])
        for i, out in enumerate(outputs):
            rows, b, t = labels.step(i)
            guess = torch.cat(
                [self.draft.logits(o).argmax(-1) for (o,) in chunks((out[b, t],), self.chunk, calls[i])]
            )
            agree = self.draft.to_target(guess) == labels.argmax[rows]
            hits[i], counts[i] = agree.sum(), rows.numel()
            agreed = torch.zeros_like(streak)
            agreed[b[agree], t[agree]] = True
            streak &= agreed
            accepted += streak.sum()
        return hits, counts, accepted, positions


def step_metrics(
    batches: list[dict[str, torch.Tensor]],
    unroll: Callable[[dict], tuple[StepLoss, list, torch.Tensor]],
    steps: int,
    device: torch.device,
    total: Callable[[torch.Tensor], torch.Tensor] | None,
    name: Callable[[int], str],
) -> dict[str, float]:
    """Validation of a per-step drafter over `batches`, each unrolled by `unroll(batch)` -> (loss, outputs,
    target states); `total` sums over processes (each evaluating its share). "loss" is the mean batch loss
    over batches with trained tokens, "sim_accept" the chain's teacher-forced acceptance length (1 + the
    leading steps whose top-1 is the target's argmax), and `name(i)` names step i's top-1 agreement."""
    # [summed batch losses, batches, accepted, positions, hits per step, counted positions per step]
    sums = torch.zeros(4 + 2 * steps, dtype=torch.float64, device=device)
    for batch in batches:
        loss, outputs, target = unroll(batch)
        value = loss.loss(outputs, target, batch)[0].detach().double()
        hits, counts, accepted, positions = loss.agreement(outputs, target, batch)
        counted = (
            positions > 0
        ).double()  # a batch without trained tokens (a rank's filler) counts for nothing
        sums += torch.cat([torch.stack([value, counted, accepted, positions]), hits, counts])
    sums = (total(sums) if total else sums).cpu()
    value, seen, accepted, positions = sums[:4].tolist()
    top = sums[4 : 4 + steps] / sums[4 + steps :].clamp(min=1)
    metrics = {
        "loss": value / max(seen, 1),
        "top1": float(top[0]),
        "sim_accept": accepted / max(positions, 1),
    }
    return metrics | {name(i): float(top[i]) for i in range(steps)}
