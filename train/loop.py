"""The one accelerate training loop every drafter recipe shares: setup -> train -> save.

A recipe supplies a `Method`: the trainable module, its loss on a batch (the frozen target runs
inside, without gradients), its evaluation, and how to save. This loop owns the accelerator,
optimizer, cosine schedule, gradient accumulation and clipping, mixed precision, atomic
checkpoints, exact resume (step, optimizer, scheduler, RNG and data position) and logging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

from selfspec.heads.config import HeadsConfig
from selfspec.heads.io import atomic_write
from selfspec.shipped.models import resolve_model
from selfspec.train.checkpoints import (
    check_rng_files,
    check_same_run,
    find_resume,
    prepare_output_dir,
    read_state,
    save_checkpoint,
)
from selfspec.train.config import ConfigError, check_at_least, check_finite
from selfspec.train.data import Examples, cache_dir, check_source, load_examples, pad_batch, split_examples
from selfspec.train.distributed import (
    check_engine,
    check_launch,
    configure_deepspeed,
    engine_name,
    expose_methods,
    fsdp_without_gpu,
    gathered_module,
    max_over_ranks,
    scheduler_steps_per_update,
)
from selfspec.train.regenerate import Items, RegenerateConfig, load_items, regenerate_with_model, written_by

REPORTERS = ("none", "wandb", "tensorboard")
PRECISIONS = ("no", "bf16", "fp16")


@dataclasses.dataclass
class TrainConfig:
    """Options every drafter recipe shares; the defaults train on the demo target on CPU."""

    model: str = "demo"  # any HF causal LM name or path; `demo` is the shipped target
    dataset: str = "stdlib"  # stdlib | file.txt | folder | file.json(l) | a datasets name
    eval_dataset: str | None = None  # default: the stdlib validation split, or a held-out slice
    eval_fraction: float = 0.02  # the held-out slice of `dataset` used for validation when no eval_dataset
    max_train_examples: int = 0  # > 0: use only this many (seeded random) training examples
    self_distill: bool = False  # train on the target's own answers and continuations (train/regenerate.py)
    distill_prompt_tokens: int = 32  # with self_distill: tokens of each text window kept as its prompt
    distill_temperature: float = 0.0  # with self_distill: the target's sampling temperature (0: greedy)
    output_dir: str = "outputs/medusa-demo"  # where the drafter, its checkpoints and training_args.json go
    overwrite_output_dir: bool = False  # delete checkpoints another run left in output_dir (else: refuse to start)
    max_steps: int = -1  # optimizer steps; -1 means num_epochs
    num_epochs: float = 1.0  # epochs over the training data when max_steps is -1
    max_minutes: float = 0.0  # > 0: stop (and save) when this wall-clock budget is spent
    learning_rate: float = 1e-3  # peak AdamW learning rate (cosine decay after warmup)
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.999  # AdamW beta2
    warmup_ratio: float = 0.05  # fraction of the steps spent warming the learning rate up linearly
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # clip the gradient norm to this (0: no clipping)
    per_device_train_batch_size: int = 8  # examples per process per micro-batch
    per_device_eval_batch_size: int = 8  # examples per process per validation batch
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    max_length: int = 512  # tokens per example: text is packed into blocks of this, chats cut to it
    mixed_precision: str = "no"  # no | bf16 | fp16
    seed: int = 0  # seeds data order, subsets, initialisation and noise
    save_steps: int = 500  # write a resumable checkpoint every this many steps (and at the end)
    save_total_limit: int = 2  # checkpoints of this run kept (older ones deleted; 0 keeps all)
    eval_steps: int = 100  # validate every this many steps (and at the start and the end)
    eval_batches: int = 16  # cap on validation batches per evaluation
    logging_steps: int = 10  # log the training loss every this many steps
    resume: str | None = None  # `latest` (in output_dir) or a checkpoint folder
    resume_allow_changes: bool = False  # resume although batch size, data or model differ from the checkpoint's
    report_to: str = "none"  # none | wandb | tensorboard
    run_name: str | None = None  # the tracker's run name (default: output_dir's name)
    ddp_timeout_minutes: float = 360.0  # how long ranks wait for each other (data preparation, tree fitting on rank 0)

    @property
    def target_dtype(self) -> torch.dtype:
        """The frozen target needs no fp32 master weights: keep it in the mixed-precision dtype."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.mixed_precision, torch.float32)

    def __post_init__(self) -> None:
        check_finite(self)
        if self.report_to not in REPORTERS:
            raise ConfigError(f"--report_to must be one of {', '.join(REPORTERS)}, got {self.report_to!r}")
        if self.mixed_precision not in PRECISIONS:
            raise ConfigError(f"--mixed_precision must be one of {', '.join(PRECISIONS)}, got {self.mixed_precision!r}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"--max_steps must be > 0, or -1 to train num_epochs epochs; got {self.max_steps}")
        if self.max_steps == -1 and self.num_epochs <= 0:
            raise ConfigError(f"--num_epochs must be > 0 when max_steps is -1, got {self.num_epochs}")
        check_at_least(self, ("save_steps", "eval_steps", "logging_steps", "gradient_accumulation_steps",
                     "per_device_train_batch_size", "per_device_eval_batch_size", "eval_batches", "max_length",
                     "distill_prompt_tokens"), 1)
        check_at_least(self, ("max_train_examples", "save_total_limit", "max_minutes", "weight_decay", "max_grad_norm",
                              "distill_temperature"), 0)
        if self.ddp_timeout_minutes <= 0:
            raise ConfigError(f"--ddp_timeout_minutes must be > 0, got {self.ddp_timeout_minutes}")
        if self.learning_rate <= 0:
            raise ConfigError(f"--learning_rate must be > 0, got {self.learning_rate}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"--warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 < self.eval_fraction < 1:
            raise ConfigError(f"--eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.self_distill and self.distill_prompt_tokens >= self.max_length:
            raise ConfigError(f"--distill_prompt_tokens ({self.distill_prompt_tokens}) must be below max_length "
                              f"({self.max_length}): the rest of each example is what the target writes")


class Method(Protocol):
    """What a recipe gives the loop."""

    trainable: torch.nn.Module
    target: torch.nn.Module  # the frozen target (checked unchanged at the end)
    label: str  # what is saved, for the closing message ("Medusa heads")
    agree: Any  # set by the loop: train.distributed.max_over_ranks (None unless ZeRO-3/FSDP)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss to backpropagate (its gradient is the objective's; Medusa-2 weighs parts of it on the way
        back) and detached scalars to log (read only at logging steps: no sync per step)."""
        ...

    def evaluate(self, batches: list[dict[str, torch.Tensor]], total=None) -> dict[str, float]:
        """Metrics over `batches`; every accumulated sum goes through `total` (a sum across ranks) once."""
        ...

    def save(self, module: torch.nn.Module, output_dir: Path, metrics: dict[str, float]) -> None: ...


def load_frozen_target(name: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """The target and its tokenizer; every target parameter is frozen."""
    path = resolve_model(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def datasets_for(cfg: TrainConfig, tokenizer, target=None, accelerator: Accelerator | None = None
                 ) -> tuple[Examples, Examples]:
    """Train and validation examples that carry a label (`labelled`); with `self_distill` both hold the
    target's own answers (`distilled`)."""
    train, evals = all_examples(cfg, tokenizer, target, accelerator)
    report = accelerator is None or accelerator.is_main_process
    return labelled(train, cfg, "training", report), labelled(evals, cfg, "validation", report)


FIRST_LABEL = 2  # the earliest position a drafter learns a token at: Medusa's head 0 and EAGLE both predict from t - 2


def labelled(examples: Examples, cfg: TrainConfig, what: str, report: bool = True) -> Examples:
    """The examples with a trained token at position FIRST_LABEL or later; none is an error naming the fix, a
    shortfall a note with the count dropped."""
    import pyarrow.compute as pc

    keep = []
    for start, batch in enumerate(examples.rows.with_format("arrow").iter(4096)):
        masks = pc.list_slice(batch["loss_mask"], FIRST_LABEL)
        trained = pc.list_parent_indices(masks).filter(pc.equal(pc.list_flatten(masks), 1))
        keep.append(np.unique(trained.to_numpy()) + start * 4096)
    keep = np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)
    if len(keep) == len(examples):
        return examples
    if len(keep) == 0:
        raise ConfigError(f"no {what} example carries a label for the drafter: each needs a trained token (an "
                          f"assistant turn's, for chats) at position {FIRST_LABEL} or later within --max_length "
                          f"{cfg.max_length}; raise --max_length, or give data with trained tokens")
    if report:
        print(f"note: {len(examples) - len(keep)} of {len(examples)} {what} examples carry no label within "
              f"--max_length {cfg.max_length} (too short, or their trained tokens cut away) and are dropped",
              file=sys.stderr)
    return examples.select(keep, f"labelled from {FIRST_LABEL}")


def all_examples(cfg: TrainConfig, tokenizer, target=None, accelerator: Accelerator | None = None
                 ) -> tuple[Examples, Examples]:
    """Train and validation examples; with `self_distill` both hold the target's own answers (`distilled`).

    Without `accelerator` this process does all the work. With it, every rank calls this together: rank 0
    tokenises first (the others then read its cache) and the self-distillation is shared among the ranks."""
    if cfg.self_distill:
        wrote = written_by(cfg.dataset, cfg.model)
        if accelerator is None or accelerator.is_main_process:
            if wrote:
                print(f"{cfg.dataset} was regenerated by {cfg.model} (train/regenerate.py): training on it as written",
                      file=sys.stderr)
            elif wrote is False:
                print(f"{cfg.dataset} was regenerated by another target: {cfg.model} regenerates it again "
                      "(--self_distill false trains on it as written)", file=sys.stderr)
        if not wrote:
            return distilled_datasets(cfg, tokenizer, target, accelerator)
    with accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext():
        train, evals = plain_datasets(cfg, tokenizer)
    if cfg.self_distill and cfg.eval_dataset:  # the training folder is the target's own already; the eval data not
        evals = distilled_eval(cfg, tokenizer, target, accelerator)
    return train, evals


def plain_datasets(cfg: TrainConfig, tokenizer) -> tuple[Examples, Examples]:
    """The dataset's examples as written: training examples and the validation split or a held-out slice."""
    train = load_examples(cfg.dataset, tokenizer, cfg.max_length)
    if cfg.eval_dataset:
        evals = load_examples(cfg.eval_dataset, tokenizer, cfg.max_length, split="validation")
    elif cfg.dataset in ("stdlib", "demo"):
        evals = load_examples("stdlib", tokenizer, cfg.max_length, split="validation")
    else:
        train, evals = split_examples(train, cfg.eval_fraction, cfg.seed)
    if cfg.max_train_examples > 0:
        train = subset(train, cfg.max_train_examples, cfg.seed)
    return train, evals


def subset(examples: Examples, count: int, seed: int) -> Examples:
    """A seeded random subset of `count` examples, in their order (all of them when there are fewer)."""
    n = len(examples)
    if count >= n:
        return examples
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:count].sort().values
    return examples.select(idx.numpy(), f"subset {count} seed {seed}")


def distilled_datasets(cfg: TrainConfig, tokenizer, target, accelerator: Accelerator | None = None
                       ) -> tuple[Examples, Examples]:
    """Self-distillation: the work items the plain path would train on (text windows, conversations), selected
    the same way (held-out slice, `max_train_examples`, `eval_batches` x batch size for validation), each
    regenerated by the target (train/regenerate.py) and read back with the exact tokens it wrote."""
    if target is None:
        raise ValueError("self_distill needs the target model")
    main_first = accelerator.main_process_first if accelerator is not None else contextlib.nullcontext
    with main_first():
        train = load_items(cfg.dataset, "train", tokenizer, cfg.max_length)
        if cfg.eval_dataset:
            evals = load_items(cfg.eval_dataset, "validation", tokenizer, cfg.max_length)
        elif cfg.dataset in ("stdlib", "demo"):
            evals = load_items("stdlib", "validation", tokenizer, cfg.max_length)
        else:
            train, evals = split_examples(train, cfg.eval_fraction, cfg.seed)
    if cfg.max_train_examples > 0:
        train = subset(train, cfg.max_train_examples, cfg.seed)
    return (distilled(cfg, target, tokenizer, train, "train", accelerator),
            distilled_eval(cfg, tokenizer, target, accelerator, evals))


def distilled_eval(cfg: TrainConfig, tokenizer, target, accelerator: Accelerator | None = None,
                   items: Items | None = None) -> Examples:
    """The validation items (default: those of `eval_dataset`), as many as validation reads, regenerated."""
    if items is None:
        main_first = accelerator.main_process_first if accelerator is not None else contextlib.nullcontext
        with main_first():
            items = load_items(cfg.eval_dataset, "validation", tokenizer, cfg.max_length)
    items = subset(items, cfg.eval_batches * cfg.per_device_eval_batch_size, cfg.seed)
    return distilled(cfg, target, tokenizer, items, "eval", accelerator)


def distilled(cfg: TrainConfig, target, tokenizer, items: Items, name: str,
              accelerator: Accelerator | None = None) -> Examples:
    """`items` regenerated by the loaded target (no second load), cached as a regenerated dataset folder under
    cache_dir() keyed by the target's weights, the items and the settings; an interrupted run resumes its shards."""
    regen = RegenerateConfig(model=cfg.model, dataset=cfg.dataset, temperature=cfg.distill_temperature,
                             max_new_tokens=cfg.max_length, max_length=cfg.max_length,
                             prompt_tokens=cfg.distill_prompt_tokens, seed=cfg.seed)
    who = {"model": cfg.model, "weights": weights_fingerprint(target)}
    settings = json.dumps([items.key, who, dataclasses.asdict(regen)], sort_keys=True)
    digest = hashlib.sha1(settings.encode()).hexdigest()[:16]
    path = cache_dir() / f"regen-{name}-{digest}"
    ranks = (accelerator.process_index, accelerator.num_processes, accelerator.wait_for_everyone) if accelerator else ()
    regenerate_with_model(target, tokenizer, items, regen, path, who, *ranks)
    main_first = accelerator.main_process_first if accelerator is not None else contextlib.nullcontext
    with main_first():
        rows = load_examples(str(path), tokenizer, cfg.max_length).rows  # each row its own example, cut to max_length
    return Examples(rows, digest)


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    """A digest of a model's weights (float64 sums per tensor, read back in one transfer): any update changes it.
    LoRA adapters (Medusa-2 trains them inside the target) are left out, so the digest of a target with adapters
    equals that of the target alone."""
    sums = [torch.stack([p.sum(dtype=torch.float64), p.abs().sum(dtype=torch.float64)])
            for name, p in model.named_parameters() if "lora_" not in name]
    return hashlib.sha1(repr(torch.stack(sums).cpu().tolist()).encode()).hexdigest()[:16] if sums else "empty"


def start_run(cfg: TrainConfig) -> Accelerator:
    """The accelerator, the output folder checked (writable, no other run's checkpoints) before any
    heavy work, and the seed set."""
    check_engine()
    check_launch()
    check_source(cfg.dataset)  # a file that is not text fails now, not after the target has loaded
    check_source(cfg.eval_dataset)
    accelerator = make_accelerator(cfg)
    prepare_output_dir(accelerator, Path(cfg.output_dir), cfg.resume, cfg.overwrite_output_dir,
                       resolve_model(cfg.model))
    set_seed(cfg.seed)
    return accelerator


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    # Several CPU processes need gloo, or accelerate reports one process per rank and shards nothing. The
    # timeout covers the longest wait: other ranks while rank 0 prepares the data or fits the tree.
    # DDP and FSDP also need cpu=True to count as multi-CPU (FSDP is then switched on: fsdp_without_gpu);
    # DeepSpeed (DS_ACCELERATOR=cpu) keeps its own type but uses gloo.
    multi_cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    timeout = timedelta(minutes=cfg.ddp_timeout_minutes)
    handlers = [InitProcessGroupKwargs(backend="gloo" if multi_cpu else None, timeout=timeout)]
    accelerator = Accelerator(
        cpu=multi_cpu and not deepspeed,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        mixed_precision=cfg.mixed_precision,
        log_with=None if cfg.report_to == "none" else cfg.report_to,
        project_dir=cfg.output_dir,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=handlers,
    )
    fsdp_without_gpu(accelerator)
    return accelerator


# ---------------------------------------------------------------- the loop


def train(
    cfg: TrainConfig, accelerator: Accelerator, method: Method, train_data: Examples, eval_data: Examples
) -> list[tuple[int, dict[str, float]]]:
    """Run the loop; returns the validation history [(step, metrics)]. `method.save` writes the result, and
    `method.trainable` is the trained module again afterwards (unwrapped from accelerate)."""
    output_dir = Path(cfg.output_dir)
    main = accelerator.is_main_process
    trainable = method.trainable
    params = [p for p in trainable.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the drafter has no trainable parameters")
    groups = method.param_groups(cfg.learning_rate) if hasattr(method, "param_groups") else params
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    loader = DataLoader(train_data, batch_size=cfg.per_device_train_batch_size, shuffle=True, drop_last=True,
                        collate_fn=pad_batch)
    eval_loader = DataLoader(eval_data, batch_size=cfg.per_device_eval_batch_size, collate_fn=pad_batch)
    per_epoch = len(loader) // (cfg.gradient_accumulation_steps * accelerator.num_processes)
    if per_epoch == 0:
        raise ValueError(
            f"{len(train_data)} training examples make no full optimizer step at batch size "
            f"{cfg.per_device_train_batch_size} x {cfg.gradient_accumulation_steps} accumulation x "
            f"{accelerator.num_processes} processes: add data or lower the batch size"
        )
    total = cfg.max_steps if cfg.max_steps > 0 else math.ceil(per_epoch * cfg.num_epochs)
    ticks = scheduler_steps_per_update(accelerator)  # the prepared scheduler's steps per optimizer step
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total) * ticks, total * ticks)
    fingerprint = run_fingerprint(cfg, accelerator, trainable, train_data)  # before ZeRO-3/FSDP shard the shapes
    fingerprint["target_weights"] = weights_fingerprint(method.target)
    configure_deepspeed(accelerator, cfg.max_grad_norm)
    trainable, optimizer, loader, scheduler = accelerator.prepare(trainable, optimizer, loader, scheduler)
    method.trainable = trainable
    method.agree = max_over_ranks(accelerator)  # None unless the engine gathers weights per call
    expose_methods(accelerator, trainable)

    step, epoch, batches_done = 0, 0, 0
    history: list[tuple[int, dict[str, float]]] = []
    metrics: dict[str, float] = {}
    run_id = uuid.uuid4().hex
    resume_from = find_resume(cfg.resume, output_dir)
    if resume_from is not None:
        state = read_state(resume_from)
        check_same_run(resume_from, state.get("fingerprint", {}), fingerprint, cfg.resume_allow_changes)
        check_rng_files(resume_from, accelerator.process_index)
        accelerator.load_state(str(resume_from))
        step, epoch, batches_done = state["step"], state["epoch"], state["batches_done"]
        if state.get("total_steps", total) != total and accelerator.is_main_process:
            print(f"note: resuming a run of {state['total_steps']} steps as one of {total}: the learning-rate "
                  "schedule (and Medusa-2's heads weight) follows the new length from here", file=sys.stderr)
        run_id = state.get("run_id", run_id)
        metrics = state.get("metrics") or {}  # a final checkpoint's metrics decide the tree and the card
        history = [(step, metrics)] if metrics else []
        accelerator.print(f"resumed from {resume_from} at step {step} (epoch {epoch}, batch {batches_done})")

    if cfg.report_to != "none":
        accelerator.init_trackers(cfg.run_name or output_dir.name, config=dataclasses.asdict(cfg))
    global_batch = cfg.per_device_train_batch_size * accelerator.num_processes * cfg.gradient_accumulation_steps
    accelerator.print(
        f"training {sum(p.numel() for p in params) / 1e6:.2f} M parameters for {total} steps "
        f"({len(train_data)} examples of up to {cfg.max_length} tokens, {per_epoch} steps per epoch); "
        f"global batch {global_batch} = {cfg.per_device_train_batch_size} per device x {accelerator.num_processes} "
        f"processes x {cfg.gradient_accumulation_steps} accumulation; {engine_name(accelerator)}"
    )
    bar = tqdm(total=total, initial=step, disable=not main, desc="train", dynamic_ncols=True)
    if step == 0 and total > 0:
        metrics = run_eval(method, eval_loader, cfg.eval_batches, accelerator)
        history.append((0, metrics))
        bar.write("step 0: " + format_metrics(metrics))
    start = time.time()
    tokens = torch.zeros((), dtype=torch.long, device=accelerator.device)  # this rank's real tokens since start
    stop = step >= total
    while not stop:
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, batches_done) if batches_done else loader
        for batch in batches_keeping_rng(batches):
            trainable.train()
            method.step, method.total_steps = step, total  # for losses that change over the run (Medusa-2)
            with accelerator.accumulate(trainable), accelerator.autocast():
                loss, logs = method.loss(batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(trainable.parameters(), cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            batches_done += 1
            tokens += batch["attention_mask"].sum()
            if not accelerator.sync_gradients:
                continue
            step += 1
            bar.update(1)
            out_of_time = cfg.max_minutes > 0 and step % cfg.logging_steps == 0 and ranks_agree(
                accelerator, time.time() - start > cfg.max_minutes * 60
            )
            stop = step >= total or out_of_time
            if step % cfg.logging_steps == 0:
                logs = {"train/" + k: float(v) for k, v in logs.items()} | {"lr": scheduler.get_last_lr()[0]}
                rate = float(tokens) * accelerator.num_processes / max(time.time() - start, 1e-9)
                bar.set_postfix(loss=f"{logs['train/loss']:.3f}", tok_s=f"{rate:,.0f}")
                accelerator.log(logs, step=step)
            if step % cfg.eval_steps == 0 or stop:
                metrics = run_eval(method, eval_loader, cfg.eval_batches, accelerator)
                history.append((step, metrics))
                accelerator.log({"eval/" + k: v for k, v in metrics.items() if not k.startswith("path/")}, step=step)
                bar.write(f"step {step}: " + format_metrics(metrics))
            if step % cfg.save_steps == 0 or stop:
                state = {"step": step, "epoch": epoch, "batches_done": batches_done, "metrics": metrics,
                         "run_id": run_id, "fingerprint": fingerprint, "total_steps": total}
                save_checkpoint(accelerator, output_dir, state, cfg.save_total_limit)
            if stop:
                if out_of_time:
                    accelerator.print(f"stopping at step {step}: the {cfg.max_minutes}-minute budget is spent")
                break
        else:
            epoch, batches_done = epoch + 1, 0
    bar.close()
    if weights_fingerprint(method.target) != fingerprint["target_weights"]:
        raise RuntimeError("the frozen target's weights changed during training: a drafter trained on a moving "
                           "target is wrong; check that no optimizer or engine received the target's parameters")
    accelerator.wait_for_everyone()
    # every rank helps gather the weights (ZeRO-3 / FSDP shard them); rank 0 fits the tree and writes once
    full = gathered_module(accelerator, trainable)
    method.trainable = full if main else accelerator.unwrap_model(trainable, keep_fp32_wrapper=False)
    if main:
        method.save(method.trainable, output_dir, metrics)
        save_recipe(cfg, output_dir)
        if history:
            report_saved(cfg, history, method.label)
    accelerator.wait_for_everyone()  # the others wait for the save (ddp_timeout_minutes bounds it)
    accelerator.end_training()
    return history


# options a resumed run may change: where and how often to write, log and validate, how long to train (a run may
# be extended or cut; the schedule then follows the new length, which resuming notes), where the data is (its cache
# key stands for it), speed and memory only, and how the result is stored or its decoding defaults fitted. Every
# other option is in a run's fingerprint.
NOT_FINGERPRINTED = frozenset({
    "output_dir", "overwrite_output_dir", "max_steps", "num_epochs", "max_minutes", "save_steps", "save_total_limit",
    "eval_steps", "eval_batches", "per_device_eval_batch_size", "logging_steps", "resume", "resume_allow_changes",
    "report_to", "run_name", "ddp_timeout_minutes", "dataset", "eval_dataset",
    "tree_nodes", "merge", "gradient_checkpointing",  # Medusa: the stored tree, the output's form, memory only
    "cache_features", "feature_shard_examples",  # EAGLE: the same features, read from disk
    "depth", "top_k", "total_tokens", "tune_depths", "tune_top_ks", "tune_totals", "tune_prompts", "tune_new_tokens",
})


def run_fingerprint(cfg: TrainConfig, accelerator: Accelerator, trainable: torch.nn.Module,
                    train_data: Examples) -> dict[str, Any]:
    """What decides a run's result: resuming with any of these changed is refused. The data is named by its
    cache key (source files' sizes and times, tokenizer, selections), not read again."""
    def shapes_sha1(named: Iterator[tuple[str, torch.Tensor]]) -> str:
        return hashlib.sha1(repr([(n, tuple(t.shape)) for n, t in named]).encode()).hexdigest()

    settings = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in NOT_FINGERPRINTED}
    return settings | {"drafter_buffers_sha1": shapes_sha1(trainable.named_buffers()),  # e.g. EAGLE's d2t
            "train_examples": len(train_data), "train_data": train_data.key,
            "num_processes": accelerator.num_processes, "drafter_shapes_sha1": shapes_sha1(trainable.named_parameters())}


def batches_keeping_rng(loader: DataLoader):
    """Yield the loader's batches without letting the loading touch the global RNG: starting an epoch
    draws a worker seed from it. The training step's stream (e.g. EAGLE's feature noise) then depends
    only on the steps taken, so a resumed run continues exactly where the checkpoint left it."""
    iterator = iter(loader)
    while True:
        state = torch.get_rng_state()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        finally:
            torch.set_rng_state(state)
        yield batch


def save_recipe(cfg: TrainConfig, output_dir: Path) -> None:
    """The run's options (and its command, when launched as a script) next to the heads, for their model card."""
    recipe = dataclasses.asdict(cfg)
    script = Path(sys.argv[0])
    if script.parent.name == "train" and script.suffix == ".py":
        recipe["command"] = "accelerate launch " + " ".join([f"train/{script.name}", *sys.argv[1:]])
    atomic_write(output_dir / "training_args.json", lambda tmp: Path(tmp).write_text(json.dumps(recipe, indent=2)))


def ranks_agree(accelerator: Accelerator, flag: bool) -> bool:
    """The main rank's decision, shared with every rank (so all stop at the same step)."""
    if accelerator.num_processes == 1:
        return flag
    from accelerate.utils import broadcast

    return bool(broadcast(torch.tensor([int(flag)], device=accelerator.device)).item())


@torch.no_grad()
def run_eval(method: Method, loader: DataLoader, max_batches: int, accelerator: Accelerator) -> dict[str, float]:
    """The first `max_batches` validation batches, split across ranks (rank r takes r, r + n, ...) and the
    sums reduced, so n ranks compute what one would, n times faster."""
    method.trainable.eval()
    n, device = accelerator.num_processes, accelerator.device
    mine = itertools.islice(loader, accelerator.process_index, max_batches, n)
    batches = [{k: v.to(device) for k, v in b.items()} for b in mine]
    if n == 1:
        return method.evaluate(batches)
    # Every rank evaluates as many batches (ZeRO-3/FSDP gather the drafter's weights per call): a rank short
    # of one repeats a batch with no trained token, which adds nothing to any sum.
    share = -(-min(max_batches, len(loader)) // n)
    if share > len(batches):
        filler = batches[0] if batches else {k: v.to(device) for k, v in next(iter(loader)).items()}
        batches += [filler | {"loss_mask": torch.zeros_like(filler["loss_mask"])}] * (share - len(batches))
    return method.evaluate(batches, total=lambda t: accelerator.reduce(t.to(device), "sum").to(t.device))


def heads_config(cfg: TrainConfig, target, kind: str, **fields: Any) -> HeadsConfig:
    """The drafter's config: the target's shapes and name, the run's dtype (the default at inference)."""
    return HeadsConfig(kind=kind, base_model=cfg.model, hidden_size=target.config.get_text_config().hidden_size,
                       vocab_size=target.get_output_embeddings().weight.shape[0],
                       dtype=str(cfg.target_dtype).removeprefix("torch."), **fields)


def report_saved(cfg: TrainConfig, history: list[tuple[int, dict[str, float]]], what: str) -> None:
    print(f"\nvalidation: {format_metrics(history[-1][1])}")
    print(f"saved {what} to {cfg.output_dir}")
    print(f"generate with:  selfspec generate --heads {cfg.output_dir} --prompt 'def parse('")
    print(f"benchmark with: selfspec bench --heads {cfg.output_dir}")


def format_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3f}" for k, v in metrics.items() if not k.startswith(("rank_acc", "path/")))
