"""EAGLE-1/2 and EAGLE-3 training methods: the drafter unrolled over the target's features (EAGLE-3: its
training-time test steps), and validation of each step's agreement with the target."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from selfspec.heads.eagle import EagleDraft
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.families import family
from selfspec.infer.measure.tune import eagle_grid
from selfspec.train.data.eagle_features import batch_features
from selfspec.train.data.packing import block_causal_mask, pair_segments, positions, segments
from selfspec.train.loop.method import FIRST_STEP, MethodBase, StepContext, StepOutput
from selfspec.train.loop.tree_fit import fit_dynamic_tree, save_with_tree
from selfspec.train.methods.chunked_loss import chunk_rows, chunked_sum, labels_ahead
from selfspec.train.methods.step_loss import StepLoss, step_metrics
from selfspec.train.recipes.eagle import EagleConfig

RANKS = 10  # validation reports how often the target's token is in the drafter's top-r, r < RANKS


class EagleMethod(MethodBase):
    label = "the EAGLE drafter"

    def __init__(self, cfg: EagleConfig, target, draft: EagleDraft, tune_prompts: list[torch.Tensor]) -> None:
        self.cfg, self.target, self.trainable, self.tune_prompts = cfg, target, draft, tune_prompts
        # an EAGLE-1/2 draft vocabulary (fixed for the run; read here, before an engine wraps the drafter)
        rows = family(draft.config.kind).vocabulary == "rows" and draft.config.draft_vocab_size
        self.draft_ids = draft.draft_ids.clone() if rows else None
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.chunk = chunk_rows(
            self.lm_head.weight.shape[0]
        )  # positions projected onto the vocabulary at a time

    def features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The target's last hidden states (B, T, H), from the batch when cached on disk."""
        return batch_features(self.target, batch, None, self.timer)

    def _predict(self, batch: dict[str, torch.Tensor], noise: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted and true next features at the masked pairs, (N, H) each.

        Pair t reads (f_t, x_{t+1}) and predicts f_{t+1}, whose logits predict x_{t+2}: a pair counts
        where x_{t+2} is in the loss mask (the same positions as Medusa's first head). In packed rows a pair
        attends only to the earlier pairs of its example, at its position there, and counts only where x_{t+2}
        is in that example too.
        """
        feats = self.features(batch)
        inputs = feats[:, :-1].to(next(self.trainable.parameters()).dtype)  # evaluation runs without autocast
        if noise > 0:
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise
        seq = segments(batch)
        pairs = pair_segments(seq)  # (B, T-1): the example of each pair, -1 where x_{t+1} is not in it
        pred = self.module(
            inputs,
            batch["input_ids"][:, 1:],
            self.embed,
            attention_mask=block_causal_mask(pairs),
            position_ids=positions(batch)[:, :-1],
        )
        keep = labels_ahead(batch["input_ids"], batch["loss_mask"], 0, seq)[1][:, :-1] & (pairs >= 0)
        return pred[keep], feats[:, 1:][keep]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's frozen lm_head on (predicted) features, as float32."""
        return self.lm_head(features.to(self.lm_head.weight.dtype)).float()

    def _ranked(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's RANKS best target tokens per row (C, RANKS): among its draft vocabulary when it has
        one, since it never drafts the others."""
        if self.draft_ids is None:
            return logits.topk(RANKS, dim=-1).indices
        ids = self.draft_ids.to(logits.device)
        ranked = ids[logits[:, ids].topk(min(RANKS, ids.numel()), dim=-1).indices]
        return F.pad(
            ranked, (0, RANKS - ranked.shape[1]), value=-1
        )  # -1: no token, for vocabularies under RANKS

    def _cls_sum(self, pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
        """The soft-label cross-entropy of a chunk of pairs, summed: the target's distribution at the true
        feature against the drafter's at the predicted one."""
        with torch.no_grad():
            p = self.logits(true).softmax(-1)  # (C, V)
        return -(p * self.logits(pred).log_softmax(-1)).sum()

    def _eval_sums(self, pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
        """(3 + RANKS,) float64 for a chunk of pairs: feature regression (mean over H, summed over pairs),
        soft cross-entropy, pairs, and how often the target's top token is the drafter's r-th choice
        (r < RANKS)."""
        target, logits = self.logits(true), self.logits(pred)  # (C, V) each
        reg = F.smooth_l1_loss(pred.float(), true.float(), reduction="none").mean(-1).sum()
        cls = -(target.softmax(-1) * logits.log_softmax(-1)).sum()
        hits = (self._ranked(logits) == target.argmax(-1, keepdim=True)).sum(0)
        return torch.cat(
            [
                torch.stack([reg, cls]).double(),
                reg.new_tensor([pred.shape[0]], dtype=torch.float64),
                hits.double(),
            ]
        )

    def loss(self, batch: dict[str, torch.Tensor], step: StepContext = FIRST_STEP) -> StepOutput:
        pred, true = self._predict(batch, self.cfg.noise)
        if pred.shape[0] == 0:
            zero = pred.sum() * 0.0
            return StepOutput(
                zero, {"loss": zero.detach(), "reg_loss": zero.detach(), "cls_loss": zero.detach()}
            )
        reg = F.smooth_l1_loss(pred.float(), true.float())
        cls = chunked_sum(self._cls_sum, (pred, true), self.chunk) / pred.shape[0]
        total = reg + self.cfg.w_cls * cls
        return StepOutput(total, {"loss": total.detach(), "reg_loss": reg.detach(), "cls_loss": cls.detach()})

    def evaluate(
        self,
        batches: list[dict[str, torch.Tensor]],
        total: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """Validation metrics of `batches`; `total` sums a tensor over processes (each evaluating its
        share)."""
        sums = torch.zeros(3 + RANKS, dtype=torch.float64, device=self.lm_head.weight.device)
        for batch in batches:
            sums += chunked_sum(self._eval_sums, self._predict(batch, 0.0), self.chunk)
        sums = (total(sums) if total else sums).cpu()
        reg, cls, count, hits = float(sums[0]), float(sums[1]), max(float(sums[2]), 1.0), sums[3:]
        metrics = {
            "loss": (reg + self.cfg.w_cls * cls) / count,
            "reg_loss": reg / count,
            "cls_loss": cls / count,
            "top1": float(hits[0] / count),
            "top5": float(hits[:5].sum() / count),
        }
        for r in range(RANKS):
            metrics[f"rank_acc/{r}"] = float(hits[r] / count)
        return metrics

    def save(self, draft: EagleDraft, output_dir: Path, metrics: dict[str, float]) -> None:
        """Fit the dynamic tree here (unless the recipe sets it) and save the drafter with its validation."""
        cfg = self.cfg
        grid = eagle_grid(cfg.tune_depths, cfg.tune_top_ks, cfg.tune_totals)
        fit = (
            (
                lambda: fit_dynamic_tree(
                    self.target, draft, self.tune_prompts, grid, cfg.tune_new_tokens, "dynamic tree"
                )
            )
            if self.tune_prompts
            else None
        )
        save_with_tree(draft, output_dir, cfg, metrics, self.summary(metrics), fit)

    def summary(self, metrics: dict[str, float]) -> str:
        return f"top-1 agreement with the target {metrics['top1']:.3f}, top-5 {metrics['top5']:.3f}"


class Eagle3Method(EagleMethod):
    """EAGLE-3: the training-time test over fused features (heads/eagle3.py, train/methods/step_loss.py); tree
    fitting and saving as EAGLE."""

    label = "the EAGLE-3 drafter"

    def __init__(
        self, cfg: EagleConfig, target, draft: Eagle3Draft, tune_prompts: list[torch.Tensor]
    ) -> None:
        super().__init__(cfg, target, draft, tune_prompts)
        self.layers = draft.config.feature_layers

    def _unroll(self, batch: dict[str, torch.Tensor]):
        """The drafter's outputs per step and the target's last hidden states (B, T, H), from online or cached
        features; the target's lm_head projects only the positions that carry a label (in StepLoss)."""
        feats = batch_features(self.target, batch, self.layers, self.timer)
        hidden = self.lm_head.weight.shape[1]
        ttt = StepLoss(
            self.trainable, self.cfg.ttt_steps, self.lm_head, self.chunk, runner=self.module, agree=self.agree
        )
        return (
            ttt,
            ttt.unroll(feats[..., :-hidden], batch, self.embed, unroll=self.cfg.ttt_steps),
            feats[..., -hidden:],
        )

    def loss(self, batch: dict[str, torch.Tensor], step: StepContext = FIRST_STEP) -> StepOutput:
        ttt, outputs, target = self._unroll(batch)
        return StepOutput(*ttt.loss(outputs, target, batch))

    def evaluate(
        self,
        batches: list[dict[str, torch.Tensor]],
        total: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """Validation metrics of `batches`; `total` sums a tensor over processes (each evaluating its share).
        "loss" is the mean of the batch losses over batches with trained tokens."""
        return step_metrics(
            batches,
            self._unroll,
            self.cfg.ttt_steps,
            self.lm_head.weight.device,
            total,
            lambda i: f"step{i}_top1",
        )

    def summary(self, metrics: dict[str, float]) -> str:
        steps = " / ".join(f"{metrics[f'step{i}_top1']:.3f}" for i in range(self.cfg.ttt_steps))
        return (
            f"top-1 agreement with the target per draft step {steps}; simulated acceptance length "
            f"{metrics['sim_accept']:.2f} (chain, teacher-forced)"
        )
