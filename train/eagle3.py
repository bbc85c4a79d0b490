"""EAGLE-3 training: fused target features, the training-time test, a draft vocabulary.

Used by `accelerate launch train/eagle.py --version 3`. The drafter unrolls `ttt_steps` draft steps over
each sequence (heads.eagle3.Eagle3Draft.unrolled): step 0 reads the target's fused features, step i its
own step-(i-1) outputs, with the true tokens as inputs. Step i at position t predicts x_{t+2+i}; its
label is the target's distribution there, restricted to the draft vocabulary and renormalised:

    tokens      x0   x1   x2   x3   x4   x5
    step 0, t=0 reads (F0, x1)       -> predicts x2   label p(. | x0..x1) = target logits at 1
    step 1, t=0 reads (o0_0, x2)     -> predicts x3   label target logits at 2
    step i, t   reads (o(i-1)_t, x_{t+1+i}) -> x_{t+2+i}, label target logits at t+1+i

Loss = sum_i 0.8^i * soft cross-entropy; positions whose label token is outside the loss mask, or whose
target argmax is outside the draft vocabulary, are left out. No feature-regression loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heads.eagle3 import Eagle3Draft
from train.medusa import medusa_labels

STEP_DECAY = 0.8  # weight of step i's loss is STEP_DECAY ** i


def draft_vocabulary(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent target tokens among the loss-bearing tokens (ties: the lower id), as ids (size,).
    Tokens never seen fill the rest, lowest ids first, so the vocabulary always has `size` entries."""
    counts = torch.bincount(input_ids[loss_mask.bool()].flatten(), minlength=vocab_size)[:vocab_size]
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:size]


@torch.no_grad()
def init_from_target(draft: Eagle3Draft, target) -> None:
    """Start the drafter's lm_head as the target's rows of the draft vocabulary: it then learns to produce
    features the target's own head reads, instead of a vocabulary projection from scratch as well."""
    head = target.get_output_embeddings().weight
    draft.lm_head.weight.copy_(head[draft.draft_ids.to(head.device)].to(draft.lm_head.weight.dtype))


class Labels:
    """The target's distributions over the draft vocabulary (renormalised) and its argmax (as target ids) at
    every position, computed once per batch; each step reads a shifted slice."""

    def __init__(self, target_logits: torch.Tensor, draft: Eagle3Draft, batch: dict[str, torch.Tensor]) -> None:
        logits = target_logits[:, 1:]  # the label of step i at t is the target's prediction at t + 1 + i
        self.argmax = logits.argmax(-1)  # (B, T-1)
        self.probs = torch.softmax(logits.float().index_select(-1, draft.draft_ids), dim=-1)  # (B, T-1, N)
        self.input_ids, self.loss_mask, self.attention_mask = (
            batch["input_ids"], batch["loss_mask"], batch["attention_mask"])

    def step(self, step: int):
        """For step `step` at positions t = 0..T-2-step: the target's distribution over the draft vocabulary
        (B, T', N), its argmax as a target id (B, T'), and which positions count (B, T')."""
        length = self.argmax.shape[1] - step
        labels_ok = medusa_labels(self.input_ids, self.loss_mask, step)[1][:, :length]  # x_{t+2+step} is loss-bearing
        visible = self.attention_mask[:, 2 + step :].bool()
        keep = labels_ok & F.pad(visible, (0, length - visible.shape[1]))
        return self.probs[:, step:], self.argmax[:, step:], keep


class Eagle3Loss:
    """The training-time-test loss and validation metrics for an Eagle3Draft (the recipe's method uses it)."""

    def __init__(self, draft: Eagle3Draft, steps: int) -> None:
        self.draft, self.steps = draft, steps

    def unroll(self, features: torch.Tensor, batch: dict[str, torch.Tensor], embed) -> list[torch.Tensor]:
        ids, attn = batch["input_ids"], batch["attention_mask"]
        dtype = next(self.draft.parameters()).dtype
        return self.draft.unrolled(features[:, :-1].to(dtype), ids[:, 1:], embed, attn[:, 1:], self.steps)

    def loss(self, outputs: list[torch.Tensor], target_logits: torch.Tensor, batch: dict[str, torch.Tensor]):
        total = outputs[0].sum() * 0.0
        logs = {}
        labels = Labels(target_logits, self.draft, batch)
        for i, out in enumerate(outputs):
            probs, argmax, keep = labels.step(i)
            keep = keep & self.draft.t2d[argmax]  # the target's choice must be draftable
            logq = torch.log_softmax(self.draft.logits(out[:, : keep.shape[1]][keep]).float(), dim=-1)
            ce = -(probs[keep] * logq).sum(-1).mean() if keep.any() else logq.sum() * 0.0
            total = total + STEP_DECAY**i * ce
            logs[f"step{i}_loss"] = ce.detach()
        logs["loss"] = total.detach()
        return total, logs

    @torch.no_grad()
    def agreement(self, outputs: list[torch.Tensor], target_logits: torch.Tensor, batch: dict[str, torch.Tensor]):
        """Per step: (agreeing positions, counted positions), and the simulated acceptance length summed over
        positions: 1 + the number of leading steps whose top-1 (as a target id) is the target's argmax."""
        steps = len(outputs)
        hits, counts = torch.zeros(steps), torch.zeros(steps)
        labels = Labels(target_logits, self.draft, batch)
        _, _, base = labels.step(0)
        streak = base.clone()
        accepted = base.float()  # the bonus token of every counted position
        for i, out in enumerate(outputs):
            _, argmax, keep = labels.step(i)
            guess = self.draft.to_target(self.draft.logits(out[:, : keep.shape[1]]).argmax(-1))
            agree = (guess == argmax) & keep
            hits[i], counts[i] = agree.sum().item(), keep.sum().item()
            streak = streak[:, : keep.shape[1]] & agree
            accepted[:, : keep.shape[1]] += streak.float()
        return hits, counts, float(accepted.sum()), float(base.sum())
