"""Vocabulary projections for drafting (x @ W.T over tens of thousands of rows), laid out for the CPU's GEMM.

A draft call projects a few rows (the heads, a tree frontier) onto the vocabulary. On CPU in float32, MKL's
GEMM computes that 2-4x faster as W @ x.T than as x @ W.T (`F.linear`) when x has 2-64 rows: an 8192 x 384
head with 8 rows takes 3.9 ms through `F.linear` and 1.7 ms the other way round on the 2-core AMD EPYC this
was measured on, and no case measured is slower (bfloat16 and float16 are unaffected, so they keep
`F.linear`). Only the summation order can differ. The target's own lm_head goes through it too during prefill
and tree verification (infer.target.Target.vocab_layout), as a tree's few rows are the same case.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def vocab_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., H) -> x @ weight.T + bias (..., V), as `F.linear`; float32 on CPU without autograd uses
    W @ x.T."""
    if (
        x.dtype != torch.float32
        or x.device.type != "cpu"
        or weight.device != x.device
        or weight.dtype != x.dtype
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.mm(weight, rows.T).T.contiguous()  # (M, V); top-k and softmax then read rows
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def is_plain_linear(head: nn.Module) -> bool:
    """Whether `head(x)` is exactly x @ weight.T + bias: an `nn.Linear` itself, not a subclass (quantised
    layers), and without hooks (accelerate offload, weight_norm, pruning) that would change or move its
    weight."""
    return (
        type(head) is nn.Linear
        and not getattr(head, "_hf_hook", None)
        and not head._forward_hooks
        and not head._forward_pre_hooks
        and not nn.modules.module._global_forward_hooks
        and not nn.modules.module._global_forward_pre_hooks
    )


def apply_head(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """head(x) for a vocabulary projection; a plain `nn.Linear` goes through `vocab_logits`, anything else
    (quantised, wrapped by LoRA, hooked) runs its own forward."""
    if is_plain_linear(head):
        return vocab_logits(x, head.weight, head.bias)
    return head(x)
