"""What the training loop needs to be right with several processes (DDP, DeepSpeed ZeRO-2/3, FSDP2), in one
place.

- The frozen target is loaded outside ZeRO-3's partitioning init (`unpartitioned`): it only computes
  features, never through the engine, so each rank holds it whole.
- DeepSpeed clips gradients itself and ignores `clip_grad_norm_`: its `gradient_clipping` follows
  `--max_grad_norm` (`configure_deepspeed`).
- ZeRO-3 and FSDP2 shard the drafter and gather a layer's weights on every call, so every rank makes the
  same calls: the chunked losses agree on their chunk counts (`max_over_ranks`), evaluation gives every
  rank as many batches, and methods other than forward that the losses call are registered (`expose_methods`).
- The drafter is saved from a state dict every rank helps gather (`gathered_module`), written once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from selfspec.train.loop.config import ConfigError


def deepspeed_plugin(accelerator: Accelerator):
    """The run's DeepSpeed plugin, or None when DeepSpeed is not in use."""
    return getattr(accelerator.state, "deepspeed_plugin", None)


def zero_stage(accelerator: Accelerator) -> int:
    """The ZeRO stage of a DeepSpeed run (0 without DeepSpeed)."""
    plugin = deepspeed_plugin(accelerator)
    return int(plugin.zero_stage or 0) if plugin is not None else 0


@contextlib.contextmanager
def unpartitioned(accelerator: Accelerator, seed: int | None = None) -> Iterator[None]:
    """Build or load models whole on every rank, even when ZeRO-3's partitioning init is on. With a `seed`,
    random initialisation starts from it on every rank: ZeRO-3 and FSDP keep each rank's own shard of what
    it built (nothing is broadcast), so every rank must build the same drafter whatever it did before."""
    if seed is not None:
        from accelerate.utils import set_seed

        set_seed(seed)
    plugin = deepspeed_plugin(accelerator)
    if plugin is None:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    # transformers partitions in from_pretrained whenever the registered DeepSpeed config says ZeRO-3
    # (accelerate's zero3_init_context_manager(enable=False) registers it again): unregister it meanwhile
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def fsdp_without_gpu(accelerator: Accelerator) -> None:
    """Run FSDP2 on CPU processes (gloo) when the launch config asks for FSDP on a machine without GPUs.

    accelerate turns FSDP on only for accelerator devices (on CPU the run would silently become DDP), while
    torch's FSDP2 shards over gloo as well: switch the multi-CPU state to FSDP with the plugin the launch
    config describes, so tests and CPU machines run the same code path as GPUs do (bf16 mixed precision
    included: FSDP2 gathers the drafter's weights in bf16 and reduces its gradients in bf16)."""
    import os

    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or accelerator.distributed_type != (
        DistributedType.MULTI_CPU
    ):
        return
    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* settings of the launch
    if accelerator.mixed_precision != "no":  # what accelerate does for a plugin it builds itself (GPUs)
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP


def check_engine() -> None:
    """Refuse, before any work (and before accelerate builds an FSDP plugin), the engine this loop does not
    drive: FSDP version 1. FSDP2's per-module hooks are what let the losses call the drafter's own
    projections outside its forward."""
    import os

    if (
        os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        and os.environ.get("FSDP_VERSION", "1") != "2"
    ):
        raise ConfigError(
            "FSDP version 1 is not supported: set `fsdp_version: 2` under fsdp_config "
            "(as configs/accelerate/fsdp.yaml does)"
        )


def launch_request(cmdline: list[str], cwd: str) -> dict[str, Any] | None:
    """What an `accelerate launch` command line asked for: the engine ("deepspeed" | "fsdp" | None) and the
    number of processes, from its --config_file and --num_processes; None when it is not an accelerate
    launch."""
    import yaml

    if "launch" not in cmdline or not any(
        Path(a).name == "accelerate" or a.endswith("accelerate.commands.launch")
        for a in cmdline[: cmdline.index("launch") + 1]
    ):
        return None
    args = cmdline[cmdline.index("launch") + 1 :]

    def option(name: str) -> str | None:
        for i, arg in enumerate(args):
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
        return None

    config: dict[str, Any] = {}
    path = option("--config_file")
    if path:
        try:
            config = yaml.safe_load((Path(cwd) / path).read_text()) or {}
        except (OSError, yaml.YAMLError):
            config = {}
    kind = str(config.get("distributed_type", "")).upper()
    engine = (
        "deepspeed"
        if kind == "DEEPSPEED" or "deepspeed_config" in config
        else "fsdp"
        if kind == "FSDP"
        else None
    )
    processes = option("--num_processes") or config.get("num_processes") or 1
    try:
        processes = int(processes)
    except (TypeError, ValueError):
        processes = 1
    cpu = "--cpu" in args or str(config.get("use_cpu", "")).lower() == "true" or kind == "MULTI_CPU"
    return {"config_file": path, "engine": engine, "num_processes": processes, "cpu": cpu}


def check_launch_in_effect(
    request: dict[str, Any] | None, env: dict[str, str], gpus: int | None = None, cores: int | None = None
) -> None:
    """Refuse a run whose launch asked for DeepSpeed, FSDP or several processes that are not in effect
    (accelerate launch --cpu silently drops a DeepSpeed or FSDP config and starts one plain process), or for
    more processes than a machine without GPUs has cores (a GPU config there starts them all as CPU
    processes), or for more processes on this machine than it has GPUs (the extra ones fail with a CUDA
    error). `gpus`, `cores`: this machine's (default: counted)."""
    if request is None:
        return
    where = (
        f"accelerate launch --config_file {request['config_file']}"
        if request["config_file"]
        else "accelerate launch"
    )
    flag = {"deepspeed": "ACCELERATE_USE_DEEPSPEED", "fsdp": "ACCELERATE_USE_FSDP"}.get(
        request["engine"] or ""
    )
    if flag and env.get(flag, "false").lower() != "true":
        fix = (
            "drop --cpu and set DS_ACCELERATOR=cpu instead, as the README's CPU commands do"
            if request["engine"] == "deepspeed"
            else "drop --cpu (FSDP2 runs on CPU without it)"
        )
        raise ConfigError(
            f"{where} asks for {'DeepSpeed' if flag.endswith('DEEPSPEED') else 'FSDP'}, but it is not "
            f"in effect (--cpu drops that config): {fix}"
        )
    running = int(env.get("WORLD_SIZE", "1"))
    if request["num_processes"] > running:
        raise ConfigError(
            f"{where} asks for {request['num_processes']} processes, but {running} is running "
            "(--cpu with a GPU config starts one): launch with configs/accelerate/cpu-2proc.yaml, or "
            "without --cpu"
        )
    gpus = torch.cuda.device_count() if gpus is None else gpus
    cores = (os.cpu_count() or 1) if cores is None else cores
    if gpus == 0 and request["num_processes"] > cores:
        raise ConfigError(
            f"{where} asks for {request['num_processes']} processes, but this machine has no GPU and "
            f"{cores} CPU cores, so they would all share those: launch with "
            "configs/accelerate/cpu.yaml (one process) or cpu-2proc.yaml (two), or pass --num_processes"
        )
    # this machine's processes (torchrun's and DeepSpeed's launchers say; unknown: nothing checked)
    here = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or 0)
    if 0 < gpus < here and not request["cpu"]:
        raise ConfigError(
            f"{where} starts {here} processes on this machine, but it has {gpus} GPU"
            f"{'s' if gpus > 1 else ''} (each process needs its own): pass --num_processes {gpus}"
        )


def check_launch() -> None:
    """check_launch_in_effect for this process, from its parent's command line (Linux /proc; elsewhere nothing
    to read, nothing checked)."""
    try:
        parent = Path(f"/proc/{os.getppid()}")
        cmdline = (parent / "cmdline").read_bytes().decode(errors="replace").split("\0")
        cwd = os.readlink(parent / "cwd")
    except OSError:
        return
    check_launch_in_effect(launch_request(cmdline, cwd), dict(os.environ))


def engine_name(accelerator: Accelerator) -> str:
    """How the drafter is trained across processes, for the run's opening line."""
    from accelerate.utils import DistributedType

    if deepspeed_plugin(accelerator) is not None:
        return f"DeepSpeed ZeRO-{zero_stage(accelerator)}"
    if accelerator.distributed_type == DistributedType.FSDP:
        return f"FSDP{accelerator.state.fsdp_plugin.fsdp_version}"
    return "DDP" if accelerator.num_processes > 1 else "one process"


def gathers_weights(accelerator: Accelerator) -> bool:
    """Whether the engine shards the drafter's weights and gathers a layer's on every call (ZeRO-3, FSDP):
    then every rank must call each layer equally often, or the gathers pair up wrongly and ranks hang."""
    from accelerate.utils import DistributedType

    return zero_stage(accelerator) == 3 or accelerator.distributed_type == DistributedType.FSDP


def max_over_ranks(accelerator: Accelerator) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Under an engine that gathers weights per call: a function giving the elementwise max of an integer
    tensor over all ranks (how many calls each rank makes: the most any rank needs). None otherwise."""
    if not gathers_weights(accelerator) or accelerator.num_processes == 1:
        return None

    def agree(counts: torch.Tensor) -> torch.Tensor:
        counts = counts.to(accelerator.device)
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
        return counts.cpu()

    return agree


def expose_methods(
    accelerator: Accelerator, prepared: torch.nn.Module, names: tuple[str, ...] = ("logits", "project_head")
) -> None:
    """Let the losses call these drafter methods besides forward (EAGLE-3's `logits` and the Medusa heads'
    `project_head`, chunk by chunk): under
    FSDP2 they then gather the sharded weights as forward does. (ZeRO-3 hooks every submodule already.)"""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        return
    from torch.distributed.fsdp import register_fsdp_forward_method

    for name in names:
        if callable(getattr(prepared, name, None)):
            register_fsdp_forward_method(prepared, name)


def configure_deepspeed(accelerator: Accelerator, max_grad_norm: float) -> None:
    """Make DeepSpeed's config say what the run's options say, before the engine is built:
    `gradient_clipping` absent or "auto" becomes --max_grad_norm (accelerate would otherwise fill in 1.0);
    a different number is refused rather than silently overriding the option."""
    plugin = deepspeed_plugin(accelerator)
    if plugin is None:
        return
    config = plugin.deepspeed_config
    clip = config.get("gradient_clipping", "auto")
    if clip == "auto":
        config["gradient_clipping"] = float(max_grad_norm)
    elif float(clip) != float(max_grad_norm):
        raise ConfigError(
            f"the DeepSpeed config sets gradient_clipping {clip} but --max_grad_norm is {max_grad_norm}: "
            'set "gradient_clipping": "auto" in the JSON (it then follows --max_grad_norm) or pass '
            f"--max_grad_norm {clip}"
        )


def scheduler_steps_per_update(accelerator: Accelerator) -> int:
    """How many times the prepared scheduler advances per optimizer step: accelerate steps it once per process
    (so it sees global batches), but under DeepSpeed the engine steps it once."""
    return 1 if deepspeed_plugin(accelerator) is not None else accelerator.num_processes


def gathered_module(
    accelerator: Accelerator, prepared: torch.nn.Module, everywhere: bool = False
) -> torch.nn.Module | None:
    """The trained drafter with its full weights, on the main process (None on the others; on every rank with
    `everywhere`, for work all ranks do with it in step, like fitting the tree on a sharded target).

    Every rank must call this: under ZeRO-3 and FSDP the weights are sharded and gathering them is a
    collective. The drafter is rebuilt from its config (our drafters are all `cls(config)`) and the
    gathered state loaded into it in float32, so a ZeRO-3 or FSDP run saves what a single process would."""
    inner = accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)
    if not hasattr(inner, "save_pretrained"):  # Medusa-2's target + heads: whole on every rank (refused under
        return inner if accelerator.is_main_process else None  # ZeRO-3/FSDP), saved by parts
    state = accelerator.get_state_dict(prepared)
    if everywhere and accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        held = [{k: v.cpu() for k, v in state.items()} if accelerator.is_main_process else None]
        state = broadcast_object_list(held, from_process=0)[0]
    elif not accelerator.is_main_process:
        return None
    module = plain_class(inner)(inner.config)
    module.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True
    )
    return module.to(accelerator.device)


def plain_class(module: torch.nn.Module) -> type:
    """The module's own class: FSDP2 swaps in a subclass FSDP<Name>(FSDPModule, <Name>) when it shards it."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    while issubclass(cls, FSDPModule):
        cls = next(base for base in cls.__bases__ if base is not FSDPModule)
    return cls


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """What of a parameter this rank stores: ZeRO-3's partition, FSDP2's local shard, or the tensor itself."""
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor
    return p.to_local() if hasattr(p, "to_local") else p


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether some of the model's parameters are stored in pieces across ranks."""
    return any(hasattr(p, "ds_tensor") or hasattr(p, "to_local") for p in model.parameters())
