"""What the training loop needs to be right with several processes (DDP, DeepSpeed ZeRO-2), in one place.

- The frozen target is loaded outside ZeRO-3's partitioning init (`unpartitioned`): it only computes
  features, never through the engine, so each rank holds it whole.
- DeepSpeed clips gradients itself and ignores `clip_grad_norm_`: its `gradient_clipping` follows
  `--max_grad_norm` (`configure_deepspeed`).
- ZeRO-3 and FSDP are refused for now (`check_engine`): see there.
- The drafter is saved from a state dict every rank helps gather (`gathered_module`), written once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from accelerate import Accelerator

from train.config import ConfigError


def deepspeed_plugin(accelerator: Accelerator):
    """The run's DeepSpeed plugin, or None when DeepSpeed is not in use."""
    return getattr(accelerator.state, "deepspeed_plugin", None)


def zero_stage(accelerator: Accelerator) -> int:
    """The ZeRO stage of a DeepSpeed run (0 without DeepSpeed)."""
    plugin = deepspeed_plugin(accelerator)
    return int(plugin.zero_stage or 0) if plugin is not None else 0


@contextlib.contextmanager
def unpartitioned(accelerator: Accelerator) -> Iterator[None]:
    """Build or load models whole on every rank, even when ZeRO-3's partitioning init is on."""
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


def check_engine(accelerator: Accelerator) -> None:
    """Refuse the engines this loop cannot run correctly yet, before any work: ZeRO-3 and FSDP gather a
    layer's weights on every call, so every rank must call each layer equally often, but the chunked
    losses call the vocabulary projection a data-dependent number of times (ranks would hang)."""
    from accelerate.utils import DistributedType

    if zero_stage(accelerator) == 3 or accelerator.distributed_type == DistributedType.FSDP:
        engine = "DeepSpeed ZeRO-3" if zero_stage(accelerator) == 3 else "FSDP"
        raise ConfigError(f"{engine} is not supported yet (its per-call weight gathering would hang on the chunked "
                          "losses): use configs/accelerate/deepspeed-zero2.yaml or configs/accelerate/ddp.yaml")


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
        raise ConfigError(f"the DeepSpeed config sets gradient_clipping {clip} but --max_grad_norm is {max_grad_norm}: "
                          'set "gradient_clipping": "auto" in the JSON (it then follows --max_grad_norm) or pass '
                          f"--max_grad_norm {clip}")


def scheduler_steps_per_update(accelerator: Accelerator) -> int:
    """How many times the prepared scheduler advances per optimizer step: accelerate steps it once per process
    (so it sees global batches), but under DeepSpeed the engine steps it once."""
    return 1 if deepspeed_plugin(accelerator) is not None else accelerator.num_processes


def gathered_module(accelerator: Accelerator, prepared: torch.nn.Module) -> torch.nn.Module | None:
    """The trained drafter with its full weights, on the main process (None on the others).

    Every rank must call this: under ZeRO-3 and FSDP the weights are sharded and gathering them is a
    collective. The drafter is rebuilt from its config (our drafters are all `cls(config)`) and the
    gathered state loaded into it in float32, so a ZeRO-3 or FSDP run saves what a single process would."""
    state = accelerator.get_state_dict(prepared)
    if not accelerator.is_main_process:
        return None
    inner = accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)
    module = type(inner)(inner.config)
    module.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    return module.to(accelerator.device)
