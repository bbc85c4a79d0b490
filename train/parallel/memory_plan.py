"""Memory per GPU of a drafter training run, from the target's config alone (no weights, no data).

    python -m selfspec.train.parallel.memory_plan --recipe configs/eagle/llama3.1-8b-eagle3.yaml \
        --engine fsdp --gpus 8 --gpu_memory_gib 80 --context 2048 4096 8192

The target and the drafter are built on the meta device from their configs (parameter counts exactly as the
run builds them); what a training step holds on one rank is then counted in bytes (docs/memory.md explains
each term):

    target        the frozen weights in the run's dtype: whole on every rank, or 1/N with --shard_target
                  (but the embedding and lm_head, which stay whole)
    drafter       float32 master weights, gradients, AdamW's two states and the run's initial copy, split by
                  the engine (ENGINES); bf16 working copies where the engine or autocast makes them
    activations   what the drafter's forward saves for its backward, the loss's live chunk, the target's
                  features (train/parallel/memory_activations.py), per micro-batch at each context length

The activations are modelled for the autocast path (one process, DDP, FSDP2);
tests/training/test_memory_plan.py checks the whole prediction against the peak measured in a real CPU
training step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from selfspec.heads.families import FAMILIES, family, recipe_families
from selfspec.shipped.recipes import RECIPES
from selfspec.train.loop.config import ConfigError, load_config, recipe_path
from selfspec.train.parallel.memory_activations import activation_bytes, target_forward_bytes

GIB = 2**30
# configs of published targets that ship with selfspec, so that a plan needs no hub: hub id ->
# configs/models/*.json
SHIPPED_CONFIGS = {
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b-instruct.json",
    "meta-llama/Llama-3.3-70B-Instruct": "llama-3.3-70b-instruct.json",
}
# bytes per drafter parameter on each rank: (held whole by every rank, held 1/N), with bf16 mixed precision.
# "bf16" entries become float32 (4 bytes) without mixed precision; docs/memory.md gives the sources.
ENGINES: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    # one process: fp32 weights, grads, AdamW exp_avg + exp_avg_sq; autocast caches a bf16 copy of each weight
    "single": ({"weights": 4, "grads": 4, "adam": 8, "autocast copy (bf16)": 2}, {}),
    # DDP adds its gradient buckets (a second copy of the grads: accelerate keeps gradient_as_bucket_view off)
    "ddp": ({"weights": 4, "grads": 4, "adam": 8, "autocast copy (bf16)": 2, "DDP buckets": 4}, {}),
    # ZeRO-2 in bf16: bf16 weights and grads whole; fp32 master weights, AdamW and fp32 grads sharded
    "zero2": ({"weights (bf16)": 2, "grads (bf16)": 2}, {"master weights": 4, "adam": 8, "grads (fp32)": 4}),
    # ZeRO-3: bf16 weights gathered for the step and bf16 grads before their reduce-scatter, whole; the rest
    # sharded
    "zero3": (
        {"gathered weights (bf16)": 2, "grads (bf16)": 2},
        {"weights (bf16)": 2, "master weights": 4, "adam": 8, "grads (fp32)": 4},
    ),
    # FSDP2, one unit per drafter (configs/accelerate/fsdp.yaml): unsharded bf16 weights and grads during the
    # step
    "fsdp": ({"gathered weights (bf16)": 2, "grads (bf16)": 2}, {"weights": 4, "grads": 4, "adam": 8}),
}
# DeepSpeed's gradient buckets, each of reduce_bucket_size elements in the grads' dtype, which the shipped
# configs set to "auto" (accelerate: hidden_size^2; DeepSpeed's own default, 5e8, would be 1-2 GB on every
# rank): ZeRO-3 one, made at start; ZeRO-2 two with overlap_comm (deepspeed 0.19, runtime/zero/stage3.py,
# stage_1_and_2.py)
GRADIENT_BUCKETS = {"zero2": 2, "zero3": 1}
# the run keeps the drafter's initial float32 state dict (train/recipes/feature_run.py, train/medusa.py)
INITIAL_COPY = 4


def recipe_class(path: str | Path) -> type:
    """The config class of a recipe YAML, from its folder (configs/<recipe>/, the families that recipe
    trains)."""
    recipe = recipe_path(str(path)).resolve().parent.name
    trained = recipe_families(recipe)
    if not trained:
        folders = sorted({f.recipe for f in FAMILIES.values() if f.recipe})
        raise ConfigError(f"{path} is not a drafter recipe (one under configs/{{{','.join(folders)}}}/)")
    return trained[0].load("recipe_config")


def load_recipe(path: str | Path, overrides: list[str] | None = None):
    """A recipe's config, with `--key value` overrides as the training scripts take them."""
    return load_config(recipe_class(path), ["--config", str(path), *(overrides or [])])


def target_config(name: str) -> Any:
    """The target's config from a config.json file, a model folder, a shipped short name (`demo`), a hub id
    whose config ships with selfspec (SHIPPED_CONFIGS), or the local hub cache."""
    from selfspec.shipped.models import resolve_model

    if name in SHIPPED_CONFIGS:
        name = str(RECIPES / "models" / SHIPPED_CONFIGS[name])
    path = Path(name).expanduser()
    if path.suffix == ".json" and path.is_file():
        return AutoConfig.for_model(**json.loads(path.read_text()))
    return AutoConfig.from_pretrained(resolve_model(name))


def meta_target(config: Any) -> nn.Module:
    """The target built on the meta device: shapes and parameter counts, no memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def meta_drafter(cfg: Any, target: nn.Module) -> nn.Module:
    """The recipe's drafter on the meta device, built as its training script builds it (without the data: the
    draft vocabulary's size, not its tokens, decides the shapes)."""
    drafter_family = family(cfg.kind)
    if drafter_family.meta_drafter is None:
        raise ValueError(f"no memory model for {drafter_family.title} recipes yet (docs/memory.md)")
    with torch.device("meta"):
        return drafter_family.load("meta_drafter")(cfg, target)


def parameter_bytes(module: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of a module's parameters and buffers (tied weights once), in `dtype` where given
    (floating ones)."""
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        size = (
            torch.finfo(dtype).bits // 8 if dtype is not None and t.is_floating_point() else t.element_size()
        )
        total += t.numel() * size
    return total


def drafter_state_bytes(
    params: int, engine: str, gpus: int, mixed_precision: str, hidden: int = 0
) -> dict[str, int]:
    """Bytes per rank of `params` trainable drafter parameters under `engine` on `gpus` ranks, by what holds
    them (`hidden`: the drafter's hidden size, which sizes DeepSpeed's gradient buckets)."""
    if engine not in ENGINES:
        raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    whole, sharded = ENGINES[engine]
    parts = {}
    for share, table in ((1, whole), (gpus, sharded)):
        for name, size in table.items():
            if mixed_precision == "no" and ("bf16" in name or size == 2):
                if name.startswith("autocast"):
                    continue  # no autocast, no copy
                size = 4
            parts[name] = -(-params * size // share)
    if engine in GRADIENT_BUCKETS:
        parts["gradient buckets"] = (
            GRADIENT_BUCKETS[engine] * hidden * hidden * (4 if mixed_precision == "no" else 2)
        )
    parts["initial copy"] = params * INITIAL_COPY
    return parts


@dataclasses.dataclass
class Plan:
    """Bytes on one rank of a training run (see `memory_plan`)."""

    target_params: int
    drafter_params: int
    target: int  # the target's weights on this rank
    drafter: dict[str, int]  # the drafter's weights, grads, optimizer states on this rank, by part
    activations: dict[int, int]  # context length -> peak activation bytes of one micro-batch
    optimizer_step: int  # AdamW's temporaries (its denominators), beside the grads, when it steps
    rows: int  # micro-batch rows (per_device_train_batch_size)
    gpu_memory: int

    def total(self, length: int) -> int:
        """The peak: the activations' (the grads counted whole) or the optimizer step's, whichever is
        higher."""
        return self.target + sum(self.drafter.values()) + max(self.activations[length], self.optimizer_step)

    def fits(self, length: int) -> bool:
        return self.total(length) <= self.gpu_memory


def memory_plan(
    cfg: Any,
    config: Any,
    engine: str,
    gpus: int,
    contexts: list[int],
    shard_target: bool = False,
    gpu_memory_gib: float = 80.0,
    rows: int | None = None,
    foreach: bool = True,
) -> Plan:
    """The per-rank plan of recipe `cfg` on the target of `config`: `engine` in ENGINES, `gpus` ranks,
    micro-batches of `rows` rows (default: the recipe's per_device_train_batch_size) at each of `contexts`
    tokens. `foreach`: AdamW steps all tensors at once (torch's default on GPUs: one float32 denominator per
    parameter), else one tensor at a time (on CPUs: the sqrt and the denominator of the largest tensor)."""
    if shard_target and engine not in ("zero3", "fsdp"):
        raise ValueError(
            "the target is sharded under ZeRO-3 or FSDP2 only (--shard_target): use --engine zero3 or fsdp"
        )
    target = meta_target(config)
    draft = meta_drafter(cfg, target)
    dtype = cfg.target_dtype
    whole = parameter_bytes(target, dtype)
    params = sum(p.numel() for p in draft.parameters())
    rows = rows or cfg.per_device_train_batch_size
    layer = (
        parameter_bytes(target.base_model.layers[0], dtype) if shard_target else 0
    )  # gathered one at a time
    acts = {}
    for length in contexts:
        drafter_side = activation_bytes(cfg, target, draft, rows, length)
        target_side = target_forward_bytes(cfg, target, draft, rows, length) + layer
        acts[length] = max(drafter_side, target_side)
    sharded = bool(ENGINES[engine][1].get("adam"))
    local = -(-params // gpus) if sharded else params
    step = 4 * local if foreach else 2 * 4 * max(p.numel() for p in draft.parameters())
    # --shard_target keeps the embedding and the lm_head whole on every rank: the losses call them outside the
    # target
    kept = parameter_bytes(
        nn.ModuleList(
            {id(m): m for m in (target.get_input_embeddings(), target.get_output_embeddings())}.values()
        ),
        dtype,
    )
    on_rank = -(-(whole - kept) // gpus) + kept if shard_target else whole
    return Plan(
        sum(p.numel() for p in target.parameters()),
        params,
        on_rank,
        drafter_state_bytes(params, engine, gpus, cfg.precision, config.get_text_config().hidden_size),
        acts,
        step,
        rows,
        int(gpu_memory_gib * GIB),
    )


def format_plan(plan: Plan, name: str) -> str:
    """The plan as the script prints it."""
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    lines = [
        f"{name}: target {plan.target_params / 1e9:.2f} B parameters, drafter "
        f"{plan.drafter_params / 1e6:.1f} M",
        f"  target on this rank             {gib(plan.target)}",
    ]
    lines += [f"  drafter {part:<24}{gib(size)}" for part, size in plan.drafter.items()]
    for length, act in plan.activations.items():
        lines.append(
            f"  activations at {length:>6} tokens x {plan.rows} row(s): {gib(act)} "
            f"({act / (length * plan.rows) / 2**20:.2f} MiB per token); total {gib(plan.total(length))} of "
            f"{gib(plan.gpu_memory)}: {'fits' if plan.fits(length) else 'does NOT fit'}"
        )
    return "\n".join(lines)


def markdown_rows(name: str, placement: str, plan: Plan) -> str:
    """One README table row: model, target placement, target, drafter states, activations and total per
    context."""
    gib = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    acts = " / ".join(f"{gib(a)} ({a / (n * plan.rows) / 2**20:.1f})" for n, a in plan.activations.items())
    totals = " / ".join(f"{gib(plan.total(n))} {'✓' if plan.fits(n) else '✗'}" for n in plan.activations)
    return (
        f"| {name} | {placement} | {gib(plan.target)} | {gib(sum(plan.drafter.values()))} | {acts} | "
        f"{totals} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m selfspec.train.parallel.memory_plan", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--recipe", required=True, help="a drafter recipe YAML (configs/eagle/..., configs/medusa/...)"
    )
    parser.add_argument(
        "--model", help="the target: config.json, folder, short name or hub id (default: the recipe's)"
    )
    parser.add_argument("--engine", default="ddp", choices=list(ENGINES))
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu_memory_gib", type=float, default=80.0)
    parser.add_argument("--context", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument(
        "--rows", type=int, default=None, help="micro-batch rows (default: the recipe's batch size)"
    )
    parser.add_argument("--shard_target", action="store_true", help="the target sharded 1/N (ZeRO-3, FSDP2)")
    parser.add_argument(
        "--markdown", action="store_true", help="print the README table's rows, both placements"
    )
    args, overrides = parser.parse_known_args(argv)
    cfg = load_recipe(args.recipe, overrides)
    if cfg.mixed_precision == "auto":  # the plan is for GPUs, where auto means bf16, not for this machine
        cfg = dataclasses.replace(cfg, mixed_precision="bf16")
    model = args.model or cfg.model
    config = target_config(model)
    if args.markdown:
        print(
            "| target | target placement | target GiB | drafter + grads + AdamW GiB | activations GiB "
            f"(MiB/token) {' / '.join(f'{n // 1024}K' for n in args.context)} | total GiB "
            f"(fits {args.gpu_memory_gib:g}) |"
        )
        print("|---|---|---|---|---|---|")
        for shard in (False, True):
            plan = memory_plan(
                cfg, config, args.engine, args.gpus, args.context, shard, args.gpu_memory_gib, args.rows
            )
            print(
                markdown_rows(
                    model.split("/")[-1], "sharded 1/" + str(args.gpus) if shard else "replicated", plan
                )
            )
        return
    plan = memory_plan(
        cfg, config, args.engine, args.gpus, args.context, args.shard_target, args.gpu_memory_gib, args.rows
    )
    print(
        f"{args.engine} on {args.gpus} GPU(s) of {args.gpu_memory_gib:g} GiB, {cfg.precision} mixed "
        f"precision, target {'sharded' if args.shard_target else 'replicated'}"
    )
    print(format_plan(plan, model))


if __name__ == "__main__":
    main()
