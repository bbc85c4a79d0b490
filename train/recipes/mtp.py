"""The MTP recipe's options (MtpConfig) and its drafter: the target's own MTP layers, or new ones."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from selfspec.heads.formats.mtp import load_target_mtp, shares_output_norm
from selfspec.heads.mtp import MtpDraft, mtp_layer_count
from selfspec.infer.measure.tune import eagle_grid
from selfspec.train.loop.config import ConfigError, check_at_least, option
from selfspec.train.recipes.feature_config import FeatureRunConfig


@dataclasses.dataclass
class MtpConfig(FeatureRunConfig):
    """Fine-tune a target's MTP layers, or train new ones (defaults: the demo target, one new layer, CPU)."""

    kind: ClassVar[str] = "mtp"  # the drafter family this recipe trains (heads/families)

    output_dir: str = "outputs/mtp-demo"
    new_layers: int = option(
        0,
        "0: the target's own MTP layers (one new layer where it has none); N: N new layers",
    )
    max_steps: int = option(600, "optimizer steps")
    max_minutes: float = option(20.0, "stop a slower machine in time")
    learning_rate: float = 5e-4
    max_grad_norm: float = 0.5
    warmup_ratio: float = 0.02
    eval_steps: int = 200
    save_steps: int = 400
    ttt_steps: int = option(
        3,
        "draft steps unrolled per sequence (the depths decoding reuses MTP layer 0 for)",
    )
    tune_depths: list[int] = option(factory=lambda: [2, 3, 4], help="the grid fitted over")
    tune_totals: list[int] = option(factory=lambda: [8, 16], help="tree sizes (top_k > 1)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, ("ttt_steps", "tune_prompts", "tune_new_tokens"), 1)
        check_at_least(self, ("new_layers", "depth", "top_k", "total_tokens", "feature_shard_examples"), 0)
        for name in ("tune_depths", "tune_top_ks", "tune_totals"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ConfigError(
                    f"--{name} must list positive numbers (e.g. 2,4,8), got {getattr(self, name)}"
                )
        if self.new_layers > 1:
            raise ConfigError(
                "--new_layers above 1: drafting runs MTP layer 0 at every depth (docs/mtp.md), so "
                "further new layers would stay untrained; use --new_layers 1"
            )
        given = [self.depth > 0, self.top_k > 0, self.total_tokens > 0]
        if any(given) and not all(given):
            raise ConfigError(
                "set all of depth, top_k and total_tokens (a fixed tree) or none of them (fit here)"
            )

    def grid(self) -> list[tuple[int, int, int]]:
        """The (depth, top_k, total_tokens) settings fitted: chains of each depth and trees of each size."""
        chains = [(d, 1, d) for d in self.tune_depths] if 1 in self.tune_top_ks else []
        wide = [k for k in self.tune_top_ks if k > 1]
        return chains + (eagle_grid(self.tune_depths, wide, self.tune_totals) if wide else [])


def new_layers(cfg: MtpConfig, target, count: int) -> MtpDraft:
    """`count` new MTP layers for `target`: each decoder block starts from the target's last decoder layer
    where the shapes agree (transformers' initialisation elsewhere)."""
    from selfspec.heads.mtp import mtp_config_for

    config = mtp_config_for(
        target, cfg.model, layers=count, dtype=str(cfg.target_dtype).removeprefix("torch.")
    )
    draft = MtpDraft(config)
    last = target.get_decoder().layers[-1].state_dict()
    for layer in draft.mtp.layers:
        block = layer.mtp_block.state_dict()
        same = {k: v for k, v in last.items() if k in block and block[k].shape == v.shape}
        layer.mtp_block.load_state_dict(same, strict=False)
    return draft


def build_drafter(cfg: MtpConfig, target) -> MtpDraft:
    """The target's own MTP layers, or new ones (see the module docstring), bound to its lm_head."""
    own = mtp_layer_count(target.config)
    if cfg.new_layers or not own:
        count = cfg.new_layers or 1
        if not cfg.new_layers:
            print(
                f"{cfg.model} has no MTP layers of its own: training {count} new one (--new_layers to choose)"
            )
        draft = new_layers(cfg, target, count)
    else:
        draft = load_target_mtp(target, cfg.model)
    for later in draft.mtp.layers[
        1:
    ]:  # kept as the checkpoint has them: drafting runs layer 0 at every depth
        later.requires_grad_(False)
    if shares_output_norm(target):  # Ernie-4.5: the output norm is the target's final norm, frozen with it
        final = target.get_decoder().norm.weight
        for layer in draft.mtp.layers:
            with torch.no_grad():  # new layers start from it too (loaded ones read it from the checkpoint)
                layer.post_norm.weight.copy_(final)
            layer.post_norm.requires_grad_(False)
    return draft.to(torch.float32).bind(target.get_output_embeddings())
