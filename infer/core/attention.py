"""The target's attention during speculative decoding: transformers' SDPA attention, minus its KV copy.

Registered with transformers' attention interfaces as ATTENTION ("selfspec_sdpa"): its masks are the ones
"sdpa" builds, and its forward is `sdpa_attention_forward` except where grouped-query attention under a mask
would go through repeat_kv (every key and value head copied G times, per layer, per step): there it runs
`heads.gqa.grouped_sdpa` on the un-repeated keys and values. `Target` switches a model that was loaded with
"sdpa" to it for the length of each forward (`using_grouped_attention`), and back, so the user's model is left
as it was. Whatever this function does not cover (softcapping, position biases, dropout) goes to transformers'
own sdpa path unchanged, which takes or refuses it as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward, use_gqa_in_sdpa
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from selfspec.heads.gqa import grouped_sdpa

ATTENTION = "selfspec_sdpa"


def grouped_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, H, T, D), key and value (B, Hkv, S, D) -> the
    output (B, T, H, Dv) and no weights."""
    groups = query.shape[1] // key.shape[1]
    if (
        groups == 1
        or attention_mask is None
        or dropout
        or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("s_aux") is not None
        or use_gqa_in_sdpa(attention_mask, key, value)
    ):  # nothing to save, or what grouped_sdpa cannot do
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    out = grouped_sdpa(
        query, key, value, attention_mask, scaling
    )  # (B, H, T, Dv); a long prompt: repeated K/V
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, grouped_sdpa_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # 2D masks and no mask: exactly what "sdpa" builds


def model_configs(model: nn.Module) -> list:
    """Every distinct config object the model's modules read their attention implementation from."""
    seen: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


@contextlib.contextmanager
def using_grouped_attention(configs: list) -> Iterator[None]:
    """Within: every config in `configs` that says "sdpa" says ATTENTION; each is restored on exit
    (a model loaded with "eager" or a flash kernel keeps its own)."""
    switched = [c for c in configs if c._attn_implementation == "sdpa"]
    for config in switched:
        set_implementation(config, ATTENTION)
    try:
        yield
    finally:
        for config in switched:
            set_implementation(config, "sdpa")


def set_implementation(config, name: str) -> None:
    """Set one config's attention implementation, not its sub-configs' (the property's setter recurses into
    them; `model_configs` lists each config a module reads on its own)."""
    if "_attn_implementation_internal" in vars(config):
        config._attn_implementation_internal = name
    else:
        config._attn_implementation = name
