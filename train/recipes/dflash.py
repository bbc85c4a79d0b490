"""The DFlash recipe's options (DFlashConfig) and its drafter, built for a target."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from selfspec.heads.dflash import DEFAULT_FEATURES, DFlashDraft, default_target_layer_ids
from selfspec.heads.draft_layers import layer_fields
from selfspec.train.data.examples import Examples
from selfspec.train.data.vocabulary import choose_mask_token
from selfspec.train.loop.config import ConfigError, check_at_least, option
from selfspec.train.loop.training import heads_config
from selfspec.train.methods.dflash_loss import (
    LOSSES,
    WEIGHTINGS,
)
from selfspec.train.recipes.feature_config import FeatureRunConfig


@dataclasses.dataclass
class DFlashConfig(FeatureRunConfig):
    """Train a DFlash drafter on a frozen causal LM (defaults: the demo target on CPU, about 20 minutes)."""

    kind: ClassVar[str] = "dflash"  # the drafter family this recipe trains (heads/families)

    output_dir: str = "outputs/dflash-demo"
    max_steps: int = option(1200, "optimizer steps")
    max_minutes: float = option(20.0, "stop a slower machine in time")
    learning_rate: float = 6e-4
    warmup_ratio: float = 0.04
    eval_steps: int = 200
    eval_batches: int = option(
        4,
        "validation drafts a block at every position: 4 batches of 8 take about a minute on CPU",
    )
    save_steps: int = 400
    num_layers: int = option(0, "draft decoder layers (0: 5 for targets of 24+ layers, else 2)")
    block_size: int = option(16, "one draft forward fills block_size - 1 masked positions")
    anchors: int = option(32, "blocks drafted per sequence per training step")
    mask_token_id: int | None = option(
        None,
        "the masked positions' embedding row (None: a token the data never has)",
    )
    target_layer_ids: list[int] | None = option(
        None,
        "decoder layers whose outputs are fused (published convention)",
    )
    num_target_layers: int = option(
        DEFAULT_FEATURES,
        "how many, spaced as published, when target_layer_ids is None",
    )
    qk_norm: bool = option(
        True,
        "per-head q/k RMSNorm before RoPE: the published DFlash layers are Qwen3's for any target",
    )
    loss: str = option(
        "ce",
        "ce: cross-entropy with the (target's own) tokens | kl: KL from the target's distribution",
    )
    loss_weighting: str = option("decay", "decay: exp(-(j-1)/gamma) per block position | dpace: D-PACE")
    decay_gamma: float | None = option(None, "None: 7 for blocks of 16, in proportion otherwise")
    dpace_alpha: float = 0.5
    tune_depths: list[int] | None = option(
        None,
        "depths fitted over (None: block_size // 2 - 1 and block_size - 1)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, ("anchors", "num_target_layers", "tune_prompts", "tune_new_tokens"), 1)
        check_at_least(self, ("num_layers", "depth", "top_k", "total_tokens", "feature_shard_examples"), 0)
        if self.block_size < 2:
            raise ConfigError(
                f"--block_size must be >= 2 (the last accepted token and a mask), got {self.block_size}"
            )
        if self.loss not in LOSSES:
            raise ConfigError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.loss_weighting not in WEIGHTINGS:
            raise ConfigError(
                f"--loss_weighting must be one of {', '.join(WEIGHTINGS)}, got {self.loss_weighting!r}"
            )
        if self.decay_gamma is None:
            self.decay_gamma = 7.0 * (self.block_size - 1) / 15
        if self.decay_gamma <= 0 or not 0 <= self.dpace_alpha <= 1:
            raise ConfigError(
                f"--decay_gamma must be > 0 and --dpace_alpha in [0, 1], got {self.decay_gamma} and "
                f"{self.dpace_alpha}"
            )
        if self.tune_depths is None:
            self.tune_depths = sorted({max(1, self.block_size // 2 - 1), self.block_size - 1})
        for name in ("tune_depths", "tune_top_ks", "tune_totals"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ConfigError(
                    f"--{name} must list positive numbers (e.g. 1,2,4), got {getattr(self, name)}"
                )
        deepest = max(self.tune_depths + [self.depth])
        if deepest > self.block_size - 1:
            raise ConfigError(
                f"a block of {self.block_size} drafts {self.block_size - 1} positions: depth {deepest} "
                f"is deeper (--tune_depths, --depth)"
            )
        given = [self.depth > 0, self.top_k > 0, self.total_tokens > 0]
        if any(given) and not all(given):
            raise ConfigError(
                "set all of depth, top_k and total_tokens (a fixed tree) or none of them (fit here)"
            )
        ids = self.target_layer_ids
        if ids is not None and (not ids or min(ids) < 0 or any(b <= a for a, b in zip(ids, ids[1:]))):
            raise ConfigError(
                f"--target_layer_ids must be distinct decoder layer indices from low to high, got {ids}"
            )

    def grid(self) -> list[tuple[int, int, int]]:
        """The (depth, top_k, total_tokens) settings fitted: the chain at each depth, trees of each size."""
        settings = []
        for depth in self.tune_depths:
            for k in self.tune_top_ks:
                totals = [depth] if k == 1 else [t for t in self.tune_totals if t > depth]
                settings += [(depth, k, t) for t in totals]
        return settings


def build_drafter(cfg: DFlashConfig, target, tokenizer, train_data: Examples) -> DFlashDraft:
    """A DFlash drafter for this target: the published layer spacing, Llama-shaped layers of the target's
    widths (with Qwen3's q/k norms unless --qk_norm false: the layout vLLM and SGLang build)."""
    text = target.config.get_text_config()
    L = text.num_hidden_layers
    ids = cfg.target_layer_ids or default_target_layer_ids(L, cfg.num_target_layers)
    if max(ids) > L - 2:
        raise ConfigError(
            f"--target_layer_ids must be decoder layers 0..{L - 2} of this {L}-layer target (the last "
            f"one's output is already normed), got {ids}"
        )
    vocab = target.get_output_embeddings().weight.shape[0]
    fields = dict(
        num_layers=cfg.num_layers or (5 if L >= 24 else 2),
        layer=layer_fields(target.config),
        feature_layers=[i + 1 for i in ids],
        block_size=cfg.block_size,
        qk_norm=cfg.qk_norm,
        mask_token_id=choose_mask_token(cfg, tokenizer, train_data, vocab),
        depth=cfg.block_size - 1,
        top_k=1,
        total_tokens=cfg.block_size - 1,
    )
    return DFlashDraft(heads_config(cfg, target, "dflash", **fields))
