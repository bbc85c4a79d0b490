"""The Medusa heads' training method: per-head loss over chunked vocabulary projections
(methods/chunked_loss.py), and validation of the rank paths that the saved tree is fitted to."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from selfspec.heads.medusa import MedusaHeads
from selfspec.infer.core.tree import (
    Acceptance,
    best_choices,
    fill_choices,
    fit_tree,
    label_ranks,
    path_frequencies,
)
from selfspec.infer.measure.bench import forward_latency
from selfspec.infer.measure.tune import format_tree_rows
from selfspec.train.data.packing import segments, target_inputs
from selfspec.train.loop.method import FIRST_STEP, MethodBase, StepContext, StepOutput
from selfspec.train.methods.chunked_loss import agreed_calls, chunk_rows, chunked_sum, chunks, labels_ahead

if TYPE_CHECKING:
    from selfspec.train.recipes.medusa import MedusaConfig

RANKS = 10  # top-k candidates per head that validation ranks the true token among (the tree's ranks)
PATH_PREFIX = "path/"  # validation metrics `path/0.0.1`: how often that rank path of the heads was right
PATHS_KEPT = 256  # the most frequent paths kept in the metrics (trees are fitted up to 64 nodes)
JOINT_BINS = 2**20  # at most this many rank vectors counted in validation (the tree's path frequencies)


def measured_paths(metrics: dict[str, float]) -> dict[tuple[int, ...], float]:
    """The rank paths validation counted (`MedusaMethod.evaluate`), from its metrics: path -> how often it was
    right."""
    return {
        tuple(int(r) for r in key[len(PATH_PREFIX) :].split(".")): value
        for key, value in metrics.items()
        if key.startswith(PATH_PREFIX)
    }


def joint_width(num_heads: int) -> int:
    """The ranks told apart per head when validation counts the heads' rank vectors: RANKS, fewer for many
    heads so that (width + 1) ** num_heads bins stay within JOINT_BINS; 0 past 20 heads (not counted)."""
    width = 0
    while width < RANKS and (width + 2) ** num_heads <= JOINT_BINS:
        width += 1
    return width


class MedusaMethod(MethodBase):
    label = "Medusa heads"

    def __init__(self, cfg: MedusaConfig, target, heads: MedusaHeads) -> None:
        self.cfg, self.target, self.trainable = cfg, target, heads
        self.lm_head = target.get_output_embeddings()
        self.num_heads, self.shared = heads.config.num_heads, heads.config.share_lm_head
        self.chunk = chunk_rows(
            heads.config.vocab_size
        )  # loss positions projected onto the vocabulary at a time

    def _features(
        self, batch: dict[str, torch.Tensor], some: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The target's last hidden states (B, T, H) and the K heads' features at the `some` positions
        (M, H)."""
        hidden = self._hidden(batch)
        return hidden, self.module(hidden[some], project=False)  # one call through the (wrapped) heads

    def _hidden(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad(), self.timer.section("target"):  # the frozen target; base_model skips its lm_head
            out = self.target.base_model(
                input_ids=batch["input_ids"], use_cache=False, **target_inputs(batch)
            )
        return out.last_hidden_state  # (B, T, H)

    def _per_head(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor, torch.Tensor, int]]]:
        """The target's hidden states (B, T, H), and per head k: its features at its loss positions only
        (M_k, H), before any vocabulary projection (done chunk by chunk in `_logits`), the labels (M_k,), and
        how many chunks to project them in."""
        seq = segments(batch)
        masks = [labels_ahead(batch["input_ids"], batch["loss_mask"], k, seq) for k in range(self.num_heads)]
        some = torch.stack([mask for _, mask in masks]).any(0)  # (B, T): positions some head learns from
        hidden, outputs = self._features(batch, some)  # K x (M, H)
        heads = [(k, outputs[k][mask[some]], labels[mask]) for k, (labels, mask) in enumerate(masks)]
        calls = agreed_calls([labels.numel() for _, _, labels in heads], self.chunk, self.agree)
        return hidden, [(k, out, labels, n) for (k, out, labels), n in zip(heads, calls)]

    def _logits(self, k: int, outputs: torch.Tensor) -> torch.Tensor:
        """A chunk of head k's features (C, H) -> float32 logits (C, V), through the target's lm_head or the
        head's own. Validation runs without autocast: features meet the projection in its dtype."""
        if self.shared:
            return self.lm_head(outputs.to(self.lm_head.weight.dtype)).float()
        heads = self.trainable
        return heads.project_head(k, outputs.to(heads.heads[k][-1].weight.dtype)).float()

    def _ce_sum(self, k: int, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self._logits(k, outputs), labels, reduction="sum")

    def _eval_head(
        self, k: int, outputs: torch.Tensor, labels: torch.Tensor, calls: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head k's summed cross-entropy (float64) and the rank of each label among its RANKS best (RANKS: not
        among them), the logits projected chunk by chunk."""
        ce, ranks = torch.zeros((), dtype=torch.float64, device=labels.device), []
        for out, lab in chunks((outputs, labels), self.chunk, calls):
            logits = self._logits(k, out)  # (C, V)
            ce += F.cross_entropy(logits, lab, reduction="sum").double()
            ranks.append(label_ranks(logits, lab, RANKS))
        return ce, torch.cat(ranks)

    def loss(self, batch: dict[str, torch.Tensor], step: StepContext = FIRST_STEP) -> StepOutput:
        _, heads = self._per_head(batch)
        total, logs = self._heads_loss(heads)
        logs["loss"] = total.detach()
        return StepOutput(total, logs)

    def _heads_loss(
        self, heads: list[tuple[int, torch.Tensor, torch.Tensor, int]]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """sum_k head_decay^k CE_k over each head's loss positions, and each CE_k detached for the logs."""
        total, logs = 0.0, {}
        for k, outputs, labels, calls in heads:
            ce = chunked_sum(partial(self._ce_sum, k), (outputs, labels), self.chunk, calls) / max(
                labels.numel(), 1
            )
            total = total + self.cfg.head_decay**k * ce
            logs[f"head{k}_loss"] = ce.detach()
        return total, logs

    def evaluate(
        self,
        batches: list[dict[str, torch.Tensor]],
        total: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """Validation metrics of `batches`; `total` sums a tensor over processes (each evaluating its share).
        They include how often each of the most frequent rank paths of the heads was right (`measured_paths`),
        which the saved tree is fitted to."""
        K, device = self.num_heads, self.lm_head.weight.device
        width = joint_width(K)
        # per head, summed over batches, then over processes: cross-entropy, labels, hits at rank 0..RANKS-1
        sums = torch.zeros(K, 2 + RANKS, dtype=torch.float64, device=device)
        joint = torch.zeros(
            (width + 1) ** K if width else 1, dtype=torch.float64, device=device
        )  # positions per rank vector
        for batch in batches:
            hidden, heads = self._per_head(batch)
            self._eval_extra(batch, hidden)
            masks = [
                labels_ahead(batch["input_ids"], batch["loss_mask"], k, segments(batch))[1] for k in range(K)
            ]
            every = torch.stack(masks).all(0)  # (B, T): positions where every head has a label
            code = torch.zeros(int(every.sum()), dtype=torch.long, device=device)
            for (k, outputs, labels, calls), mask in zip(heads, masks):
                ce, ranks = self._eval_head(k, outputs, labels, calls)
                sums[k, 0] += ce
                sums[k, 1] += labels.numel()
                sums[k, 2:] += torch.bincount(ranks, minlength=RANKS + 1)[:RANKS].double()
                code += ranks[every[mask]].clamp(max=width) * (width + 1) ** k
            joint += torch.bincount(code, minlength=joint.numel()).double()
        both = torch.cat([sums.flatten(), joint])  # one reduction across processes
        both = (total(both) if total else both).cpu()
        sums, joint = both[: sums.numel()].view_as(sums), both[sums.numel() :]
        seen = joint.nonzero().squeeze(1)
        vectors = torch.stack([seen // (width + 1) ** k % (width + 1) for k in range(K)], 1)
        paths = path_frequencies(vectors, width, joint[seen]) if width else {}
        loss_sum, count, hits = sums[:, 0], sums[:, 1].clamp(min=1), sums[:, 2:]
        metrics = {"loss": float((loss_sum / count * self.cfg.head_decay ** torch.arange(K)).sum())}
        for k in range(K):
            metrics[f"head{k}_loss"] = float(loss_sum[k] / count[k])
            metrics[f"head{k}_top1"] = float(hits[k, 0] / count[k])
            for r in range(RANKS):
                metrics[f"rank_acc/{k}/{r}"] = float(hits[k, r] / count[k])
        for path in best_choices(paths, PATHS_KEPT):  # the most frequent, enough for any fitted tree
            metrics[PATH_PREFIX + ".".join(map(str, path))] = paths[tuple(path)]
        return metrics

    def _eval_extra(self, batch: dict[str, torch.Tensor], hidden: torch.Tensor) -> None:
        """What a subclass accumulates per validation batch besides the heads' sums (Medusa-2: the target's
        loss)."""

    def fit_tree(self, accuracy: Acceptance) -> list[list[int]]:
        """Measure the target's forward time against tree size here and keep the fastest expected tree."""
        latency = forward_latency(self.target, [1, 4, 8, 12, 16, 24, 32, 48, 64])
        choices, rows = fit_tree(accuracy, latency)
        print(
            "tree fitted to this machine (expected tokens per step from how often each path was right in "
            "validation):"
        )
        print(format_tree_rows(rows, choices))
        return choices

    def save(self, heads: MedusaHeads, output_dir: Path, metrics: dict[str, float]) -> None:
        """Heads, the default tree fitted to the rank paths validation measured, and a card with the
        numbers."""
        K = self.cfg.num_heads
        if not metrics:  # the loop always evaluates before saving; never write a card of zeros or a null tree
            raise ValueError("no validation metrics to fit the tree to: evaluate before saving")
        acc = torch.tensor([[metrics[f"rank_acc/{k}/{r}"] for r in range(RANKS)] for k in range(K)]).clamp(
            min=1e-6
        )
        # fitted to how often each rank path was right in the last evaluation (the heads' hits go together),
        # else to the product of per-head accuracies
        paths = measured_paths(metrics) or acc
        if self.cfg.tree_nodes > 0:
            heads.config.tree = fill_choices(
                best_choices(paths, self.cfg.tree_nodes), acc, self.cfg.tree_nodes
            )
        else:
            heads.config.tree = self.fit_tree(paths)
        table = "\n".join(
            f"| {k} | {metrics[f'head{k}_top1']:.3f} | {metrics[f'head{k}_loss']:.3f} |" for k in range(K)
        )
        card = f"\n## Validation (last evaluation)\n\n| head | top-1 | loss |\n|---|---|---|\n{table}\n"
        heads.save_pretrained(output_dir, card_extra=card)
