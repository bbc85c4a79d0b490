"""Digests of what decides a result: a model's weights (the frozen target, the key of its self-distilled data
and feature cache) and a run's settings, data and shapes (resuming a run with any of them changed is
refused)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator

from selfspec.train.data.examples import Examples
from selfspec.train.loop.train_config import TrainConfig
from selfspec.train.parallel.distributed import is_sharded, local_tensor


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    """A digest of a model's weights (float64 sums per tensor, read back in one transfer): any update changes
    it. LoRA adapters (Medusa-2 trains them inside the target) are left out, so the digest of a target with
    adapters equals that of the target alone. A target sharded over the ranks (--shard_target) is read piece
    by piece, and every rank must call this then: the pieces' sums are gathered."""
    tensors = [local_tensor(p) for name, p in model.named_parameters() if "lora_" not in name]
    if not tensors:
        return "empty"
    sums = torch.stack(
        [torch.stack([t.sum(dtype=torch.float64), t.abs().sum(dtype=torch.float64)]) for t in tensors]
    )
    if is_sharded(
        model
    ):  # each rank holds a piece of every tensor: the digest is of every rank's sums, in order
        pieces = [torch.empty_like(sums) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(pieces, sums)
        sums = torch.cat(pieces)
    return hashlib.sha1(repr(sums.cpu().tolist()).encode()).hexdigest()[:16]


# options a resumed run may change: where and how often to write, log and validate, how long to train (a run
# may be extended or cut; the schedule then follows the new length, which resuming notes), where the data is
# (its cache key stands for it), speed and memory only, and how the result is stored or its decoding defaults
# fitted. Every other option is in a run's fingerprint.
NOT_FINGERPRINTED = frozenset(
    {
        "output_dir",
        "overwrite_output_dir",
        "max_steps",
        "num_epochs",
        "max_minutes",
        "save_steps",
        "save_total_limit",
        "eval_steps",
        "eval_batches",
        "per_device_eval_batch_size",
        "logging_steps",
        "resume",
        "resume_allow_changes",
        "report_to",
        "run_name",
        "ddp_timeout_minutes",
        "dataset",
        "eval_dataset",
        "tree_nodes",
        "merge",
        "gradient_checkpointing",  # Medusa: the stored tree, the output's form, memory only
        "cache_features",
        "feature_shard_examples",  # EAGLE: the same features, read from disk
        "depth",
        "top_k",
        "total_tokens",
        "tune_depths",
        "tune_top_ks",
        "tune_totals",
        "tune_prompts",
        "tune_new_tokens",
    }
)


def run_fingerprint(
    cfg: TrainConfig, accelerator: Accelerator, trainable: torch.nn.Module, train_data: Examples
) -> dict[str, Any]:
    """What decides a run's result: resuming with any of these changed is refused. The data is named by its
    cache key (source files' sizes and times, tokenizer, selections), not read again."""

    def shapes_sha1(named: Iterator[tuple[str, torch.Tensor]]) -> str:
        return hashlib.sha1(repr([(n, tuple(t.shape)) for n, t in named]).encode()).hexdigest()

    settings = {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in NOT_FINGERPRINTED
    }
    return settings | {
        "drafter_buffers_sha1": shapes_sha1(trainable.named_buffers()),  # e.g. EAGLE's d2t
        "train_examples": len(train_data),
        "train_data": train_data.key,
        "num_processes": accelerator.num_processes,
        "drafter_shapes_sha1": shapes_sha1(trainable.named_parameters()),
    }
