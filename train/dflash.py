"""Train a DFlash block-parallel drafter on a frozen causal LM.

    accelerate launch train/dflash.py                        # demo target, self-distilled stdlib, CPU, ~20 min
    accelerate launch train/dflash.py --config configs/dflash/qwen3-8b-dflash.yaml

The frozen target computes its fused layers (target_layer_ids) online, without gradients. Each sequence
gives `anchors` random blocks [x_a, MASK...], all drafted in one masked attention pass (heads.dflash
DFlashDraft.packed); the loss is position-weighted (train/dflash_loss.py). Validation drafts a block at every
position and reports each block position's top-1 agreement with the target and the tokens per step of a
teacher-forced chain decoding over the sequences (`sim_accept`), and the checkpoint
with the best one is what is saved. At the end the chain/tree (depth, top_k, total_tokens) is fitted to this
machine by decoding validation prompts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch

from selfspec.heads.dflash import DEFAULT_FEATURES, DFlashDraft, block_embeds, default_target_layer_ids
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.errors import run_main
from selfspec.train.config import ConfigError, check_at_least, load_config
from selfspec.train.data import Examples
from selfspec.train.dflash_loss import (
    LOSSES,
    WEIGHTINGS,
    DFlashLoss,
    anchor_carries,
    decode_walk,
    sample_anchors,
)
from selfspec.train.eagle_features import batch_features
from selfspec.train.feature_run import run_feature_drafter
from selfspec.train.loop import heads_config
from selfspec.train.medusa_method import chunk_rows
from selfspec.train.method import FIRST_STEP, MethodBase, StepContext, StepOutput
from selfspec.train.packing import positions, segments
from selfspec.train.train_config import TrainConfig
from selfspec.train.tree_fit import fit_dynamic_tree, save_with_tree
from selfspec.train.vocabulary import choose_mask_token


@dataclasses.dataclass
class DFlashConfig(TrainConfig):
    """Train a DFlash drafter on a frozen causal LM (defaults: the demo target on CPU, about 20 minutes)."""

    kind: ClassVar[str] = "dflash"  # the drafter family this recipe trains (heads/families)

    output_dir: str = "outputs/dflash-demo"
    max_steps: int = 1200  # optimizer steps
    max_minutes: float = 20.0  # stop a slower machine in time
    learning_rate: float = 6e-4
    adam_beta2: float = 0.95
    max_grad_norm: float = 1.0
    warmup_ratio: float = 0.04
    max_length: int = 192
    per_device_train_batch_size: int = 8
    mixed_precision: str = "auto"  # auto: bf16 on a GPU with bf16 or a CPU with AMX, float32 elsewhere
    self_distill: bool = True  # learn what the target itself says (the same self-distilled set as the demos)
    max_train_examples: int = 1024
    eval_steps: int = 200
    eval_batches: int = 4  # validation drafts a block at every position: 4 batches of 8 take about a minute on CPU
    save_steps: int = 400
    num_layers: int = 0  # draft decoder layers (0: 5 for targets of 24+ layers, else 2)
    block_size: int = 16  # one draft forward fills block_size - 1 masked positions
    anchors: int = 32  # blocks drafted per sequence per training step
    mask_token_id: int | None = None  # the masked positions' embedding row (None: a token the data never has)
    target_layer_ids: list[int] | None = None  # decoder layers whose outputs are fused (published convention)
    num_target_layers: int = DEFAULT_FEATURES  # how many, spaced as published, when target_layer_ids is None
    qk_norm: bool = True  # per-head q/k RMSNorm before RoPE: the published DFlash layers are Qwen3's for any target
    loss: str = "ce"  # ce: cross-entropy with the (target's own) tokens | kl: KL from the target's distribution
    loss_weighting: str = "decay"  # decay: exp(-(j-1)/gamma) per block position | dpace: D-PACE
    decay_gamma: float | None = None  # None: 7 for blocks of 16, in proportion otherwise
    dpace_alpha: float = 0.5
    cache_features: bool = False  # compute the target's features once and keep them on disk for every epoch
    feature_shard_examples: int = 0  # with cache_features: examples per shard file (0: about 256 MiB each)
    depth: int = 0  # the decoding tree stored with the drafter; 0 fits depth, top_k and total_tokens here
    top_k: int = 0  # children per drafted position (1: the chain)
    total_tokens: int = 0  # drafted nodes kept for verification
    tune_depths: list[int] | None = None  # depths fitted over (None: block_size // 2 - 1 and block_size - 1)
    tune_top_ks: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 4])  # 1 is the chain
    tune_totals: list[int] = dataclasses.field(default_factory=lambda: [16, 32])  # tree sizes fitted over (top_k > 1)
    tune_prompts: int = 6  # validation prompts decoded per setting when fitting
    tune_new_tokens: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, ("anchors", "num_target_layers", "tune_prompts", "tune_new_tokens"), 1)
        check_at_least(self, ("num_layers", "depth", "top_k", "total_tokens", "feature_shard_examples"), 0)
        if self.block_size < 2:
            raise ConfigError(f"--block_size must be >= 2 (the last accepted token and a mask), got {self.block_size}")
        if self.loss not in LOSSES:
            raise ConfigError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.loss_weighting not in WEIGHTINGS:
            raise ConfigError(f"--loss_weighting must be one of {', '.join(WEIGHTINGS)}, got {self.loss_weighting!r}")
        if self.decay_gamma is None:
            self.decay_gamma = 7.0 * (self.block_size - 1) / 15
        if self.decay_gamma <= 0 or not 0 <= self.dpace_alpha <= 1:
            raise ConfigError(f"--decay_gamma must be > 0 and --dpace_alpha in [0, 1], got {self.decay_gamma} and "
                              f"{self.dpace_alpha}")
        if self.tune_depths is None:
            self.tune_depths = sorted({max(1, self.block_size // 2 - 1), self.block_size - 1})
        for name in ("tune_depths", "tune_top_ks", "tune_totals"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ConfigError(f"--{name} must list positive numbers (e.g. 1,2,4), got {getattr(self, name)}")
        deepest = max(self.tune_depths + [self.depth])
        if deepest > self.block_size - 1:
            raise ConfigError(f"a block of {self.block_size} drafts {self.block_size - 1} positions: depth {deepest} "
                              f"is deeper (--tune_depths, --depth)")
        given = [self.depth > 0, self.top_k > 0, self.total_tokens > 0]
        if any(given) and not all(given):
            raise ConfigError("set all of depth, top_k and total_tokens (a fixed tree) or none of them (fit here)")
        ids = self.target_layer_ids
        if ids is not None and (not ids or min(ids) < 0 or any(b <= a for a, b in zip(ids, ids[1:]))):
            raise ConfigError(f"--target_layer_ids must be distinct decoder layer indices from low to high, got {ids}")

    def grid(self) -> list[tuple[int, int, int]]:
        """The (depth, top_k, total_tokens) settings fitted: the chain at each depth, trees of each size."""
        settings = []
        for depth in self.tune_depths:
            for k in self.tune_top_ks:
                totals = [depth] if k == 1 else [t for t in self.tune_totals if t > depth]
                settings += [(depth, k, t) for t in totals]
        return settings


class DFlashMethod(MethodBase):
    label = "the DFlash drafter"
    best_metric = "sim_accept"  # the loop saves the weights of the best validation by this

    def __init__(self, cfg: DFlashConfig, target, draft: DFlashDraft, tune_prompts: list[torch.Tensor]) -> None:
        self.cfg, self.target, self.trainable, self.tune_prompts = cfg, target, draft, tune_prompts
        self.layers = draft.config.feature_layers
        self.block = draft.config.block_size
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.draft_config = draft.config
        self.objective = DFlashLoss(self.lm_head, self.block, cfg.loss, cfg.loss_weighting, cfg.decay_gamma,
                                    cfg.dpace_alpha, chunk_rows(self.lm_head.weight.shape[0]))

    def _forward(self, batch: dict[str, torch.Tensor], feats: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """The drafter's block outputs (B, N, Bk, H) at anchors (B, N), from the target's fused layers + last
        hidden state `feats` (B, T, (K + 1)·H); in packed rows each block within its anchor's example."""
        hidden = self.lm_head.weight.shape[1]
        dtype = next(self.trainable.parameters()).dtype
        with torch.no_grad():
            block = block_embeds(batch["input_ids"].gather(1, anchors), self.draft_config, self.embed, dtype)
        return self.module(feats[..., :-hidden].to(dtype), block.flatten(1, 2), context_positions=positions(batch),
                              anchors=anchors, segments=segments(batch))

    def _features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch_features(self.target, batch, self.layers, self.timer)

    def loss(self, batch: dict[str, torch.Tensor], step: StepContext = FIRST_STEP) -> StepOutput:
        anchors, real = sample_anchors(anchor_carries(batch), self.cfg.anchors)
        return StepOutput(*self.block_loss(batch, anchors, real))

    def block_loss(self, batch: dict[str, torch.Tensor], anchors: torch.Tensor, real: torch.Tensor
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of the blocks at `anchors` (B, N) where `real` (B, N)."""
        feats = self._features(batch)
        outputs = self._forward(batch, feats, anchors)
        return self.objective.loss(outputs, batch, anchors, real, feats[..., -self.lm_head.weight.shape[1]:])

    def streaks(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A block at every position of the batch (`anchors` per drafter call) -> each one's streak (B, T) (leading
        positions whose top-1 is the target's; −1: no block there) and the metric sums of DFlashLoss.metrics."""
        feats, carries = self._features(batch), anchor_carries(batch)
        last = feats[..., -self.lm_head.weight.shape[1]:]
        B, T = carries.shape
        streaks = torch.full((B, T), -1, dtype=torch.long, device=carries.device)
        sums, target_next = 0, self.objective.argmax_tokens(last)
        for chunk in torch.arange(1, T, device=carries.device).split(self.cfg.anchors):
            anchors = chunk.expand(B, -1)
            part, streaks[:, chunk] = self.objective.metrics(self._forward(batch, feats, anchors), batch, anchors,
                                                             carries[:, chunk], last, target_next)
            sums = sums + part
        return streaks, sums

    def evaluate(self, batches: list[dict[str, torch.Tensor]],
                 total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
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
        metrics = {"loss": loss / max(batches_seen, 1), "top1": float(top[0]), "sim_accept": tokens / max(steps, 1)}
        return metrics | {f"pos{j + 1}_top1": float(top[j]) for j in range(D)}

    def save(self, draft: DFlashDraft, output_dir: Path, metrics: dict[str, float]) -> None:
        """Fit the chain or tree here (unless the recipe sets it; without prompts: the block's chain) and save."""
        cfg = self.cfg
        fit = (lambda: fit_dynamic_tree(self.target, draft, self.tune_prompts, cfg.grid(), cfg.tune_new_tokens,
                                        "DFlash chain/tree")) if self.tune_prompts else None
        chain = {"depth": self.block - 1, "top_k": 1, "total_tokens": self.block - 1}
        save_with_tree(draft, output_dir, cfg, metrics, self.summary(metrics), fit, chain)

    def summary(self, metrics: dict[str, float]) -> str:
        per = " / ".join(f"{metrics[f'pos{j}_top1']:.3f}" for j in range(1, self.block))
        return (f"top-1 agreement with the target per block position {per}; simulated acceptance length "
                f"{metrics['sim_accept']:.2f} (tokens per step of a teacher-forced chain decoding)")


def build_drafter(cfg: DFlashConfig, target, tokenizer, train_data: Examples) -> DFlashDraft:
    """A DFlash drafter for this target: the published layer spacing, Llama-shaped layers of the target's widths
    (with Qwen3's q/k norms unless --qk_norm false: the layout vLLM and SGLang build)."""
    text = target.config.get_text_config()
    L = text.num_hidden_layers
    ids = cfg.target_layer_ids or default_target_layer_ids(L, cfg.num_target_layers)
    if max(ids) > L - 2:
        raise ConfigError(f"--target_layer_ids must be decoder layers 0..{L - 2} of this {L}-layer target (the last "
                          f"one's output is already normed), got {ids}")
    vocab = target.get_output_embeddings().weight.shape[0]
    fields = dict(num_layers=cfg.num_layers or (5 if L >= 24 else 2), layer=layer_fields(target.config),
                  feature_layers=[i + 1 for i in ids], block_size=cfg.block_size, qk_norm=cfg.qk_norm,
                  mask_token_id=choose_mask_token(cfg, tokenizer, train_data, vocab),
                  depth=cfg.block_size - 1, top_k=1, total_tokens=cfg.block_size - 1)
    return DFlashDraft(heads_config(cfg, target, "dflash", **fields))


def run(cfg: DFlashConfig) -> dict:
    """Set up, train and save; returns the target, the trained drafter and the validation history."""
    return run_feature_drafter(cfg, lambda target, tokenizer, data: build_drafter(cfg, target, tokenizer, data),
                               lambda target, draft, prompts: DFlashMethod(cfg, target, draft, prompts))


def main(argv: list[str] | None = None) -> None:
    """The script: options from the command line; a user error ends in one line (exit 2)."""
    run_main(lambda args: run(load_config(DFlashConfig, args)), argv, prog="train/dflash.py")


if __name__ == "__main__":
    main()
