"""Parameters re-homed as views of one tensor, so that drafting runs several layers that read one input as a
single kernel: Medusa's K heads as one batched matmul, a draft layer's q/k/v (and gate/up) projections as one
matmul, its two input norms' weights as one multiply.

The parameters keep their names, objects and values (each becomes a view of its slice), so nothing is held
twice. Only a generation joins them: its drafter's modules are marked (`for_drafting`) when it starts and
`unjoin`ed when it ends, each parameter then back in storage of its own. Between generations a drafter is an
ordinary module, for training wrappers (DDP, DeepSpeed, FSDP keep parameters in buffers of their own),
accelerate's save_model (which drops tensors that share storage) and hooks. Joining happens outside autograd,
on plain tensors only (not ZeRO-3 placeholders, not DTensors, not meta), on layers without hooks; elsewhere
callers run the layers one by one. A move or cast gives the parameters new storage: they are joined again.
"""

from __future__ import annotations

import torch
from torch import nn

from selfspec.heads.projection import is_plain_linear


def rehome(parameters: list[nn.Parameter], stack: bool) -> torch.Tensor:
    """One tensor holding `parameters`, stacked along a new first dimension (`stack`) or concatenated along
    the first; each parameter then views its slice. The values move in one at a time, so the peak extra
    memory is one parameter's, and none is held twice afterwards."""
    first = parameters[0]
    rows = [p.shape[0] for p in parameters]
    shape = (len(parameters), *first.shape) if stack else (sum(rows), *first.shape[1:])
    joined = first.new_empty(shape)
    start = 0
    for i, parameter in enumerate(parameters):
        part = joined[i] if stack else joined[start : start + rows[i]]
        part.copy_(parameter.data)
        parameter.data = part
        start += rows[i]
    return joined


def joinable(parameters: list[torch.Tensor], stack: bool) -> bool:
    """Plain, non-empty tensors on one real device in one dtype (not ZeRO-3 placeholders, not DTensors), of
    one shape (`stack`) or one shape past the first dimension."""
    first = parameters[0]
    return all(
        type(p.data) is torch.Tensor
        and not hasattr(p, "ds_id")
        and p.numel() > 0
        and p.device == first.device != torch.device("meta")
        and p.dtype == first.dtype
        and (p.shape == first.shape if stack else p.shape[1:] == first.shape[1:])
        for p in parameters
    )


def needs_grad(parameters: list[torch.Tensor], x: torch.Tensor) -> bool:
    """Whether autograd records this call (training): joined kernels are for drafting only."""
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in parameters))


class Joined:
    """`parameters` as one tensor (see `rehome`), made on first use and again after they moved; None where
    they cannot be joined."""

    def __init__(self, parameters: list[nn.Parameter], stack: bool = False) -> None:
        self.parameters, self.stack = parameters, stack
        self.tensor: torch.Tensor | None = None
        self.pointers: list[int] = []

    def get(self) -> torch.Tensor | None:
        pointers = [p.data_ptr() for p in self.parameters]
        if self.tensor is None or pointers != self.pointers:
            self.tensor = None
            if not joinable(self.parameters, self.stack):
                return None
            # outside inference mode: parameters that became inference tensors could not be trained again
            with torch.inference_mode(False), torch.no_grad():
                self.tensor = rehome(self.parameters, self.stack)
            self.pointers = [p.data_ptr() for p in self.parameters]
        return self.tensor


DRAFTING = "_joins_when_drafting"  # set by `for_drafting` on each module of a generation's drafter


def for_drafting(module: nn.Module) -> nn.Module:
    """Let `module`'s layers join their parameters (returned as is) until `unjoin(module)`: a generation
    starts. A module not marked never joins, its no-grad validation forwards in training included."""
    for child in module.modules():
        child.__dict__[DRAFTING] = True
    return module


def unjoin(module: nn.Module) -> None:
    """A generation ended: each joined parameter inside `module` gets storage of its own again (a copy of its
    slice), and the marks go."""
    for child in module.modules():
        for key in [k for k in child.__dict__ if k.startswith("_joined_")]:
            group = child.__dict__.pop(key)
            if group.tensor is not None:
                with torch.inference_mode(False), torch.no_grad():
                    for parameter in group.parameters:
                        parameter.data = parameter.data.clone()
        child.__dict__.pop(DRAFTING, None)


def joined(owner: nn.Module, key: str, parameters: list[nn.Parameter], x: torch.Tensor, stack: bool = False):
    """`parameters` of `owner` joined (`rehome`) for drafting on x, remembered on owner under `key`: the
    joined tensor, or None under autograd, outside a generation or where they cannot be joined (the caller
    runs them one by one). A parameter joins one group only: another group of it would re-home it back and
    forth. A parameter object replaced since (`load_state_dict(assign=True)`) makes the group anew."""
    if not owner.__dict__.get(DRAFTING) or needs_grad(parameters, x):
        return None
    group = owner.__dict__.get("_joined_" + key)
    if group is None or any(a is not b for a, b in zip(group.parameters, parameters, strict=True)):
        group = owner.__dict__["_joined_" + key] = Joined(parameters, stack)
    return group.get()


def joined_weights(
    owner: nn.Module, names: tuple[str, ...], x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The weight and bias (None: no biases) of owner's nn.Linear layers `names` joined along the output
    dimension (see `joined`), for drafting on x; None where they cannot be."""
    linears = [getattr(owner, name) for name in names]
    biases = [linear.bias for linear in linears]
    if any((b is None) != (biases[0] is None) for b in biases) or not all(map(is_plain_linear, linears)):
        return None  # hooks (offloading, quantisation, user's) would not run for a joined matmul
    key = "_".join(names)
    weight = joined(owner, key, [linear.weight for linear in linears], x)
    bias = None if biases[0] is None else joined(owner, key + "_bias", biases, x)
    if weight is None or (biases[0] is not None and bias is None):
        return None
    return weight, bias


def joined_linear(owner: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> torch.Tensor | None:
    """owner's nn.Linear layers `names`, which all read x (..., in), as one matmul when drafting -> their
    outputs side by side (..., sum of their widths); None where `joined_weights` is. The same values as
    each layer's own call (a matmul's columns do not depend on their neighbours: checked on the CPU in
    float32 and bf16)."""
    joined = joined_weights(owner, names, x)
    return None if joined is None else nn.functional.linear(x, *joined)


def gated_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' gated MLP (LlamaMLP and its kin: down(act(gate(x)) * up(x))), gate and up as one matmul
    when drafting; any other MLP as it is."""
    gated = hasattr(mlp, "gate_proj") and not (mlp._forward_hooks or mlp._forward_pre_hooks)
    both = joined_linear(mlp, ("gate_proj", "up_proj"), x) if gated else None
    if both is None:
        return mlp(x)
    gate, up = both.chunk(2, dim=-1)
    return mlp.down_proj(mlp.act_fn(gate) * up)


def drop_joined(module: nn.Module) -> None:
    """Forget every joined tensor inside `module` (before a move or cast: else the old storage stays alive
    until the next draft)."""
    for child in module.modules():
        for key in [k for k in child.__dict__ if k.startswith("_joined_")]:
            del child.__dict__[key]
