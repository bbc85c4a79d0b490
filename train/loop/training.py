"""The one accelerate training loop every drafter recipe shares: setup -> train -> save.

A recipe supplies a `Method` (train/loop/method.py): the trainable module, its loss on a batch at a step (the
frozen target runs inside, without gradients), its evaluation, and how to save. This loop owns the
accelerator, optimizer, cosine schedule, gradient accumulation and clipping, mixed precision, atomic
checkpoints, exact resume (step, optimizer, scheduler, RNG and data position) and logging; `train` is
set-up, resume, steps, finish.
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
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

from selfspec.heads.config import HeadsConfig
from selfspec.heads.io import atomic_write
from selfspec.shipped.models import resolve_model
from selfspec.train.data.examples import Examples, pad_batch
from selfspec.train.data.fingerprints import run_fingerprint, weights_fingerprint
from selfspec.train.data.packing import PackedExamples, check_packed_target
from selfspec.train.data.records import check_source
from selfspec.train.loop.best import BestWeights
from selfspec.train.loop.checkpoints import (
    check_rng_files,
    check_same_run,
    find_resume,
    prepare_output_dir,
    read_state,
    save_checkpoint,
)
from selfspec.train.loop.method import Method, RunContext, StepContext
from selfspec.train.loop.precision import precision_line
from selfspec.train.loop.step_timer import Pace, StepTimer, padding, step_report
from selfspec.train.loop.train_config import TrainConfig
from selfspec.train.parallel.distributed import (
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
    prepare_output_dir(
        accelerator, Path(cfg.output_dir), cfg.resume, cfg.overwrite_output_dir, resolve_model(cfg.model)
    )
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


@dataclasses.dataclass
class Run:
    """One training run as the loop's parts share it: what `set_up` prepared, and where the run is."""

    cfg: TrainConfig
    accelerator: Accelerator
    method: Method
    module: torch.nn.Module  # the trainable module as the engine wrapped it
    optimizer: Any
    scheduler: Any
    loader: Any
    eval_loader: DataLoader
    total: int  # optimizer steps planned
    fingerprint: dict
    best: BestWeights
    timer: StepTimer
    step: int = 0
    epoch: int = 0
    batches_done: int = 0
    history: list[tuple[int, dict[str, float]]] = dataclasses.field(default_factory=list)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    run_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)


def train(
    cfg: TrainConfig, accelerator: Accelerator, method: Method, train_data: Examples, eval_data: Examples
) -> tuple[list[tuple[int, dict[str, float]]], torch.nn.Module]:
    """Run the loop: set up, resume, take the steps, finish. Returns the validation history [(step, metrics)]
    and the trained module (unwrapped from accelerate); `method.save` has written the result."""
    run = set_up(cfg, accelerator, method, train_data, eval_data)
    resume(run)
    take_steps(run)
    return run.history, finish(run)


def set_up(
    cfg: TrainConfig, accelerator: Accelerator, method: Method, train_data: Examples, eval_data: Examples
) -> Run:
    """The optimizer, schedule and loaders, prepared by accelerate with the trainable module; the run's
    fingerprint (what a resume must match) taken before ZeRO-3/FSDP shard the shapes."""
    params = [p for p in method.trainable.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the drafter has no trainable parameters")
    optimizer = torch.optim.AdamW(
        method.param_groups(cfg.learning_rate),
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.weight_decay,
    )
    # packed rows (train/data/packing.py) for training; validation reads one example per row, so its numbers
    # stay comparable between packed and unpacked runs
    rows = PackedExamples(train_data, cfg.max_length, cfg.seed) if cfg.packing else train_data
    if cfg.packing:
        check_packed_target(method.target)
    loader = DataLoader(
        rows, batch_size=cfg.per_device_train_batch_size, shuffle=True, drop_last=True, collate_fn=pad_batch
    )
    eval_loader = DataLoader(eval_data, batch_size=cfg.per_device_eval_batch_size, collate_fn=pad_batch)
    per_epoch = len(loader) // (cfg.gradient_accumulation_steps * accelerator.num_processes)
    if per_epoch == 0:
        raise ValueError(
            f"{len(rows)} training {'rows' if cfg.packing else 'examples'} make no full optimizer step at "
            f"batch size {cfg.per_device_train_batch_size} x {cfg.gradient_accumulation_steps} accumulation "
            f"x {accelerator.num_processes} processes: add data or lower the batch size"
        )
    total = cfg.max_steps if cfg.max_steps > 0 else math.ceil(per_epoch * cfg.num_epochs)
    ticks = scheduler_steps_per_update(accelerator)  # the prepared scheduler's steps per optimizer step
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, int(cfg.warmup_ratio * total) * ticks, total * ticks
    )
    fingerprint = run_fingerprint(cfg, accelerator, method.trainable, train_data)
    fingerprint["target_weights"] = weights_fingerprint(method.target)
    configure_deepspeed(accelerator, cfg.max_grad_norm)
    module, optimizer, loader, scheduler = accelerator.prepare(method.trainable, optimizer, loader, scheduler)
    expose_methods(accelerator, module)
    timer = StepTimer(
        accelerator.device
    )  # target forward / drafter forward+backward / optimizer (train.step_timer)
    method.start(RunContext(module, max_over_ranks(accelerator), timer))
    global_batch = (
        cfg.per_device_train_batch_size * accelerator.num_processes * cfg.gradient_accumulation_steps
    )
    accelerator.print(
        f"training {sum(p.numel() for p in params) / 1e6:.2f} M parameters for {total} steps "
        f"({len(train_data)} examples of up to {cfg.max_length} tokens"
        f"{f' packed into {len(rows)} rows' if cfg.packing else ''}, {per_epoch} steps per epoch); "
        f"global batch {global_batch} = {cfg.per_device_train_batch_size} per device x "
        f"{accelerator.num_processes} processes x {cfg.gradient_accumulation_steps} accumulation; "
        f"{engine_name(accelerator)}"
    )
    return Run(
        cfg,
        accelerator,
        method,
        module,
        optimizer,
        scheduler,
        loader,
        eval_loader,
        total,
        fingerprint,
        BestWeights(method.best_metric, Path(cfg.output_dir)),
        timer,
    )


def resume(run: Run) -> None:
    """Continue from `--resume`'s checkpoint (the same run: checked) with its weights, optimizer, schedule,
    RNG and data position; a fresh run validates once first (step 0)."""
    cfg, accelerator = run.cfg, run.accelerator
    resume_from = find_resume(cfg.resume, Path(cfg.output_dir))
    if resume_from is not None:
        state = read_state(resume_from)
        check_same_run(resume_from, state.get("fingerprint", {}), run.fingerprint, cfg.resume_allow_changes)
        check_rng_files(resume_from, accelerator.process_index)
        accelerator.load_state(str(resume_from))
        run.step, run.epoch, run.batches_done = state["step"], state["epoch"], state["batches_done"]
        if state.get("total_steps", run.total) != run.total and accelerator.is_main_process:
            print(
                f"note: resuming a run of {state['total_steps']} steps as one of {run.total}: the "
                "learning-rate schedule (and Medusa-2's heads weight) follows the new length from here",
                file=sys.stderr,
            )
        run.run_id = state.get("run_id", run.run_id)
        run.metrics = state.get("metrics") or {}  # a final checkpoint's metrics decide the tree and the card
        run.history = [(run.step, run.metrics)] if run.metrics else []
        run.best.resume(state.get("best"))
        accelerator.print(
            f"resumed from {resume_from} at step {run.step} (epoch {run.epoch}, batch {run.batches_done})"
        )
    if cfg.report_to != "none":
        accelerator.init_trackers(cfg.run_name or Path(cfg.output_dir).name, config=dataclasses.asdict(cfg))
    if run.step == 0 and run.total > 0:
        with run.timer.paused():  # its target forwards are no training step's
            validate(run, tqdm.write)


def take_steps(run: Run) -> None:
    """Optimizer steps up to the planned total (or the time budget), validating and saving on schedule."""
    cfg, accelerator, module, timer = run.cfg, run.accelerator, run.module, run.timer
    bar = tqdm(
        total=run.total,
        initial=run.step,
        disable=not accelerator.is_main_process,
        desc="train",
        dynamic_ncols=True,
    )
    pace = Pace(time.time(), run.step, accelerator.device)
    stop = run.step >= run.total
    while not stop:
        run.loader.set_epoch(run.epoch)
        batches = (
            accelerator.skip_first_batches(run.loader, run.batches_done) if run.batches_done else run.loader
        )
        for batch in batches_keeping_rng(batches):
            module.train()
            with accelerator.accumulate(module), accelerator.autocast():
                with timer.section("forward_backward"):  # the method times its target forward inside
                    out = run.method.loss(batch, StepContext(run.step, run.total))
                    accelerator.backward(out.loss)
                with timer.section("optimizer"):
                    if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(module.parameters(), cfg.max_grad_norm)
                    run.optimizer.step()
                    run.scheduler.step()
                    run.optimizer.zero_grad(set_to_none=True)
            run.batches_done += 1
            pace.count(batch)
            if not accelerator.sync_gradients:
                continue
            run.step += 1
            bar.update(1)
            stop = after_step(run, out.logs, pace, bar)
            if stop:
                break
        else:
            run.epoch, run.batches_done = run.epoch + 1, 0
    bar.close()
    if run.step > pace.first_step:
        n = accelerator.num_processes
        accelerator.print(
            step_report(
                timer.seconds(),
                run.step - pace.first_step,
                int(pace.tokens) * n,
                pace.slots * n,
                pace.training_seconds(),
            )
        )


def after_step(run: Run, logs: dict[str, torch.Tensor], pace: Pace, bar: tqdm) -> bool:
    """Log, validate and save as scheduled after an optimizer step; whether the run stops here."""
    cfg, accelerator, step = run.cfg, run.accelerator, run.step
    out_of_time = (
        cfg.max_minutes > 0
        and step % cfg.logging_steps == 0
        and ranks_agree(accelerator, time.time() - pace.start > cfg.max_minutes * 60)
    )
    stop = step >= run.total or out_of_time
    if step % cfg.logging_steps == 0:
        logs = {"train/" + k: float(v) for k, v in logs.items()} | {"lr": run.scheduler.get_last_lr()[0]}
        rate = float(pace.tokens) * accelerator.num_processes / max(pace.training_seconds(), 1e-9)
        bar.set_postfix(
            loss=f"{logs['train/loss']:.3f}",
            tok_s=f"{rate:,.0f}",
            pad=f"{padding(float(pace.tokens), pace.slots):.1%}",
        )
        accelerator.log(logs, step=step)
    with pace.paused():
        if step % cfg.eval_steps == 0 or stop:
            with run.timer.paused():  # the step split counts training steps only
                validate(run, bar.write)
        if step % cfg.save_steps == 0 or stop:
            state = {
                "step": step,
                "epoch": run.epoch,
                "batches_done": run.batches_done,
                "metrics": run.metrics,
                "run_id": run.run_id,
                "fingerprint": run.fingerprint,
                "total_steps": run.total,
                "best": run.best.record,
            }
            save_checkpoint(accelerator, Path(cfg.output_dir), state, cfg.save_total_limit)
            if accelerator.is_main_process:
                run.best.prune()
    if out_of_time:
        accelerator.print(cut_short(step, run.total, cfg.max_minutes))
    return stop


def validate(run: Run, write: Callable[[str], None]) -> None:
    """Validation metrics at the current step: logged, kept in the history, offered as the best weights."""
    run.metrics = run_eval(run.method, run.module, run.eval_loader, run.cfg.eval_batches, run.accelerator)
    run.history.append((run.step, run.metrics))
    run.best.offer(run.accelerator, run.module, run.step, run.metrics)
    if run.step:
        run.accelerator.log(
            {"eval/" + k: v for k, v in run.metrics.items() if not k.startswith("path/")}, step=run.step
        )
    write(f"step {run.step}: " + format_metrics(run.metrics))


def finish(run: Run) -> torch.nn.Module:
    """Check the target stayed frozen, then save the trained module (the best validation's weights where the
    method names a metric) with its card and recipe; returns it, unwrapped."""
    accelerator, method, cfg = run.accelerator, run.method, run.cfg
    if weights_fingerprint(method.target) != run.fingerprint["target_weights"]:
        raise RuntimeError(
            "the frozen target's weights changed during training: a drafter trained on a moving "
            "target is wrong; check that no optimizer or engine received the target's parameters"
        )
    accelerator.wait_for_everyone()
    # every rank helps gather the weights (ZeRO-3 / FSDP shard them); rank 0 fits the tree and writes once. A
    # sharded target needs every rank in each of its forwards: then every rank fits the same tree in step (the
    # same drafter, prompts and greedy decoding make the same calls) and the others' copies are thrown away.
    main, in_step = accelerator.is_main_process, is_sharded(method.target)
    full = gathered_module(accelerator, run.module, everywhere=in_step)
    trained = full if main or in_step else accelerator.unwrap_model(run.module, keep_fp32_wrapper=False)
    metrics = run.metrics
    if main:
        metrics = run.best.restore(trained, run.step) or metrics
        method.save(trained, Path(cfg.output_dir), metrics)
        save_recipe(cfg, Path(cfg.output_dir))
        if run.history:
            report_saved(cfg, run.history, method.label)
    elif in_step:
        metrics = run.best.restore(trained, run.step) or metrics
        with tempfile.TemporaryDirectory() as scratch, contextlib.redirect_stdout(io.StringIO()):
            method.save(trained, Path(scratch), metrics)
    accelerator.wait_for_everyone()  # the others wait for the save (ddp_timeout_minutes bounds it)
    accelerator.end_training()
    return trained


def cut_short(step: int, total: int, minutes: float) -> str:
    """What a run stopped by its time budget says: how far it got of what it planned, and how to go on."""
    return (
        f"stopping at step {step} of {total} ({step / total:.0%}): the {minutes:g}-minute budget "
        "(--max_minutes) is spent, so the drafter saved is trained that far only; --resume latest "
        "--max_minutes 0 goes on to the planned steps"
    )


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
    """The run's options (and its command, when launched as a script) next to the heads, for their model
    card."""
    recipe = dataclasses.asdict(cfg)
    script = Path(sys.argv[0])
    if script.parent.name == "train" and script.suffix == ".py":
        recipe["command"] = "accelerate launch " + " ".join([f"train/{script.name}", *sys.argv[1:]])
    atomic_write(
        output_dir / "training_args.json", lambda tmp: Path(tmp).write_text(json.dumps(recipe, indent=2))
    )


def ranks_agree(accelerator: Accelerator, flag: bool) -> bool:
    """The main rank's decision, shared with every rank (so all stop at the same step)."""
    if accelerator.num_processes == 1:
        return flag
    from accelerate.utils import broadcast

    return bool(broadcast(torch.tensor([int(flag)], device=accelerator.device)).item())


@torch.no_grad()
def run_eval(
    method: Method, module: torch.nn.Module, loader: DataLoader, max_batches: int, accelerator: Accelerator
) -> dict[str, float]:
    """The first `max_batches` validation batches, split across ranks (rank r takes r, r + n, ...) and the
    sums reduced, so n ranks compute what one would, n times faster."""
    module.eval()
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
    return HeadsConfig(
        kind=kind,
        base_model=cfg.model,
        hidden_size=target.config.get_text_config().hidden_size,
        vocab_size=target.get_output_embeddings().weight.shape[0],
        dtype=str(cfg.target_dtype).removeprefix("torch."),
        **fields,
    )


def report_saved(cfg: TrainConfig, history: list[tuple[int, dict[str, float]]], what: str) -> None:
    print(f"\nvalidation: {format_metrics(history[-1][1])}")
    print(f"saved {what} to {cfg.output_dir}")
    print(f"generate with:  selfspec generate --heads {cfg.output_dir} --prompt 'def parse('")
    print(f"benchmark with: selfspec bench --heads {cfg.output_dir}")


def format_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3f}" for k, v in metrics.items() if not k.startswith(("rank_acc", "path/")))
