"""The P-EAGLE recipe's options (PEagleConfig) and its drafter, built for a target."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.peagle import PEagleDraft
from selfspec.train.data.examples import Examples
from selfspec.train.data.vocabulary import choose_mask_token, draft_vocabulary, init_from_target
from selfspec.train.loop.config import ConfigError, check_at_least, option
from selfspec.train.loop.training import heads_config
from selfspec.train.recipes.draft_shape import draft_vocab_size, fused_layers
from selfspec.train.recipes.feature_config import FeatureRunConfig


@dataclasses.dataclass
class PEagleConfig(FeatureRunConfig):
    """Train a P-EAGLE drafter on a frozen causal LM (defaults: the demo target on CPU, about 20 minutes)."""

    kind: ClassVar[str] = "peagle"  # the drafter family this recipe trains (heads/families)

    output_dir: str = "outputs/peagle-demo"
    max_steps: int = option(800, "optimizer steps")
    max_minutes: float = option(20.0, "stop a slower machine in time")
    max_grad_norm: float = 0.5
    warmup_ratio: float = 0.02
    eval_steps: int = 250
    depths: int = option(
        6,
        "tokens one drafter forward proposes (vLLM's num_speculative_tokens for the export)",
    )
    cod_ratio: float = option(
        0.7,
        "depth d trains at max(cod_ratio^d, cod_min_ratio) of depth d - 1's positions",
    )
    cod_min_ratio: float = 0.2
    draft_vocab_size: int | None = option(
        None,
        "drafts among the N most frequent trained tokens (None: vocab/4 in 2048..32768)",
    )
    feature_layers: list[int] | None = option(
        None,
        "target hidden_states indices fused (None: [2, L//2, L-3])",
    )
    norm_before_residual: bool = option(
        False,
        "residual from hidden_norm(h), not h (speculators' P-EAGLE default in vLLM)",
    )
    norm_before_fc: bool = option(False, "one RMSNorm over the fused features before fc")
    mask_token_id: int | None = option(
        None,
        "the token id vLLM feeds the parallel slots (None: one the data never has)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, ("depths", "tune_prompts", "tune_new_tokens"), 1)
        check_at_least(self, ("depth", "top_k", "total_tokens", "feature_shard_examples"), 0)
        if not 0 < self.cod_min_ratio <= 1 or not 0 < self.cod_ratio <= 1:
            raise ConfigError(
                f"--cod_ratio and --cod_min_ratio must be in (0, 1], got {self.cod_ratio} and "
                f"{self.cod_min_ratio}"
            )
        for name in ("tune_top_ks", "tune_totals"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ConfigError(
                    f"--{name} must list positive numbers (e.g. 1,2,4), got {getattr(self, name)}"
                )
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise ConfigError(
                f"--draft_vocab_size must be >= 0 (0: the whole vocabulary), got {self.draft_vocab_size}"
            )
        given = [self.depth > 0, self.top_k > 0, self.total_tokens > 0]
        if any(given) and not all(given):
            raise ConfigError(
                "set all of depth, top_k and total_tokens (a fixed tree) or none of them (fit here)"
            )
        layers = self.feature_layers
        if layers is not None and (not layers or any(b <= a for a, b in zip(layers, layers[1:]))):
            raise ConfigError(
                f"--feature_layers must be distinct hidden_states indices from low to high (e.g. "
                f"2,4,5), got {layers}"
            )

    def grid(self) -> list[tuple[int, int, int]]:
        """The (depth, top_k, total_tokens) settings fitted: chains of half and all the depths, trees of each
        size."""
        settings = []
        for depth in sorted({max(1, self.depths // 2), self.depths}):
            for k in self.tune_top_ks:
                totals = [depth] if k == 1 else [t for t in self.tune_totals if t > depth]
                settings += [(depth, k, t) for t in totals]
        return settings


def new_draft(cfg: PEagleConfig, target, mask_token_id: int) -> PEagleDraft:
    """The recipe's drafter for this target, freshly initialised, its draft vocabulary sized but not
    chosen."""
    size = draft_vocab_size(cfg.draft_vocab_size, target.get_output_embeddings().weight.shape[0])
    layers = fused_layers(cfg.feature_layers, target)
    return PEagleDraft(
        heads_config(
            cfg,
            target,
            "peagle",
            num_layers=1,
            fc_bias=False,
            layer=layer_fields(target.config),
            feature_layers=layers,
            draft_vocab_size=size,
            norm_before_residual=cfg.norm_before_residual,
            norm_before_fc=cfg.norm_before_fc,
            mask_token_id=mask_token_id,
            depth=cfg.depths,
            top_k=1,
            total_tokens=cfg.depths,
        )
    )


def build_drafter(cfg: PEagleConfig, target, tokenizer, train_data: Examples) -> PEagleDraft:
    """A P-EAGLE drafter initialised from the target: its draft vocabulary the most frequent trained tokens,
    its lm_head the target's rows of them, its mask embedding the target's mean token embedding."""
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
