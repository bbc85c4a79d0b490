"""The options every recipe of a drafter trained on the target's features shares (EAGLE-1/2/3, P-EAGLE,
DFlash, MTP). Apart from the run itself (train/recipes/feature_run.py): the data modules that run imports are
typed by these recipes' configs, which would close a circle."""

from __future__ import annotations

import dataclasses

from selfspec.train.loop.config import option
from selfspec.train.loop.train_config import TrainConfig


@dataclasses.dataclass
class FeatureRunConfig(TrainConfig):
    """Options every recipe of a drafter trained on the target's features shares (EAGLE-1/2/3, P-EAGLE,
    DFlash, MTP): the demos' data, the feature cache, and the decoding tree fitted at the end of the run."""

    adam_beta2: float = 0.95
    max_length: int = 192
    per_device_train_batch_size: int = 8
    self_distill: bool = option(
        True,
        "learn what the target itself says: the drafter imitates it at decode time",
    )
    max_train_examples: int = option(1024, "the demos' one self-distilled set (a shared cache)")
    cache_features: bool = option(
        False,
        "compute the target's features once and keep them on disk for every epoch",
    )
    feature_shard_examples: int = option(
        0,
        "with cache_features: examples per shard file (0: about 256 MiB each)",
    )
    depth: int = option(
        0,
        "the decoding tree stored with the drafter; 0 fits depth, top_k and total_tokens to this machine",
    )
    top_k: int = option(0, "children per expanded node (0: fit here; 1: the chain)")
    total_tokens: int = option(0, "drafted nodes kept for verification (0: fit here)")
    tune_top_ks: list[int] = option(factory=lambda: [1, 2, 4], help="top_k values fitted over (1: the chain)")
    tune_totals: list[int] = option(factory=lambda: [16, 32], help="tree sizes fitted over (top_k > 1)")
    tune_prompts: int = option(6, "validation prompts decoded per tree setting when fitting")
    tune_new_tokens: int = option(128, "new tokens per prompt when fitting, as many as the bench's")
