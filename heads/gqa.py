"""Grouped-query attention through SDPA without copying the keys and values once per query head.

repeat_kv (what transformers' SDPA and eager paths do under a mask) materialises (B, H, S, D) keys and values
from (B, Hkv, S, D) in every layer at every step: for an 8B target at 4K context, ~2 GiB copied per verify
forward. Here either the backend takes the groups itself (`enable_gqa`, where a fused kernel does that under
a mask: the CPU's flash kernel), or the G query heads that share a key head are folded into the query length,

    q (B, Hkv*G, T, D) -> (B, Hkv, G*T, D)     row g*T + t is query head h*G + g at token t
    mask (B, 1, T, S)  -> (B, 1, G*T, S)       the T rows repeated G times: G*T*S, not 2*H*S*D

so that any SDPA kernel (flash, memory-efficient, cuDNN) runs plain multi-head attention over the Hkv heads.
A mask may have one row for every query (DFlash's (B, 1, 1, S)): it is broadcast to T rows before the fold.
The kernel's output may be laid out transposed underneath (CUDA's memory-efficient kernel writes
(B, T, H, Dv)), so the unfold reshapes rather than views.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ALIGN = 16  # a mask's row stride the memory-efficient kernel takes as it is (it pads and copies any other)


def native_gqa(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether SDPA's fused kernels on `device` take grouped heads under a mask (`enable_gqa`) without copies:
    the CPU's flash kernel does; on CUDA, whichever fused backend `gqa_backend` finds (none in torch 2.13's
    memory-efficient kernel; cuDNN where the build has it)."""
    return device.type == "cpu" or gqa_backend(device, dtype) is not None


@functools.cache
def gqa_backend(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> SDPBackend | None:
    """The CUDA backend that runs grouped heads under a boolean mask on a fused kernel, asked once of the
    running torch (`can_use_*_attention`); None where only the math kernel would (then the fold is
    cheaper)."""
    if device.type != "cuda":
        return None
    query = torch.zeros(1, 8, 4, 64, device=device, dtype=dtype)
    key = torch.zeros(1, 2, 16, 64, device=device, dtype=dtype)
    mask = torch.ones(1, 1, 4, 16, device=device, dtype=torch.bool)
    return fused_backend(torch.backends.cuda.SDPAParams(query, key, key, mask, 0.0, False, True))


def fused_backend(params: torch.backends.cuda.SDPAParams) -> SDPBackend | None:
    """The first fused kernel that takes `params` (memory-efficient before cuDNN, as SDPA itself ranks
    them)."""
    if torch.backends.cuda.can_use_efficient_attention(params):
        return SDPBackend.EFFICIENT_ATTENTION
    if torch.backends.cuda.can_use_cudnn_attention(params):
        return SDPBackend.CUDNN_ATTENTION
    return None


def grouped_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """SDPA with `enable_gqa`; on CUDA under the backend `gqa_backend` found, since SDPA ranks the math kernel
    above cuDNN and would otherwise take it for a masked grouped call."""
    backend = gqa_backend(query.device, query.dtype) if mask is not None else None
    if backend is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)


def fold_mask(mask: torch.Tensor, groups: int, queries: int | None = None) -> torch.Tensor:
    """mask (B, 1, T or 1, S) bool or additive -> (B, 1, groups*T, S): the rows repeated per folded query head
    (a one-row mask first broadcast to the `queries` T), in one copy whose row stride is a multiple of ALIGN
    (so the kernel does not pad it again)."""
    B, _, rows, S = mask.shape
    T = queries if queries is not None else rows
    mask = mask.expand(B, 1, T, S)
    width = -(-S // ALIGN) * ALIGN
    folded = mask.new_empty(B, 1, groups, T, width)[..., :S]  # (B, 1, G, T, S), row stride `width`
    folded.copy_(mask[:, :, None].expand(B, 1, groups, T, S))
    return folded.view(B, 1, groups * T, S)


def folds_cheaper(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether folding (a (B, 1, G*T, S) mask copy) moves fewer bytes than repeat_kv's (B, H, S, D) keys and
    values: a tree's few queries, yes; a long prompt's (T ~ S), no."""
    B, H, T, D = query.shape
    groups = H // key.shape[1]
    return mask.shape[0] * groups * T * mask.element_size() < 2 * B * H * D * key.element_size()


def grouped_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    fold: bool | None = None,
) -> torch.Tensor:
    """query (B, Hkv*G, T, D), key and value (B, Hkv, S, D), mask (B or 1, 1, T, S) bool (True = visible) or
    additive -> (B, Hkv*G, T, Dv), query head i reading key head i // G (as repeat_kv pairs them), always on a
    fused kernel's inputs. `fold` True: fold the groups into the query length; False: `enable_gqa`; None: by
    the device and the sizes (the grouped kernel where `native_gqa`, else the fold where it copies less than
    repeating the keys and values, else those repeated)."""
    B, H, T, D = query.shape
    groups = H // key.shape[1]
    if groups == 1:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    if (
        mask is None or fold is False or (fold is None and native_gqa(query.device, query.dtype))
    ):  # no mask: flash takes groups
        return grouped_kernel(query, key, value, mask, scale)
    if (
        mask.dim() != 4 or mask.shape[1] != 1 or (fold is None and not folds_cheaper(query, key, mask))
    ):  # a long prompt's
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    folded = query.reshape(
        B, key.shape[1], groups * T, D
    )  # (B, Hkv, G*T, D): a view when query is contiguous
    out = F.scaled_dot_product_attention(
        folded, key, value, attn_mask=fold_mask(mask, groups, T), scale=scale
    )
    return out.reshape(B, H, T, value.shape[-1])  # (B, Hkv, G*T, Dv) -> (B, H, T, Dv), whatever its strides
