"""The EAGLE recipe's options (EagleConfig, EAGLE-1/2 and EAGLE-3) and its drafter, built for a target."""

from __future__ import annotations

import dataclasses

from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle import EagleDraft
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.train.data.examples import Examples
from selfspec.train.data.vocabulary import draft_vocabulary, init_from_target
from selfspec.train.loop.config import ConfigError, check_at_least, option
from selfspec.train.loop.training import heads_config
from selfspec.train.recipes.draft_shape import draft_vocab_size, fused_layers
from selfspec.train.recipes.feature_config import FeatureRunConfig


@dataclasses.dataclass
class EagleConfig(FeatureRunConfig):
    """Train an EAGLE drafter on a frozen causal LM (defaults: the demo target on CPU, under 15 minutes)."""

    output_dir: str = "outputs/eagle-demo"
    max_steps: int | None = option(
        None,
        "optimizer steps (None: 2400 for EAGLE-1, 800 for EAGLE-3: 10 / 17 minutes here)",
    )
    max_minutes: float | None = option(
        None,
        "stop a slower machine in time (None: 10.5 for EAGLE-1, 20 for EAGLE-3)",
    )
    max_grad_norm: float = 0.5
    warmup_ratio: float = 0.02
    eval_steps: int = 250
    num_layers: int = option(1, "draft decoder layers")
    fc_bias: bool | None = option(
        None,
        "bias on the 2H -> H input projection (None: EAGLE-1 yes, EAGLE-3 has none; vLLM's EAGLE-1 drops "
        "it: false)",
    )
    w_cls: float = option(0.1, "weight of the soft-label token loss next to the feature regression")
    noise: float = option(0.1, "uniform U(-noise, noise) added to the input features while training")
    tune_depths: list[int] = option(factory=lambda: [3, 4, 5, 6, 8], help="the grid fitted over")
    tune_top_ks: list[int] = option(factory=lambda: [2, 4, 8], help="top_k values fitted over")
    version: int = option(
        1,
        "1: EAGLE-1/2 (feature regression + soft labels); 3: EAGLE-3 (fused layers, training-time test)",
    )
    ttt_steps: int = option(
        7,
        "EAGLE-3: draft steps unrolled per sequence in training (the training-time test)",
    )
    # FR-Spec for EAGLE-1/2: draft calls read only these rows of the target's lm_head
    draft_vocab_size: int | None = option(
        None,
        "drafts among the N most frequent trained tokens (None: EAGLE-3 vocab/4 in 2048..32768, EAGLE-1 "
        "all; 0: all)",
    )
    feature_layers: list[int] | None = option(
        None,
        "EAGLE-3: target hidden_states indices fused (None: [2, L//2, L-3])",
    )
    norm_before_residual: bool = option(
        False,
        "EAGLE-3: residual from hidden_norm(h), not h (speculators; vLLM, not SGLang)",
    )
    norm_before_fc: bool = option(
        False,
        "EAGLE-3: one RMSNorm over the fused features before fc (speculators; vLLM, SGLang)",
    )

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
        check_at_least(
            self, ("w_cls", "noise", "depth", "top_k", "total_tokens", "feature_shard_examples"), 0
        )
        for name in ("tune_depths", "tune_top_ks", "tune_totals"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ConfigError(
                    f"--{name} must list positive numbers (e.g. 2,4,8), got {getattr(self, name)}"
                )
        if self.version not in (1, 3):
            raise ConfigError(f"--version must be 1 (EAGLE-1/2) or 3 (EAGLE-3), got {self.version}")
        if self.ttt_steps < 1:
            raise ConfigError(f"--ttt_steps must be >= 1, got {self.ttt_steps}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise ConfigError(
                f"--draft_vocab_size must be >= 0 (0: the target's whole vocabulary), got "
                f"{self.draft_vocab_size}"
            )
        widest = max(self.tune_top_ks + [self.top_k])
        if self.draft_vocab_size and self.draft_vocab_size < widest:
            raise ConfigError(
                f"--draft_vocab_size {self.draft_vocab_size} is below top_k {widest} (the tree drafts "
                f"top_k tokens per node): use at least {widest}, or 0 for the whole vocabulary"
            )
        for name in ("norm_before_residual", "norm_before_fc"):
            if self.version == 1 and getattr(self, name):
                raise ConfigError(f"--{name} is an EAGLE-3 variant: add --version 3, or leave it false")
        if self.version == 1 and (self.ttt_steps != 7 or self.feature_layers is not None):
            raise ConfigError(
                "--ttt_steps and --feature_layers apply to EAGLE-3: add --version 3, or drop them"
            )
        if self.version == 3 and (self.num_layers != 1 or self.fc_bias):
            raise ConfigError(
                "an EAGLE-3 drafter has one decoder layer and no fc bias (the layout vLLM and SGLang "
                "load): drop --num_layers and --fc_bias, or use --version 1"
            )
        if self.fc_bias is None:
            self.fc_bias = self.version == 1
        layers = self.feature_layers
        if layers is not None and (not layers or any(b <= a for a, b in zip(layers, layers[1:]))):
            raise ConfigError(
                f"--feature_layers must be distinct hidden_states indices from low to high (e.g. "
                f"2,4,5), got {layers}"
            )
        if self.version == 3 and self.output_dir == "outputs/eagle-demo":
            self.output_dir = "outputs/eagle3-demo"  # the default folder names the method
        given = [self.depth > 0, self.top_k > 0, self.total_tokens > 0]
        if any(given) and not all(given):
            raise ConfigError(
                "set all of depth, top_k and total_tokens (a fixed tree) or none of them (fit here)"
            )


def new_draft(cfg: EagleConfig, target) -> EagleDraft | Eagle3Draft:
    """The recipe's drafter for this target, freshly initialised, its draft vocabulary sized but not chosen:
    what training starts from and what the memory planner builds on the meta device."""
    vocab = target.get_output_embeddings().weight.shape[0]
    size = draft_vocab_size(cfg.draft_vocab_size, vocab, default=cfg.version == 3)
    if cfg.version == 1:
        return EagleDraft(
            heads_config(
                cfg,
                target,
                "eagle",
                num_layers=cfg.num_layers,
                fc_bias=cfg.fc_bias,
                layer=layer_fields(target.config),
                draft_vocab_size=size,
            )
        )
    layers = fused_layers(cfg.feature_layers, target)
    return Eagle3Draft(
        heads_config(
            cfg,
            target,
            "eagle3",
            num_layers=1,
            fc_bias=False,
            layer=layer_fields(target.config),
            feature_layers=layers,
            draft_vocab_size=size,
            norm_before_residual=cfg.norm_before_residual,
            norm_before_fc=cfg.norm_before_fc,
        )
    )


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
