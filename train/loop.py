"""The one accelerate training loop every drafter recipe shares: setup -> train -> save.

A recipe supplies a `Method`: the trainable module, its loss on a batch (the frozen target runs
inside, without gradients), its evaluation, and how to save. This loop owns the accelerator,
optimizer, cosine schedule, gradient accumulation and clipping, mixed precision, atomic
checkpoints, exact resume (step, optimizer, scheduler, RNG and data position) and logging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import math
import os
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

from selfspec.heads.config import HeadsConfig
from selfspec.heads.io import atomic_write
from selfspec.shipped.models import resolve_model
from selfspec.train.best import BestWeights
from selfspec.train.checkpoints import (
    check_rng_files,
    check_same_run,
    find_resume,
    prepare_output_dir,
    read_state,
    save_checkpoint,
)
from selfspec.train.data import Examples, pad_batch
from selfspec.train.distributed import (
    check_engine,
    check_launch,
    configure_deepspeed,
    engine_name,
    expose_methods,
    fsdp_without_gpu,
    gathered_module,
    is_sharded,
    max_over_ranks,
    scheduler_steps_per_update,
)
from selfspec.train.fingerprints import run_fingerprint, weights_fingerprint
from selfspec.train.packing import PackedExamples, check_packed_target
from selfspec.train.precision import precision_line
from selfspec.train.records import check_source
from selfspec.train.step_timer import StepTimer, padding, step_report
from selfspec.train.train_config import TrainConfig


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
        mixed_precision=cfg.precision,
        log_with=None if cfg.report_to == "none" else cfg.report_to,
        project_dir=cfg.output_dir,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=handlers,
    )
    fsdp_without_gpu(accelerator)
    if accelerator.is_main_process:
        print(precision_line(cfg.mixed_precision, cfg.precision), file=sys.stderr)
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
    # packed rows (train/packing.py) for training; validation reads one example per row, so its numbers stay
    # comparable between packed and unpacked runs
    rows = PackedExamples(train_data, cfg.max_length, cfg.seed) if cfg.packing else train_data
    if cfg.packing:
        check_packed_target(method.target)
    loader = DataLoader(rows, batch_size=cfg.per_device_train_batch_size, shuffle=True, drop_last=True,
                        collate_fn=pad_batch)
    eval_loader = DataLoader(eval_data, batch_size=cfg.per_device_eval_batch_size, collate_fn=pad_batch)
    per_epoch = len(loader) // (cfg.gradient_accumulation_steps * accelerator.num_processes)
    if per_epoch == 0:
        raise ValueError(
            f"{len(rows)} training {'rows' if cfg.packing else 'examples'} make no full optimizer step at batch size "
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
    best = BestWeights(getattr(method, "best_metric", None), output_dir)
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
        best.resume(state.get("best"))
        accelerator.print(f"resumed from {resume_from} at step {step} (epoch {epoch}, batch {batches_done})")

    if cfg.report_to != "none":
        accelerator.init_trackers(cfg.run_name or output_dir.name, config=dataclasses.asdict(cfg))
    global_batch = cfg.per_device_train_batch_size * accelerator.num_processes * cfg.gradient_accumulation_steps
    accelerator.print(
        f"training {sum(p.numel() for p in params) / 1e6:.2f} M parameters for {total} steps "
        f"({len(train_data)} examples of up to {cfg.max_length} tokens"
        f"{f' packed into {len(rows)} rows' if cfg.packing else ''}, {per_epoch} steps per epoch); "
        f"global batch {global_batch} = {cfg.per_device_train_batch_size} per device x {accelerator.num_processes} "
        f"processes x {cfg.gradient_accumulation_steps} accumulation; {engine_name(accelerator)}"
    )
    bar = tqdm(total=total, initial=step, disable=not main, desc="train", dynamic_ncols=True)
    if step == 0 and total > 0:
        metrics = run_eval(method, eval_loader, cfg.eval_batches, accelerator)
        history.append((0, metrics))
        best.offer(accelerator, trainable, 0, metrics)
        bar.write("step 0: " + format_metrics(metrics))
    start, paused, first_step = time.time(), 0.0, step  # paused: seconds spent validating and saving
    tokens = torch.zeros((), dtype=torch.long, device=accelerator.device)  # this rank's real tokens since start
    slots = 0  # this rank's positions trained (rows x row length), padding included
    timer = StepTimer(accelerator.device)  # target forward / drafter forward+backward / optimizer (train.step_timer)
    method.timer = timer
    stop = step >= total
    while not stop:
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, batches_done) if batches_done else loader
        for batch in batches_keeping_rng(batches):
            trainable.train()
            method.step, method.total_steps = step, total  # for losses that change over the run (Medusa-2)
            with accelerator.accumulate(trainable), accelerator.autocast():
                with timer.section("forward_backward"):  # the method times its target forward inside
                    loss, logs = method.loss(batch)
                    accelerator.backward(loss)
                with timer.section("optimizer"):
                    if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(trainable.parameters(), cfg.max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
            batches_done += 1
            tokens += batch["attention_mask"].sum()
            slots += batch["attention_mask"].numel()
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
                rate = float(tokens) * accelerator.num_processes / max(time.time() - start - paused, 1e-9)
                bar.set_postfix(loss=f"{logs['train/loss']:.3f}", tok_s=f"{rate:,.0f}",
                                pad=f"{padding(float(tokens), slots):.1%}")
                accelerator.log(logs, step=step)
            pause = time.time()
            if step % cfg.eval_steps == 0 or stop:
                with timer.paused():  # the step split counts training steps only
                    metrics = run_eval(method, eval_loader, cfg.eval_batches, accelerator)
                history.append((step, metrics))
                best.offer(accelerator, trainable, step, metrics)
                accelerator.log({"eval/" + k: v for k, v in metrics.items() if not k.startswith("path/")}, step=step)
                bar.write(f"step {step}: " + format_metrics(metrics))
            if step % cfg.save_steps == 0 or stop:
                state = {"step": step, "epoch": epoch, "batches_done": batches_done, "metrics": metrics,
                         "run_id": run_id, "fingerprint": fingerprint, "total_steps": total, "best": best.record}
                save_checkpoint(accelerator, output_dir, state, cfg.save_total_limit)
                if main:
                    best.prune()
            paused += time.time() - pause
            if stop:
                if out_of_time:
                    accelerator.print(cut_short(step, total, cfg.max_minutes))
                break
        else:
            epoch, batches_done = epoch + 1, 0
    bar.close()
    if step > first_step:
        n = accelerator.num_processes
        accelerator.print(step_report(timer.seconds(), step - first_step, int(tokens) * n, slots * n,
                                      time.time() - start - paused))
    if weights_fingerprint(method.target) != fingerprint["target_weights"]:
        raise RuntimeError("the frozen target's weights changed during training: a drafter trained on a moving "
                           "target is wrong; check that no optimizer or engine received the target's parameters")
    accelerator.wait_for_everyone()
    # every rank helps gather the weights (ZeRO-3 / FSDP shard them); rank 0 fits the tree and writes once. A
    # sharded target needs every rank in each of its forwards: then every rank fits the same tree in step (the
    # same drafter, prompts and greedy decoding make the same calls) and the others' copies are thrown away.
    in_step = is_sharded(method.target)
    full = gathered_module(accelerator, trainable, everywhere=in_step)
    method.trainable = full if main or in_step else accelerator.unwrap_model(trainable, keep_fp32_wrapper=False)
    if main:
        metrics = best.restore(method.trainable, step) or metrics
        method.save(method.trainable, output_dir, metrics)
        save_recipe(cfg, output_dir)
        if history:
            report_saved(cfg, history, method.label)
    elif in_step:
        metrics = best.restore(method.trainable, step) or metrics
        with tempfile.TemporaryDirectory() as scratch, contextlib.redirect_stdout(io.StringIO()):
            method.save(method.trainable, Path(scratch), metrics)
    accelerator.wait_for_everyone()  # the others wait for the save (ddp_timeout_minutes bounds it)
    accelerator.end_training()
    return history


def cut_short(step: int, total: int, minutes: float) -> str:
    """What a run stopped by its time budget says: how far it got of what it planned, and how to go on."""
    return (f"stopping at step {step} of {total} ({step / total:.0%}): the {minutes:g}-minute budget (--max_minutes) is "
            "spent, so the drafter saved is trained that far only; --resume latest --max_minutes 0 goes on to the "
            "planned steps")


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
