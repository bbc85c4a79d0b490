"""The run of a drafter trained on the frozen target's features (EAGLE-1/2/3, DFlash): the target loaded
(whole on every rank, or sharded: train/parallel/target_shard.py), the data, the drafter built alike on every
rank, the features cached when asked, the shared loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from selfspec.train.data.eagle_features import cached_features, validated
from selfspec.train.data.examples import Examples
from selfspec.train.data.run_data import datasets_for
from selfspec.train.loop.train_config import TrainConfig
from selfspec.train.loop.training import start_run, train
from selfspec.train.parallel.distributed import unpartitioned
from selfspec.train.parallel.target_shard import load_training_target


def calibration_prompts(eval_data: Examples, count: int, length: int) -> list[torch.Tensor]:
    """Up to `count` validation examples' prompts: the tokens before the first loss-bearing one (a chat's
    system and user turns through the generation prompt; a regenerated window's kept tokens), or the first
    `length` tokens where the loss starts at once (plain text)."""
    rows = eval_data.rows[: min(count, len(eval_data))]
    prompts = []
    for ids, mask in zip(rows["input_ids"], rows["loss_mask"]):
        first = next((i for i, m in enumerate(mask) if m), len(mask))
        cut = first if 1 < first < len(ids) else length
        if ids[:cut]:
            prompts.append(torch.tensor(ids[:cut], dtype=torch.long))
    return prompts


def run_feature_drafter(
    cfg: TrainConfig,
    build: Callable[[Any, Any, Examples], torch.nn.Module],
    make_method: Callable[[Any, torch.nn.Module, list[torch.Tensor]], Any],
) -> dict:
    """Set up, train and save (`cfg` a recipe with cache_features and tune_prompts): `build(target, tokenizer,
    train_data)` makes the drafter, `make_method(target,
    drafter, tune_prompts)` its training method. Returns the target, the trained drafter, its initial weights
    and the validation history."""
    accelerator = start_run(cfg)
    target, tokenizer = load_training_target(cfg, accelerator)
    train_data, eval_data = datasets_for(cfg, tokenizer, target, accelerator)
    with unpartitioned(accelerator, cfg.seed):  # built whole and alike on every rank; prepare() shards it
        draft = build(target, tokenizer, train_data).to(accelerator.device)
    layers = draft.config.feature_layers
    if cfg.cache_features:  # every rank writes its share of the shards, then all read all of them
        ranks = (accelerator.process_index, accelerator.num_processes, accelerator.wait_for_everyone)
        train_data = cached_features(cfg, target, train_data, "train", layers, *ranks)
        eval_data = cached_features(cfg, target, validated(cfg, eval_data), "eval", layers, *ranks)
    initial = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    prompts = calibration_prompts(eval_data, cfg.tune_prompts, cfg.distill_prompt_tokens)
    if cfg.shard_target and not (cfg.depth and cfg.top_k and cfg.total_tokens):
        accelerator.print(
            f"--shard_target: the tree is not fitted at the end of this run (each of its timed decodes "
            "would gather the sharded target again, minutes on end); the drafter keeps its default tree. "
            f"Fit it afterwards on one copy of the target: selfspec tune --heads {cfg.output_dir}"
        )
        prompts = []
    method = make_method(target, draft, prompts)
    history, trained = train(cfg, accelerator, method, train_data, eval_data)
    return {"target": target, "draft": trained, "initial": initial, "history": history}
