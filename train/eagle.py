"""Train an EAGLE draft model (EAGLE-1/2, or EAGLE-3 with --version 3) on a frozen causal LM.

    accelerate launch train/eagle.py                        # demo target, stdlib corpus, CPU, < 15 min
    accelerate launch train/eagle.py --version 3            # EAGLE-3 on the demo, about 20 min (heads/eagle3.py, train/step_loss.py)
    accelerate launch train/eagle.py --config configs/eagle/llama3-8b-sharegpt.yaml

The frozen target computes features f (its last hidden states, what its lm_head reads) online,
without gradients. The drafter reads (f_t + noise, embedding of x_{t+1}) and predicts f_{t+1}:
loss = SmoothL1(prediction, f_{t+1}) + w_cls * cross-entropy of its token distribution against the
target's distribution at t+1 (soft labels), on loss-mask positions. At the end the dynamic tree
(depth, top_k, total_tokens) is fitted to this machine by decoding validation prompts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle import EagleDraft
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.errors import run_main
from selfspec.heads.families import family
from selfspec.infer.tune import eagle_grid
from selfspec.train.config import ConfigError, check_at_least, load_config
from selfspec.train.data import Examples
from selfspec.train.draft_shape import draft_vocab_size, fused_layers
from selfspec.train.eagle_features import batch_features
from selfspec.train.feature_run import run_feature_drafter
from selfspec.train.loop import heads_config
from selfspec.train.medusa_method import chunk_rows, chunked_sum, medusa_labels
from selfspec.train.method import FIRST_STEP, MethodBase, StepContext, StepOutput
from selfspec.train.packing import block_causal_mask, pair_segments, positions, segments
from selfspec.train.step_loss import StepLoss, step_metrics
from selfspec.train.train_config import TrainConfig
from selfspec.train.tree_fit import fit_dynamic_tree, save_with_tree
from selfspec.train.vocabulary import draft_vocabulary, init_from_target

RANKS = 10  # validation reports how often the target's token is in the drafter's top-r, r < RANKS


@dataclasses.dataclass
class EagleConfig(TrainConfig):
    """Train an EAGLE drafter on a frozen causal LM (defaults: the demo target on CPU, under 15 minutes)."""

    output_dir: str = "outputs/eagle-demo"
    max_steps: int | None = None  # optimizer steps (None: 2400 for EAGLE-1, 800 for EAGLE-3: 10 / 17 minutes here)
    max_minutes: float | None = None  # stop a slower machine in time (None: 10.5 for EAGLE-1, 20 for EAGLE-3)
    learning_rate: float = 1e-3
    adam_beta2: float = 0.95
    max_grad_norm: float = 0.5
    warmup_ratio: float = 0.02
    max_length: int = 192
    per_device_train_batch_size: int = 8
    mixed_precision: str = "auto"  # auto: bf16 on a GPU with bf16 or a CPU with AMX, float32 elsewhere
    self_distill: bool = True  # learn what the target itself says: the drafter imitates it at decode time
    max_train_examples: int = 1024  # the same self-distilled set as the Medusa demo (shared cache)
    eval_steps: int = 250
    save_steps: int = 500
    num_layers: int = 1  # draft decoder layers
    fc_bias: bool | None = None  # bias on the 2H -> H input projection (None: EAGLE-1 yes, EAGLE-3 has none; vLLM's EAGLE-1 drops it: false)
    w_cls: float = 0.1  # weight of the soft-label token loss next to the feature regression
    noise: float = 0.1  # uniform U(-noise, noise) added to the input features while training
    cache_features: bool = False  # compute the target's features once and keep them on disk for every epoch
    feature_shard_examples: int = 0  # with cache_features: examples per shard file (0: about 256 MiB each)
    depth: int = 0  # dynamic tree defaults stored with the drafter; 0 fits all three to this machine
    top_k: int = 0  # frontier width and children per expanded node (0: fit here)
    total_tokens: int = 0  # drafted nodes kept for verification (0: fit here)
    tune_depths: list[int] = dataclasses.field(default_factory=lambda: [3, 4, 5, 6, 8])  # the grid fitted over
    tune_top_ks: list[int] = dataclasses.field(default_factory=lambda: [2, 4, 8])  # top_k values fitted over
    tune_totals: list[int] = dataclasses.field(default_factory=lambda: [16, 32])  # total_tokens values fitted over
    tune_prompts: int = 6  # validation prompts decoded per tree setting when fitting
    tune_new_tokens: int = 128  # as many as the bench: the truncated last step weighs less
    version: int = 1  # 1: EAGLE-1/2 (feature regression + soft labels); 3: EAGLE-3 (fused layers, training-time test)
    ttt_steps: int = 7  # EAGLE-3: draft steps unrolled per sequence in training (the training-time test)
    # FR-Spec for EAGLE-1/2: draft calls read only these rows of the target's lm_head
    draft_vocab_size: int | None = None  # drafts among the N most frequent trained tokens (None: EAGLE-3 vocab/4 in 2048..32768, EAGLE-1 all; 0: all)
    feature_layers: list[int] | None = None  # EAGLE-3: target hidden_states indices fused (None: [2, L//2, L-3])
    norm_before_residual: bool = False  # EAGLE-3: residual from hidden_norm(h), not h (speculators; vLLM, not SGLang)
    norm_before_fc: bool = False  # EAGLE-3: one RMSNorm over the fused features before fc (speculators; vLLM, SGLang)

    @property
    def kind(self) -> str:
        """The drafter family this recipe trains (heads/families)."""
        return "eagle3" if self.version == 3 else "eagle"

    def __post_init__(self) -> None:
        if self.max_steps is None:  # the demo's budget: EAGLE-3's steps unroll ttt_steps drafts, so cost more
            self.max_steps = 800 if self.version == 3 else 2400
        if self.max_minutes is None:
            self.max_minutes = 20.0 if self.version == 3 else 10.5
        super().__post_init__()
        check_at_least(self, ("num_layers", "tune_prompts", "tune_new_tokens"), 1)
        check_at_least(self, ("w_cls", "noise", "depth", "top_k", "total_tokens", "feature_shard_examples"), 0)
        for name in ("tune_depths", "tune_top_ks", "tune_totals"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ConfigError(f"--{name} must list positive numbers (e.g. 2,4,8), got {getattr(self, name)}")
        if self.version not in (1, 3):
            raise ConfigError(f"--version must be 1 (EAGLE-1/2) or 3 (EAGLE-3), got {self.version}")
        if self.ttt_steps < 1:
            raise ConfigError(f"--ttt_steps must be >= 1, got {self.ttt_steps}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise ConfigError(f"--draft_vocab_size must be >= 0 (0: the target's whole vocabulary), got "
                              f"{self.draft_vocab_size}")
        widest = max(self.tune_top_ks + [self.top_k])
        if self.draft_vocab_size and self.draft_vocab_size < widest:
            raise ConfigError(f"--draft_vocab_size {self.draft_vocab_size} is below top_k {widest} (the tree drafts "
                              f"top_k tokens per node): use at least {widest}, or 0 for the whole vocabulary")
        for name in ("norm_before_residual", "norm_before_fc"):
            if self.version == 1 and getattr(self, name):
                raise ConfigError(f"--{name} is an EAGLE-3 variant: add --version 3, or leave it false")
        if self.version == 1 and (self.ttt_steps != 7 or self.feature_layers is not None):
            raise ConfigError("--ttt_steps and --feature_layers apply to EAGLE-3: add --version 3, or drop them")
        if self.version == 3 and (self.num_layers != 1 or self.fc_bias):
            raise ConfigError("an EAGLE-3 drafter has one decoder layer and no fc bias (the layout vLLM and SGLang "
                              "load): drop --num_layers and --fc_bias, or use --version 1")
        if self.fc_bias is None:
            self.fc_bias = self.version == 1
        layers = self.feature_layers
        if layers is not None and (not layers or any(b <= a for a, b in zip(layers, layers[1:]))):
            raise ConfigError(f"--feature_layers must be distinct hidden_states indices from low to high (e.g. "
                              f"2,4,5), got {layers}")
        if self.version == 3 and self.output_dir == "outputs/eagle-demo":
            self.output_dir = "outputs/eagle3-demo"  # the default folder names the method
        given = [self.depth > 0, self.top_k > 0, self.total_tokens > 0]
        if any(given) and not all(given):
            raise ConfigError("set all of depth, top_k and total_tokens (a fixed tree) or none of them (fit here)")


class EagleMethod(MethodBase):
    label = "the EAGLE drafter"

    def __init__(self, cfg: EagleConfig, target, draft: EagleDraft, tune_prompts: list[torch.Tensor]) -> None:
        self.cfg, self.target, self.trainable, self.tune_prompts = cfg, target, draft, tune_prompts
        # an EAGLE-1/2 draft vocabulary (fixed for the run; read here, before an engine wraps the drafter)
        rows = family(draft.config.kind).vocabulary == "rows" and draft.config.draft_vocab_size
        self.draft_ids = draft.draft_ids.clone() if rows else None
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.chunk = chunk_rows(self.lm_head.weight.shape[0])  # positions projected onto the vocabulary at a time

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
        pred = self.module(inputs, batch["input_ids"][:, 1:], self.embed, attention_mask=block_causal_mask(pairs),
                              position_ids=positions(batch)[:, :-1])
        keep = medusa_labels(batch["input_ids"], batch["loss_mask"], 0, seq)[1][:, :-1] & (pairs >= 0)
        return pred[keep], feats[:, 1:][keep]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's frozen lm_head on (predicted) features, as float32."""
        return self.lm_head(features.to(self.lm_head.weight.dtype)).float()

    def _ranked(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's RANKS best target tokens per row (C, RANKS): among its draft vocabulary when it has one,
        since it never drafts the others."""
        if self.draft_ids is None:
            return logits.topk(RANKS, dim=-1).indices
        ids = self.draft_ids.to(logits.device)
        ranked = ids[logits[:, ids].topk(min(RANKS, ids.numel()), dim=-1).indices]
        return F.pad(ranked, (0, RANKS - ranked.shape[1]), value=-1)  # -1: no token, for vocabularies under RANKS

    def _cls_sum(self, pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
        """The soft-label cross-entropy of a chunk of pairs, summed: the target's distribution at the true
        feature against the drafter's at the predicted one."""
        with torch.no_grad():
            p = self.logits(true).softmax(-1)  # (C, V)
        return -(p * self.logits(pred).log_softmax(-1)).sum()

    def _eval_sums(self, pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
        """(3 + RANKS,) float64 for a chunk of pairs: feature regression (mean over H, summed over pairs), soft
        cross-entropy, pairs, and how often the target's top token is the drafter's r-th choice (r < RANKS)."""
        target, logits = self.logits(true), self.logits(pred)  # (C, V) each
        reg = F.smooth_l1_loss(pred.float(), true.float(), reduction="none").mean(-1).sum()
        cls = -(target.softmax(-1) * logits.log_softmax(-1)).sum()
        hits = (self._ranked(logits) == target.argmax(-1, keepdim=True)).sum(0)
        return torch.cat([torch.stack([reg, cls]).double(), reg.new_tensor([pred.shape[0]], dtype=torch.float64),
                          hits.double()])

    def loss(self, batch: dict[str, torch.Tensor], step: StepContext = FIRST_STEP) -> StepOutput:
        pred, true = self._predict(batch, self.cfg.noise)
        if pred.shape[0] == 0:
            zero = pred.sum() * 0.0
            return StepOutput(zero, {"loss": zero.detach(), "reg_loss": zero.detach(), "cls_loss": zero.detach()})
        reg = F.smooth_l1_loss(pred.float(), true.float())
        cls = chunked_sum(self._cls_sum, (pred, true), self.chunk) / pred.shape[0]
        total = reg + self.cfg.w_cls * cls
        return StepOutput(total, {"loss": total.detach(), "reg_loss": reg.detach(), "cls_loss": cls.detach()})

    def evaluate(self, batches: list[dict[str, torch.Tensor]],
                 total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """Validation metrics of `batches`; `total` sums a tensor over processes (each evaluating its share)."""
        sums = torch.zeros(3 + RANKS, dtype=torch.float64, device=self.lm_head.weight.device)
        for batch in batches:
            sums += chunked_sum(self._eval_sums, self._predict(batch, 0.0), self.chunk)
        sums = (total(sums) if total else sums).cpu()
        reg, cls, count, hits = float(sums[0]), float(sums[1]), max(float(sums[2]), 1.0), sums[3:]
        metrics = {"loss": (reg + self.cfg.w_cls * cls) / count, "reg_loss": reg / count, "cls_loss": cls / count,
                   "top1": float(hits[0] / count), "top5": float(hits[:5].sum() / count)}
        for r in range(RANKS):
            metrics[f"rank_acc/{r}"] = float(hits[r] / count)
        return metrics

    def save(self, draft: EagleDraft, output_dir: Path, metrics: dict[str, float]) -> None:
        """Fit the dynamic tree here (unless the recipe sets it) and save the drafter with its validation."""
        cfg = self.cfg
        grid = eagle_grid(cfg.tune_depths, cfg.tune_top_ks, cfg.tune_totals)
        fit = (lambda: fit_dynamic_tree(self.target, draft, self.tune_prompts, grid, cfg.tune_new_tokens,
                                        "dynamic tree")) if self.tune_prompts else None
        save_with_tree(draft, output_dir, cfg, metrics, self.summary(metrics), fit)

    def summary(self, metrics: dict[str, float]) -> str:
        return f"top-1 agreement with the target {metrics['top1']:.3f}, top-5 {metrics['top5']:.3f}"


class Eagle3Method(EagleMethod):
    """EAGLE-3: the training-time test over fused features (heads/eagle3.py, train/step_loss.py); tree fitting and saving as EAGLE."""

    label = "the EAGLE-3 drafter"

    def __init__(self, cfg: EagleConfig, target, draft: Eagle3Draft, tune_prompts: list[torch.Tensor]) -> None:
        super().__init__(cfg, target, draft, tune_prompts)
        self.layers = draft.config.feature_layers

    def _unroll(self, batch: dict[str, torch.Tensor]):
        """The drafter's outputs per step and the target's last hidden states (B, T, H), from online or cached
        features; the target's lm_head projects only the positions that carry a label (in StepLoss)."""
        feats = batch_features(self.target, batch, self.layers, self.timer)
        hidden = self.lm_head.weight.shape[1]
        ttt = StepLoss(self.trainable, self.cfg.ttt_steps, self.lm_head, self.chunk, runner=self.module,
                       agree=self.agree)
        return ttt, ttt.unroll(feats[..., :-hidden], batch, self.embed, unroll=self.cfg.ttt_steps), feats[..., -hidden:]

    def loss(self, batch: dict[str, torch.Tensor], step: StepContext = FIRST_STEP) -> StepOutput:
        ttt, outputs, target = self._unroll(batch)
        return StepOutput(*ttt.loss(outputs, target, batch))

    def evaluate(self, batches: list[dict[str, torch.Tensor]],
                 total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """Validation metrics of `batches`; `total` sums a tensor over processes (each evaluating its share).
        "loss" is the mean of the batch losses over batches with trained tokens."""
        return step_metrics(batches, self._unroll, self.cfg.ttt_steps, self.lm_head.weight.device, total,
                            lambda i: f"step{i}_top1")

    def summary(self, metrics: dict[str, float]) -> str:
        steps = " / ".join(f"{metrics[f'step{i}_top1']:.3f}" for i in range(self.cfg.ttt_steps))
        return (f"top-1 agreement with the target per draft step {steps}; simulated acceptance length "
                f"{metrics['sim_accept']:.2f} (chain, teacher-forced)")


def new_draft(cfg: EagleConfig, target) -> EagleDraft | Eagle3Draft:
    """The recipe's drafter for this target, freshly initialised, its draft vocabulary sized but not chosen:
    what training starts from and what the memory planner builds on the meta device."""
    vocab = target.get_output_embeddings().weight.shape[0]
    size = draft_vocab_size(cfg.draft_vocab_size, vocab, default=cfg.version == 3)
    if cfg.version == 1:
        return EagleDraft(heads_config(cfg, target, "eagle", num_layers=cfg.num_layers, fc_bias=cfg.fc_bias,
                                       layer=layer_fields(target.config), draft_vocab_size=size))
    layers = fused_layers(cfg.feature_layers, target)
    return Eagle3Draft(heads_config(cfg, target, "eagle3", num_layers=1, fc_bias=False,
                                    layer=layer_fields(target.config), feature_layers=layers, draft_vocab_size=size,
                                    norm_before_residual=cfg.norm_before_residual, norm_before_fc=cfg.norm_before_fc))


def build_drafter(cfg: EagleConfig, target, train_data: Examples) -> EagleDraft | Eagle3Draft:
    """An EAGLE-1 drafter, or (version 3) an EAGLE-3 drafter initialised from the target; either's draft
    vocabulary is the most frequent loss-bearing tokens of the training data."""
    draft = new_draft(cfg, target)
    size = draft.config.draft_vocab_size
    if size:
        draft.set_draft_vocab(draft_vocabulary(train_data.token_batches(), draft.config.vocab_size, size))
    if cfg.version == 3:
        init_from_target(draft, target)
    return draft


def run(cfg: EagleConfig) -> dict:
    """Set up, train and save; returns the target, the trained drafter and the validation history."""
    method = Eagle3Method if cfg.version == 3 else EagleMethod
    return run_feature_drafter(cfg, lambda target, tokenizer, data: build_drafter(cfg, target, data),
                               lambda target, draft, prompts: method(cfg, target, draft, prompts))


def main(argv: list[str] | None = None) -> None:
    """The script: options from the command line; a user error ends in one line (exit 2)."""
    run_main(lambda args: run(load_config(EagleConfig, args)), argv, prog="train/eagle.py")


if __name__ == "__main__":
    main()
