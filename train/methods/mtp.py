"""The MTP layers' training method: the target's own next-next-token layers unrolled over its features."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from selfspec.heads.mtp import MtpDraft
from selfspec.train.data.eagle_features import batch_features
from selfspec.train.loop.method import FIRST_STEP, MethodBase, StepContext, StepOutput
from selfspec.train.loop.tree_fit import fit_dynamic_tree, save_with_tree
from selfspec.train.methods.chunked_loss import chunk_rows
from selfspec.train.methods.step_loss import StepLoss, step_metrics
from selfspec.train.recipes.mtp import MtpConfig


class MtpMethod(MethodBase):
    """The MTP layers' loss, validation and save for the shared training loop (train/loop/training.py)."""

    label = "the MTP layers"
    best_metric = "sim_accept"  # the loop saves the weights of the best validation by this

    def __init__(self, cfg: MtpConfig, target, draft: MtpDraft, tune_prompts: list[torch.Tensor]) -> None:
        self.cfg, self.target, self.trainable, self.tune_prompts = cfg, target, draft, tune_prompts
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.chunk = chunk_rows(self.lm_head.weight.shape[0])

    def _unroll(self, batch: dict[str, torch.Tensor]):
        """The loss object, the MTP outputs per step and the target's last hidden states (B, T, H)."""
        hidden = batch_features(self.target, batch, None, self.timer)
        steps = StepLoss(
            self.trainable, self.cfg.ttt_steps, self.lm_head, self.chunk, runner=self.module, agree=self.agree
        )
        return steps, steps.unroll(hidden, batch, self.embed, unroll=self.cfg.ttt_steps), hidden

    def loss(self, batch: dict[str, torch.Tensor], step: StepContext = FIRST_STEP) -> StepOutput:
        steps, outputs, hidden = self._unroll(batch)
        return StepOutput(*steps.loss(outputs, hidden, batch))

    def evaluate(
        self,
        batches: list[dict[str, torch.Tensor]],
        total: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """Per step top-1 agreement with the target and "sim_accept", the chain's teacher-forced acceptance
        length (1 + the leading steps whose top-1 is the target's argmax); `total` sums over processes."""
        return step_metrics(
            batches,
            self._unroll,
            self.cfg.ttt_steps,
            self.lm_head.weight.device,
            total,
            lambda i: f"step{i}_top1",
        )

    def save(self, draft: MtpDraft, output_dir: Path, metrics: dict[str, float]) -> None:
        """Fit the dynamic tree here (unless the recipe sets it) and save the layers with their validation."""
        cfg = self.cfg
        draft.bind(self.lm_head)
        fit = (
            (
                lambda: fit_dynamic_tree(
                    self.target, draft, self.tune_prompts, cfg.grid(), cfg.tune_new_tokens, "MTP chain/tree"
                )
            )
            if self.tune_prompts
            else None
        )
        chain = {"depth": cfg.ttt_steps, "top_k": 1, "total_tokens": cfg.ttt_steps}
        save_with_tree(draft, output_dir, cfg, metrics, self.summary(metrics), fit, chain)

    def summary(self, metrics: dict[str, float]) -> str:
        per = " / ".join(f"{metrics[f'step{i}_top1']:.3f}" for i in range(self.cfg.ttt_steps))
        return (
            f"top-1 agreement with the target per depth {per}; simulated acceptance length "
            f"{metrics['sim_accept']:.2f} (chain, teacher-forced)"
        )
