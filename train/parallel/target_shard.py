"""The frozen target, whole on every rank (the default: fastest where it fits) or sharded over the ranks by
the engine that shards the drafter (`--shard_target true`), for targets that do not fit one device.

- ZeRO-3: transformers partitions the weights as they load (the registered DeepSpeed config), and a second
  DeepSpeed engine without an optimizer gathers each module's weights for its forward and frees them after,
  as TRL does for its reference model.
- FSDP2: each decoder layer and the inner model are `fully_shard`ed, frozen, resharded after every forward.

Either way the input embedding and the lm_head stay whole on every rank: the losses call them by themselves
(outside the target's forward) every step, chunk by chunk, and read their weights directly, as SpecForge and
speculators keep whole copies of the same two. Everything else (the decoder layers and the final norm) is 1/N.
Every rank must then call the target equally often: the loop's batches and evaluation already do, and the tree
fitting at the end runs on every rank in step (train/loop/training.py). Self-distillation, the feature cache
and Medusa-2 make unequal calls or train the target, and are refused with it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from accelerate import Accelerator

from selfspec.train.loop.config import ConfigError
from selfspec.train.parallel.distributed import deepspeed_plugin, local_tensor, unpartitioned, zero_stage

MIB = 2**20


def check_shard_target(cfg: Any, accelerator: Accelerator) -> None:
    """Refuse, before the target loads, a sharded target the run cannot use."""
    if not getattr(cfg, "shard_target", False):
        return
    from accelerate.utils import DistributedType

    if zero_stage(accelerator) != 3 and accelerator.distributed_type != DistributedType.FSDP:
        raise ConfigError(
            "--shard_target true needs an engine that shards weights: launch with --config_file "
            "configs/accelerate/deepspeed-zero3.yaml or configs/accelerate/fsdp.yaml"
        )
    for name, why in (
        ("self_distill", "regenerate the data first with train/regenerate.py"),
        ("cache_features", "read the features from the target as it trains (--cache_features false)"),
        ("medusa2", "Medusa-2 trains a LoRA inside the target"),
    ):
        if getattr(cfg, name, False):
            raise ConfigError(
                f"--{name} true does not work with --shard_target true (every rank must call a sharded "
                f"target equally often): {why}"
            )


def load_training_target(cfg: Any, accelerator: Accelerator):
    """The frozen target and its tokenizer for a training run: whole on every rank, or with `cfg.shard_target`
    sharded by the run's engine; each rank then prints how much of it it holds."""
    from selfspec.train.loop.training import load_frozen_target

    check_shard_target(cfg, accelerator)
    if not getattr(cfg, "shard_target", False):
        with unpartitioned(accelerator):  # whole on every rank, also under ZeRO-3: it only makes features
            return load_frozen_target(cfg.model, accelerator.device, cfg.target_dtype)
    if deepspeed_plugin(accelerator) is not None:
        target, tokenizer = load_frozen_target(cfg.model, accelerator.device, cfg.target_dtype)  # partitioned
        zero3_target(target, accelerator, cfg)
    else:
        target, tokenizer = load_frozen_target(cfg.model, torch.device("cpu"), cfg.target_dtype)
        fsdp2_target(target, accelerator.device)
    local, whole = resident_bytes(target)
    print(
        f"target on this rank: {local / MIB:.2f} MiB of {whole / MIB:.2f} MiB ({local} of {whole} bytes; "
        f"rank {accelerator.process_index} of {accelerator.num_processes})",
        flush=True,
    )
    return target, tokenizer


def heads_of(target: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The input embedding's and lm_head's weights (one tensor when they are tied)."""
    params = [*target.get_input_embeddings().parameters(), *target.get_output_embeddings().parameters()]
    return list({id(p): p for p in params}.values())


def zero3_target(target: torch.nn.Module, accelerator: Accelerator, cfg: Any) -> None:
    """Hand the partitioned target to a DeepSpeed engine of its own (no optimizer), which gathers each
    module's weights for its forward. The embedding and lm_head are gathered first into plain tensors every
    rank keeps, and left out of the engine: it hooks the modules it finds, and they are put back after."""
    import deepspeed

    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    heads = heads_of(target)
    with deepspeed.zero.GatheredParameters(heads):
        whole = {id(p): torch.nn.Parameter(p.data.clone(), requires_grad=False) for p in heads}
    for module in (embed, head):
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = whole[id(p)]  # tied weights stay one tensor
    target.set_input_embeddings(torch.nn.Identity())
    target.set_output_embeddings(torch.nn.Identity())
    engine, *_ = deepspeed.initialize(model=target, config=target_engine_config(target, accelerator, cfg))
    target.__dict__["ds_engine"] = engine  # kept alive with the module (not registered as a submodule)
    target.set_input_embeddings(embed)
    target.set_output_embeddings(head)
    target.eval()


def target_engine_config(target: torch.nn.Module, accelerator: Accelerator, cfg: Any) -> dict:
    """The run's DeepSpeed config for an engine that only runs the frozen target's forward: no optimizer,
    every module's weights freed after its use (norms excepted), the batch sizes filled in (accelerate fills
    them in for the drafter's engine only)."""
    config = copy.deepcopy(deepspeed_plugin(accelerator).deepspeed_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    zero = config.setdefault("zero_optimization", {})
    hidden = target.config.get_text_config().hidden_size
    # accelerate fills the configs' "auto" bucket sizes for the drafter's engine only: the same rule
    # (hidden^2) here
    zero.update(
        {
            "stage": 3,
            "stage3_param_persistence_threshold": 10 * hidden,
            "stage3_max_reuse_distance": 0,
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        }
    )
    for key in ("offload_optimizer", "stage3_gather_16bit_weights_on_model_save"):
        zero.pop(key, None)
    batch = cfg.per_device_train_batch_size
    config.update(
        {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": 1,
            "train_batch_size": batch * accelerator.num_processes,
            "gradient_clipping": 0.0,
            "bf16": {"enabled": cfg.target_dtype == torch.bfloat16},
            "fp16": {"enabled": cfg.target_dtype == torch.float16},
        }
    )
    return config


def fsdp2_target(target: torch.nn.Module, device: torch.device) -> None:
    """`fully_shard` every decoder layer, then the inner model (the root the losses call, with the final
    norm), frozen and resharded after every forward; the embedding and lm_head stay whole, on `device`."""
    from torch.distributed.fsdp import fully_shard

    heads = heads_of(target)
    layer_classes = set(getattr(target, "_no_split_modules", None) or [])
    inner = target.base_model
    layers = [m for m in inner.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ConfigError(
            f"--shard_target true found no decoder layers in {type(target).__name__} "
            "(its _no_split_modules names none): use the replicated target (--shard_target false)"
        )
    for layer in layers:
        fully_shard(layer, reshard_after_forward=True)
    plain = type(inner)
    fully_shard(inner, reshard_after_forward=True, ignored_params=set(heads))
    keep_output_capturing(plain, type(inner))
    for p in heads:
        p.data = p.data.to(device)
    target.to(device)  # buffers (rotary frequencies); the sharded parameters are already on the mesh's device
    target.eval()


def resident_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """The bytes of the model's parameters on this rank (partitions, local shards, and whatever is gathered
    and kept) and the bytes of the whole model."""
    local = whole = 0
    for p in model.parameters():
        size = p.element_size()
        whole += (p.ds_numel if hasattr(p, "ds_numel") else p.numel()) * size
        local += local_tensor(p).numel() * size
        if hasattr(p, "ds_tensor") and p.data.numel() > 0:  # gathered and kept (ZeRO-3 ds_persist)
            local += p.data.numel() * size
    return local, whole


def keep_output_capturing(plain: type, sharded: type) -> None:
    """transformers records hidden states (output_hidden_states) with hooks it looks up by the model's class
    name; FSDP2 renames the class (FSDP<Name>): register the sharded class under the plain one's entry."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # transformers before 5 records hidden states in the forward itself
        return
    flags = dict.get(_CAN_RECORD_REGISTRY, str(plain))
    if flags:
        dict.__setitem__(_CAN_RECORD_REGISTRY, str(sharded), flags)
