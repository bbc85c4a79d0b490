"""Train a P-EAGLE drafter (parallel EAGLE, heads/peagle.py) on a frozen causal LM.

    accelerate launch train/peagle.py                        # demo target, its own answers, CPU, about 20 min
    accelerate launch train/peagle.py --config configs/peagle/demo.yaml

The drafter is EAGLE-3's body; one forward drafts `depths` tokens: depth 0 from the pairs (fused target features,
next token), depths 1 .. K - 1 from parallel slots reading a learned mask embedding and hidden state. Training runs
every depth over whole sequences in one pass (PEagleDraft.parallel), with the depth subsampling of P-EAGLE's
recipe (speculators' "COD"): depth 0 trains at every position, depth d at a random max(ratio^d, min_ratio) of the
positions depth d - 1 kept, so deep depths cost a fraction of a full pass. Depth d at position t learns the
target's distribution for x_{t+2+d}, restricted to the draft vocabulary (train/step_loss.py, weights 0.8^d).
At the end the chain or tree (depth, top_k, total_tokens) is fitted to this machine by decoding validation prompts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch

from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.errors import run_main
from selfspec.heads.peagle import PEagleDraft
from selfspec.train.config import ConfigError, check_at_least, load_config
from selfspec.train.data import Examples
from selfspec.train.draft_shape import draft_vocab_size, fused_layers
from selfspec.train.eagle_features import batch_features
from selfspec.train.feature_run import run_feature_drafter
from selfspec.train.loop import heads_config
from selfspec.train.medusa_method import chunk_rows
from selfspec.train.method import FIRST_STEP, MethodBase, StepContext, StepOutput
from selfspec.train.step_loss import StepLoss, step_metrics
from selfspec.train.train_config import TrainConfig
from selfspec.train.tree_fit import fit_dynamic_tree, save_with_tree
from selfspec.train.vocabulary import choose_mask_token, draft_vocabulary, init_from_target


@dataclasses.dataclass
class PEagleConfig(TrainConfig):
    """Train a P-EAGLE drafter on a frozen causal LM (defaults: the demo target on CPU, about 20 minutes)."""

    kind: ClassVar[str] = "peagle"  # the drafter family this recipe trains (heads/families)

    output_dir: str = "outputs/peagle-demo"
    max_steps: int = 800  # optimizer steps
    max_minutes: float = 20.0  # stop a slower machine in time
    learning_rate: float = 1e-3
    adam_beta2: float = 0.95
    max_grad_norm: float = 0.5
    warmup_ratio: float = 0.02
    max_length: int = 192
    per_device_train_batch_size: int = 8
    mixed_precision: str = "auto"  # auto: bf16 on a GPU with bf16 or a CPU with AMX, float32 elsewhere
    self_distill: bool = True  # learn what the target itself says (the demos' shared self-distilled set)
    max_train_examples: int = 1024
    eval_steps: int = 250
    save_steps: int = 500
    depths: int = 6  # tokens one drafter forward proposes (vLLM's num_speculative_tokens for the export)
    cod_ratio: float = 0.7  # depth d trains at max(cod_ratio^d, cod_min_ratio) of depth d - 1's positions
    cod_min_ratio: float = 0.2
    draft_vocab_size: int | None = None  # drafts among the N most frequent trained tokens (None: vocab/4 in 2048..32768)
    feature_layers: list[int] | None = None  # target hidden_states indices fused (None: [2, L//2, L-3])
    norm_before_residual: bool = False  # residual from hidden_norm(h), not h (speculators' P-EAGLE default in vLLM)
    norm_before_fc: bool = False  # one RMSNorm over the fused features before fc
    mask_token_id: int | None = None  # the token id vLLM feeds the parallel slots (None: one the data never has)
    cache_features: bool = False  # compute the target's features once and keep them on disk for every epoch
    feature_shard_examples: int = 0  # with cache_features: examples per shard file (0: about 256 MiB each)
    depth: int = 0  # the decoding tree stored with the drafter; 0 fits depth, top_k and total_tokens here
    top_k: int = 0  # children per drafted depth (1: the chain)
    total_tokens: int = 0  # drafted nodes kept for verification
    tune_top_ks: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 4])  # 1 is the chain
    tune_totals: list[int] = dataclasses.field(default_factory=lambda: [16, 32])  # tree sizes fitted over (top_k > 1)
    tune_prompts: int = 6  # validation prompts decoded per setting when fitting
    tune_new_tokens: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, ("depths", "tune_prompts", "tune_new_tokens"), 1)
        check_at_least(self, ("depth", "top_k", "total_tokens", "feature_shard_examples"), 0)
        if not 0 < self.cod_min_ratio <= 1 or not 0 < self.cod_ratio <= 1:
            raise ConfigError(f"--cod_ratio and --cod_min_ratio must be in (0, 1], got {self.cod_ratio} and "
                              f"{self.cod_min_ratio}")
        for name in ("tune_top_ks", "tune_totals"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ConfigError(f"--{name} must list positive numbers (e.g. 1,2,4), got {getattr(self, name)}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise ConfigError(f"--draft_vocab_size must be >= 0 (0: the whole vocabulary), got {self.draft_vocab_size}")
        given = [self.depth > 0, self.top_k > 0, self.total_tokens > 0]
        if any(given) and not all(given):
            raise ConfigError("set all of depth, top_k and total_tokens (a fixed tree) or none of them (fit here)")
        layers = self.feature_layers
        if layers is not None and (not layers or any(b <= a for a, b in zip(layers, layers[1:]))):
            raise ConfigError(f"--feature_layers must be distinct hidden_states indices from low to high (e.g. "
                              f"2,4,5), got {layers}")

    def grid(self) -> list[tuple[int, int, int]]:
        """The (depth, top_k, total_tokens) settings fitted: chains of half and all the depths, trees of each size."""
        settings = []
        for depth in sorted({max(1, self.depths // 2), self.depths}):
            for k in self.tune_top_ks:
                totals = [depth] if k == 1 else [t for t in self.tune_totals if t > depth]
                settings += [(depth, k, t) for t in totals]
        return settings


def subsampled(valid: torch.Tensor, depths: int, ratio: float, min_ratio: float,
               generator: torch.Generator | None = None) -> list[torch.Tensor | None]:
    """The positions each depth trains at (B, T) bool: depth 0 at `valid`, depth d at a random max(ratio^d,
    min_ratio) of depth d - 1's (P-EAGLE's depth subsampling); depth 0's entry is None (every position)."""
    kept, anchors = valid, [None]
    for d in range(1, depths):
        draw = torch.rand(valid.shape, generator=generator, device=valid.device)
        kept = kept & (draw < max(ratio**d, min_ratio))
        anchors.append(kept)
    return anchors


class PEagleMethod(MethodBase):
    """P-EAGLE's loss, validation and save for the shared training loop (train/loop.py)."""

    label = "the P-EAGLE drafter"
    best_metric = "sim_accept"  # the loop saves the weights of the best validation by this

    def __init__(self, cfg: PEagleConfig, target, draft: PEagleDraft, tune_prompts: list[torch.Tensor]) -> None:
        self.cfg, self.target, self.trainable, self.tune_prompts = cfg, target, draft, tune_prompts
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.chunk = chunk_rows(self.lm_head.weight.shape[0])
        self.layers = draft.config.feature_layers

    def _depths(self, batch: dict[str, torch.Tensor], subsample: bool):
        """The loss object, every depth's outputs (B, T-1, H) and the target's last hidden states (B, T, H)."""
        feats = batch_features(self.target, batch, self.layers, self.timer)
        hidden = self.lm_head.weight.shape[1]
        loss = StepLoss(self.trainable, self.cfg.depths, self.lm_head, self.chunk, runner=self.module,
                        agree=self.agree)
        anchors = None
        if subsample:
            valid = batch["attention_mask"][:, 1:].bool()
            anchors = subsampled(valid, self.cfg.depths, self.cfg.cod_ratio, self.cfg.cod_min_ratio)
        outputs = loss.unroll(feats[..., :-hidden], batch, self.embed, depths=self.cfg.depths, anchors=anchors)
        return loss, outputs, feats[..., -hidden:], anchors

    def loss(self, batch: dict[str, torch.Tensor], step: StepContext = FIRST_STEP) -> StepOutput:
        loss, outputs, target, anchors = self._depths(batch, subsample=True)
        return StepOutput(*loss.loss(outputs, target, batch, keep=anchors))

    def evaluate(self, batches: list[dict[str, torch.Tensor]],
                 total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """Validation at every position and depth; `total` sums over processes. "sim_accept" is the chain's
        teacher-forced acceptance length: 1 + the leading depths whose top-1 is the target's argmax."""
        return step_metrics(batches, lambda batch: self._depths(batch, subsample=False)[:3], self.cfg.depths,
                            self.lm_head.weight.device, total, lambda d: f"depth{d + 1}_top1")

    def save(self, draft: PEagleDraft, output_dir: Path, metrics: dict[str, float]) -> None:
        """Fit the chain or tree here (unless the recipe sets it; without prompts: the chain of every depth)."""
        cfg = self.cfg
        fit = (lambda: fit_dynamic_tree(self.target, draft, self.tune_prompts, cfg.grid(), cfg.tune_new_tokens,
                                        "P-EAGLE chain/tree")) if self.tune_prompts else None
        chain = {"depth": cfg.depths, "top_k": 1, "total_tokens": cfg.depths}
        save_with_tree(draft, output_dir, cfg, metrics, self.summary(metrics), fit, chain)

    def summary(self, metrics: dict[str, float]) -> str:
        per = " / ".join(f"{metrics[f'depth{d}_top1']:.3f}" for d in range(1, self.cfg.depths + 1))
        return (f"top-1 agreement with the target per depth {per}; simulated acceptance length "
                f"{metrics['sim_accept']:.2f} (chain, teacher-forced)")


def new_draft(cfg: PEagleConfig, target, mask_token_id: int) -> PEagleDraft:
    """The recipe's drafter for this target, freshly initialised, its draft vocabulary sized but not chosen."""
    size = draft_vocab_size(cfg.draft_vocab_size, target.get_output_embeddings().weight.shape[0])
    layers = fused_layers(cfg.feature_layers, target)
    return PEagleDraft(heads_config(
        cfg, target, "peagle", num_layers=1, fc_bias=False, layer=layer_fields(target.config), feature_layers=layers,
        draft_vocab_size=size, norm_before_residual=cfg.norm_before_residual,
        norm_before_fc=cfg.norm_before_fc, mask_token_id=mask_token_id, depth=cfg.depths, top_k=1,
        total_tokens=cfg.depths))


def build_drafter(cfg: PEagleConfig, target, tokenizer, train_data: Examples) -> PEagleDraft:
    """A P-EAGLE drafter initialised from the target: its draft vocabulary the most frequent trained tokens, its
    lm_head the target's rows of them, its mask embedding the target's mean token embedding."""
    vocab = target.get_output_embeddings().weight.shape[0]
    draft = new_draft(cfg, target, choose_mask_token(cfg, tokenizer, train_data, vocab))
    size = draft.config.draft_vocab_size
    if size:
        draft.set_draft_vocab(draft_vocabulary(train_data.token_batches(), draft.config.vocab_size, size))
    init_from_target(draft, target)
    with torch.no_grad():
        embedding = target.get_input_embeddings().weight
        draft.mask_embedding.copy_(embedding.float().mean(0).to(draft.mask_embedding.dtype))
    return draft


def run(cfg: PEagleConfig) -> dict:
    """Set up, train and save; returns the target, the trained drafter and the validation history."""
    return run_feature_drafter(cfg, lambda target, tokenizer, data: build_drafter(cfg, target, tokenizer, data),
                               lambda target, draft, prompts: PEagleMethod(cfg, target, draft, prompts))


def main(argv: list[str] | None = None) -> None:
    """The script: options from the command line; a user error ends in one line (exit 2)."""
    run_main(lambda args: run(load_config(PEagleConfig, args)), argv, prog="train/peagle.py")


if __name__ == "__main__":
    main()
