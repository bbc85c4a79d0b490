"""P-EAGLE's training method: every depth from one drafter forward, the later depths subsampled as the
method trains them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from selfspec.heads.peagle import PEagleDraft
from selfspec.train.data.eagle_features import batch_features
from selfspec.train.loop.method import FIRST_STEP, MethodBase, StepContext, StepOutput
from selfspec.train.loop.tree_fit import fit_dynamic_tree, save_with_tree
from selfspec.train.methods.chunked_loss import chunk_rows
from selfspec.train.methods.step_loss import StepLoss, step_metrics
from selfspec.train.recipes.peagle import PEagleConfig


def subsampled(
    valid: torch.Tensor, depths: int, ratio: float, min_ratio: float, generator: torch.Generator | None = None
) -> list[torch.Tensor | None]:
    """The positions each depth trains at (B, T) bool: depth 0 at `valid`, depth d at a random max(ratio^d,
    min_ratio) of depth d - 1's (P-EAGLE's depth subsampling); depth 0's entry is None (every position)."""
    kept, anchors = valid, [None]
    for d in range(1, depths):
        draw = torch.rand(valid.shape, generator=generator, device=valid.device)
        kept = kept & (draw < max(ratio**d, min_ratio))
        anchors.append(kept)
    return anchors


class PEagleMethod(MethodBase):
    """P-EAGLE's loss, validation and save for the shared training loop (train/loop/training.py)."""

    label = "the P-EAGLE drafter"
    best_metric = "sim_accept"  # the loop saves the weights of the best validation by this

    def __init__(
        self, cfg: PEagleConfig, target, draft: PEagleDraft, tune_prompts: list[torch.Tensor]
    ) -> None:
        self.cfg, self.target, self.trainable, self.tune_prompts = cfg, target, draft, tune_prompts
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.chunk = chunk_rows(self.lm_head.weight.shape[0])
        self.layers = draft.config.feature_layers

    def _depths(self, batch: dict[str, torch.Tensor], subsample: bool):
        """The loss object, every depth's outputs (B, T-1, H) and the target's last hidden states
        (B, T, H)."""
        feats = batch_features(self.target, batch, self.layers, self.timer)
        hidden = self.lm_head.weight.shape[1]
        loss = StepLoss(
            self.trainable, self.cfg.depths, self.lm_head, self.chunk, runner=self.module, agree=self.agree
        )
        anchors = None
        if subsample:
            valid = batch["attention_mask"][:, 1:].bool()
            anchors = subsampled(valid, self.cfg.depths, self.cfg.cod_ratio, self.cfg.cod_min_ratio)
        outputs = loss.unroll(
            feats[..., :-hidden], batch, self.embed, depths=self.cfg.depths, anchors=anchors
        )
        return loss, outputs, feats[..., -hidden:], anchors

    def loss(self, batch: dict[str, torch.Tensor], step: StepContext = FIRST_STEP) -> StepOutput:
        loss, outputs, target, anchors = self._depths(batch, subsample=True)
        return StepOutput(*loss.loss(outputs, target, batch, keep=anchors))

    def evaluate(
        self,
        batches: list[dict[str, torch.Tensor]],
        total: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """Validation at every position and depth; `total` sums over processes. "sim_accept" is the chain's
        teacher-forced acceptance length: 1 + the leading depths whose top-1 is the target's argmax."""
        return step_metrics(
            batches,
            lambda batch: self._depths(batch, subsample=False)[:3],
            self.cfg.depths,
            self.lm_head.weight.device,
            total,
            lambda d: f"depth{d + 1}_top1",
        )

    def save(self, draft: PEagleDraft, output_dir: Path, metrics: dict[str, float]) -> None:
        """Fit the chain or tree here (unless the recipe sets it; without prompts: the chain of every
        depth)."""
        cfg = self.cfg
        fit = (
            (
                lambda: fit_dynamic_tree(
                    self.target,
                    draft,
                    self.tune_prompts,
                    cfg.grid(),
                    cfg.tune_new_tokens,
                    "P-EAGLE chain/tree",
                )
            )
            if self.tune_prompts
            else None
        )
        chain = {"depth": cfg.depths, "top_k": 1, "total_tokens": cfg.depths}
        save_with_tree(draft, output_dir, cfg, metrics, self.summary(metrics), fit, chain)

    def summary(self, metrics: dict[str, float]) -> str:
        per = " / ".join(f"{metrics[f'depth{d}_top1']:.3f}" for d in range(1, self.cfg.depths + 1))
        return (
            f"top-1 agreement with the target per depth {per}; simulated acceptance length "
            f"{metrics['sim_accept']:.2f} (chain, teacher-forced)"
        )
