"""The target's features an EAGLE drafter learns from: computed online without gradients, or once into the
on-disk feature cache (train/data/features.py) that every epoch then reads."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from selfspec.train.data.examples import Examples, cache_dir, pad_batch
from selfspec.train.data.features import (
    FeatureShards,
    examples_per_shard,
    missing_shards,
    shard_count,
    write_shards,
)
from selfspec.train.data.fingerprints import weights_fingerprint
from selfspec.train.loop.step_timer import OFF, StepTimer

if TYPE_CHECKING:
    from selfspec.train.recipes.eagle import EagleConfig


@torch.no_grad()
def target_features(
    target,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layers: list[int] | None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the drafter learns from, without gradients: the target's last hidden states (B, T, H), or with
    `layers` (EAGLE-3) those hidden_states indices concatenated, then the last hidden states (B, T, (n+1)H).
    Packed rows (train.packing) pass their position_ids and no attention_mask."""
    out = target.base_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        output_hidden_states=layers is not None,
    )
    if layers is None:
        return out.last_hidden_state
    return torch.cat([out.hidden_states[i] for i in layers] + [out.last_hidden_state], dim=-1)


def batch_features(
    target, batch: dict[str, torch.Tensor], layers: list[int] | None, timer: StepTimer = OFF
) -> torch.Tensor:
    """A batch's target features (see `target_features`): read from the batch when cached on disk, else
    computed (its target forward timed as the "target" section), for padded or packed rows alike."""
    if "features" in batch:
        return batch["features"]
    with timer.section("target"):
        if "position_ids" in batch:
            return target_features(target, batch["input_ids"], None, layers, batch["position_ids"])
        return target_features(target, batch["input_ids"], batch["attention_mask"], layers)


def write_features(
    cfg: EagleConfig,
    target,
    examples: Examples,
    name: str,
    layers: list[int] | None = None,
    rank: int = 0,
    world: int = 1,
    batch_size: int = 16,
) -> tuple[Path, int]:
    """Write rank `rank` of `world`'s share of the target's features of `examples` (train/data/features.py),
    keyed by the target's weights, the data, the layers and the dtype; rank 0 first prints the size on disk.
    Returns the cache folder and its examples per shard."""
    width = target.config.get_text_config().hidden_size * (len(layers) + 1 if layers else 1)
    dtype = next(target.parameters()).dtype
    size = cfg.feature_shard_examples or examples_per_shard(cfg.max_length, width, dtype)
    digest = hashlib.sha1(
        f"{examples.key}|{cfg.model}|{dtype}|{layers}|{size}|{weights_fingerprint(target)}".encode()
    )
    folder = cache_dir() / f"features-{name}-{digest.hexdigest()[:16]}"
    n = len(examples)
    missing = missing_shards(folder, n, size)
    if not missing:
        return folder, size
    lengths = examples.lengths()
    if rank == 0:
        tokens = int(lengths.sum())
        gb = tokens * width * torch.finfo(dtype).bits / 8 / 1e9
        print(
            f"caching target features for {name}: {n} examples, {tokens} tokens x {width} ({dtype}) = "
            f"{gb:.3f} GB on disk at {folder}, {shard_count(n, size)} shards of {size} examples written by "
            f"{world} process(es); {len(missing)} to write"
        )

    def compute(start: int, stop: int) -> Iterator[torch.Tensor]:
        for i in range(start, stop, batch_size):
            rows = [examples[j] for j in range(i, min(stop, i + batch_size))]
            batch = pad_batch(rows)
            out = target_features(
                target,
                batch["input_ids"].to(target.device),
                batch["attention_mask"].to(target.device),
                layers,
            ).cpu()
            yield from (f[: len(r["input_ids"])] for f, r in zip(out, rows))

    write_shards(folder, lengths, width, dtype, size, rank, world, compute, show_progress=rank == 0)
    return folder, size


def cached_features(
    cfg: EagleConfig,
    target,
    examples: Examples,
    name: str,
    layers: list[int] | None = None,
    rank: int = 0,
    world: int = 1,
    wait: Callable[[], None] | None = None,
) -> Examples:
    """`examples` with the target's features, computed once into shards on disk by every rank in parallel
    and read a batch at a time afterwards; `wait` (all ranks) lets every rank finish its share first."""
    folder, size = write_features(cfg, target, examples, name, layers, rank, world)
    if wait is not None:
        wait()
        # machines that do not share the cache folder: each computes the shards its disk still lacks (none on
        # a shared folder, where every rank's shards are complete now)
        folder, size = write_features(cfg, target, examples, name, layers, 0, 1)
    return Examples(examples.rows, examples.key, FeatureShards(folder, len(examples), size))


def validated(cfg: EagleConfig, eval_data: Examples) -> Examples:
    """The validation examples validation reads (the loop takes its first `eval_batches` unshuffled batches,
    and the tree fit its first `tune_prompts`): the only ones whose features are worth caching."""
    used = max(cfg.eval_batches * cfg.per_device_eval_batch_size, cfg.tune_prompts)
    if len(eval_data) <= used:
        return eval_data
    return eval_data.select(np.arange(used), f"first {used}")
