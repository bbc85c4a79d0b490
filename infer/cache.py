"""The target's KV cache during speculative decoding: keep the prefix and the accepted path only."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model: torch.nn.Module, max_length: int) -> DynamicCache:
    """An empty cache for `model`; fails early where sliding-window layers would drop tree positions."""
    window = getattr(model.config, "sliding_window", None)
    layer_types = getattr(model.config, "layer_types", None) or []
    uses_window = window is not None and (not layer_types or any("sliding" in t for t in layer_types))
    if uses_window and max_length > window:
        raise ValueError(
            f"prompt + max_new_tokens + tree ({max_length} tokens) exceeds the model's sliding window ({window}); "
            "tree verification keeps a full cache, so shorten the generation or use a full-attention model"
        )
    return DynamicCache()


def keep_accepted(cache: DynamicCache, prefix_len: int, path: torch.Tensor, length: int) -> None:
    """After verifying a tree appended at `prefix_len`, keep only the nodes `path[:length]` (root first).

    Positions in `path` are tree node indices; node i sits at cache position prefix_len + i. The
    accepted entries move to prefix_len .. prefix_len + length, the rest is cut off. The prefix is
    never touched or recomputed.
    """
    src = prefix_len + path[:length]  # (L,) increasing, src[j] >= prefix_len + j, so the copy is safe
    for layer in cache.layers:
        for name in ("keys", "values"):
            kv = getattr(layer, name)  # (B, H, S, D)
            kv[:, :, prefix_len : prefix_len + length] = kv.index_select(2, src)
            setattr(layer, name, kv[:, :, : prefix_len + length])


def truncate(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of every layer (DynamicCache.crop's meaning changed across versions)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]
