"""DFlash's training method: blocks of masked positions filled in one drafter forward (the loss and
anchors in methods/dflash_loss.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from selfspec.heads.dflash import DFlashDraft, block_embeds
from selfspec.train.data.eagle_features import batch_features
from selfspec.train.data.packing import positions, segments
from selfspec.train.loop.method import FIRST_STEP, MethodBase, StepContext, StepOutput
from selfspec.train.loop.tree_fit import fit_dynamic_tree, save_with_tree
from selfspec.train.methods.chunked_loss import chunk_rows
from selfspec.train.methods.dflash_loss import (
    DFlashLoss,
    anchor_carries,
    decode_walk,
    sample_anchors,
)
from selfspec.train.recipes.dflash import DFlashConfig


class DFlashMethod(MethodBase):
    label = "the DFlash drafter"
    best_metric = "sim_accept"  # the loop saves the weights of the best validation by this

    def __init__(
        self, cfg: DFlashConfig, target, draft: DFlashDraft, tune_prompts: list[torch.Tensor]
    ) -> None:
        self.cfg, self.target, self.trainable, self.tune_prompts = cfg, target, draft, tune_prompts
        self.layers = draft.config.feature_layers
        self.block = draft.config.block_size
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.draft_config = draft.config
        self.objective = DFlashLoss(
            self.lm_head,
            self.block,
            cfg.loss,
            cfg.loss_weighting,
            cfg.decay_gamma,
            cfg.dpace_alpha,
            chunk_rows(self.lm_head.weight.shape[0]),
        )

    def _forward(
        self, batch: dict[str, torch.Tensor], feats: torch.Tensor, anchors: torch.Tensor
    ) -> torch.Tensor:
        """The drafter's block outputs (B, N, Bk, H) at anchors (B, N), from the target's fused layers + last
        hidden state `feats` (B, T, (K + 1)·H); in packed rows each block within its anchor's example."""
        hidden = self.lm_head.weight.shape[1]
        dtype = next(self.trainable.parameters()).dtype
        with torch.no_grad():
            block = block_embeds(batch["input_ids"].gather(1, anchors), self.draft_config, self.embed, dtype)
        return self.module(
            feats[..., :-hidden].to(dtype),
            block.flatten(1, 2),
            context_positions=positions(batch),
            anchors=anchors,
            segments=segments(batch),
        )

    def _features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch_features(self.target, batch, self.layers, self.timer)

    def loss(self, batch: dict[str, torch.Tensor], step: StepContext = FIRST_STEP) -> StepOutput:
        anchors, real = sample_anchors(anchor_carries(batch), self.cfg.anchors)
        return StepOutput(*self.block_loss(batch, anchors, real))

    def block_loss(
        self, batch: dict[str, torch.Tensor], anchors: torch.Tensor, real: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of the blocks at `anchors` (B, N) where `real` (B, N)."""
        feats = self._features(batch)
        outputs = self._forward(batch, feats, anchors)
        return self.objective.loss(outputs, batch, anchors, real, feats[..., -self.lm_head.weight.shape[1] :])

    def streaks(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A block at every position of the batch (`anchors` per drafter call) -> each one's streak (B, T)
        (leading positions whose top-1 is the target's; −1: no block there) and the metric sums of
        DFlashLoss.metrics."""
        feats, carries = self._features(batch), anchor_carries(batch)
        last = feats[..., -self.lm_head.weight.shape[1] :]
        B, T = carries.shape
        streaks = torch.full((B, T), -1, dtype=torch.long, device=carries.device)
        sums, target_next = 0, self.objective.argmax_tokens(last)
        for chunk in torch.arange(1, T, device=carries.device).split(self.cfg.anchors):
            anchors = chunk.expand(B, -1)
            part, streaks[:, chunk] = self.objective.metrics(
                self._forward(batch, feats, anchors), batch, anchors, carries[:, chunk], last, target_next
            )
            sums = sums + part
        return streaks, sums

    def evaluate(
        self,
        batches: list[dict[str, torch.Tensor]],
        total: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """Validation metrics of `batches`; `total` sums a tensor over processes (each evaluating its share).
        sim_accept is the chain's tokens per step in a teacher-forced decoding walk over the sequences."""
        D = self.block - 1
        sums = torch.zeros(4 + 2 * D, dtype=torch.float64, device=self.lm_head.weight.device)
        for batch in batches:
            streaks, part = self.streaks(batch)
            sums[:2] += part[:2]
            sums[4:] += part[2:]
            steps, tokens = decode_walk(streaks)
            sums[2:4] += torch.tensor([tokens, steps], dtype=torch.float64, device=sums.device)
        sums = (total(sums) if total else sums).cpu()
        loss, batches_seen, tokens, steps = sums[:4].tolist()
        top = sums[4 : 4 + D] / sums[4 + D :].clamp(min=1)
        metrics = {
            "loss": loss / max(batches_seen, 1),
            "top1": float(top[0]),
            "sim_accept": tokens / max(steps, 1),
        }
        return metrics | {f"pos{j + 1}_top1": float(top[j]) for j in range(D)}

    def save(self, draft: DFlashDraft, output_dir: Path, metrics: dict[str, float]) -> None:
        """Fit the chain or tree here (unless the recipe sets it; without prompts: the block's chain) and
        save."""
        cfg = self.cfg
        fit = (
            (
                lambda: fit_dynamic_tree(
                    self.target,
                    draft,
                    self.tune_prompts,
                    cfg.grid(),
                    cfg.tune_new_tokens,
                    "DFlash chain/tree",
                )
            )
            if self.tune_prompts
            else None
        )
        chain = {"depth": self.block - 1, "top_k": 1, "total_tokens": self.block - 1}
        save_with_tree(draft, output_dir, cfg, metrics, self.summary(metrics), fit, chain)

    def summary(self, metrics: dict[str, float]) -> str:
        per = " / ".join(f"{metrics[f'pos{j}_top1']:.3f}" for j in range(1, self.block))
        return (
            f"top-1 agreement with the target per block position {per}; simulated acceptance length "
            f"{metrics['sim_accept']:.2f} (tokens per step of a teacher-forced chain decoding)"
        )
