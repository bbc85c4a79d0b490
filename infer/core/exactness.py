"""What tree verification cannot reproduce exactly, refused in one line before decoding starts.

Verification runs the target once over a whole tree with a full KV cache and positions from each node's depth.
That equals one-token decoding only where attention depends on nothing but the causal prefix and each
position's own rotary frequencies:
  - sliding-window and chunked attention drop positions a full cache keeps (past the window or chunk);
  - LongRoPE and dynamic NTK RoPE choose their frequencies from the largest position of the forward: past
    their switch point the tree's nodes get other frequencies than plain decoding gives them;
  - ALiBi biases and linear-attention / state-space layers (hybrids included) keep no per-position KV cache
    a tree could branch in.
Every setting is read from the text config (a composite config, e.g. Gemma-3's, holds it there).
"""

from __future__ import annotations

from typing import Any

# model types whose layers are (partly) recurrent: linear attention, state-space or RNN mixers
RECURRENT_MODELS = frozenset(
    {
        "mamba",
        "mamba2",
        "falcon_mamba",
        "jamba",
        "falcon_h1",
        "zamba",
        "zamba2",
        "bamba",
        "rwkv",
        "recurrent_gemma",
        "lfm2",
        "granitemoehybrid",
        "nemotron_h",
        "qwen3_next",
        "minimax",
        "xlstm",
    }
)
ALIBI_MODELS = frozenset({"bloom", "mpt"})
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def text_config(config: Any) -> Any:
    """The config that describes the decoder (itself, unless composite)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_architecture(config: Any) -> None:
    """Refuse a target whose attention a tree cannot be verified with exactly, whatever the length."""
    text = text_config(config)
    kind = getattr(text, "model_type", "") or getattr(config, "model_type", "")
    attn_config = getattr(text, "attn_config", None)
    alibi = (
        kind in ALIBI_MODELS
        or getattr(text, "alibi", False) is True
        or getattr(text, "position_embedding_type", None) == "alibi"
        or bool(
            getattr(attn_config, "alibi", False)
            if not isinstance(attn_config, dict)
            else attn_config.get("alibi")
        )
    )
    if alibi:
        raise ValueError(
            f"{kind} uses ALiBi attention biases, which tree verification does not reproduce: "
            "speculative decoding supports rotary or learned position embeddings only"
        )
    layers = [str(t) for t in (getattr(text, "layer_types", None) or [])]
    blocks = [str(t) for t in (getattr(text, "layers_block_type", None) or [])]
    other = sorted(
        {t for t in layers if t not in ATTENTION_LAYERS} | {t for t in blocks if "attention" not in t}
    )
    if kind in RECURRENT_MODELS or other:
        what = (
            f"layers of type {', '.join(other)}"
            if other
            else "recurrent (linear-attention or state-space) layers"
        )
        raise ValueError(
            f"{kind} has {what}: their state cannot branch into a tree, so speculative decoding "
            "supports attention-only targets"
        )


def check_length(config: Any, max_length: int) -> None:
    """Refuse a generation of `max_length` positions (prompt, new tokens and the tree) that would cross a
    point where the target's attention or rotary frequencies stop matching one-token decoding."""
    text = text_config(config)
    layers = [str(t) for t in (getattr(text, "layer_types", None) or [])]
    window = getattr(text, "sliding_window", None)
    if window is not None and (not layers or "sliding_attention" in layers) and max_length > window:
        raise ValueError(
            f"prompt + max_new_tokens + tree ({max_length} tokens) exceeds the model's sliding window "
            f"(sliding_window {window}); tree verification keeps a full cache, so shorten the "
            "generation or use a full-attention model"
        )
    chunk = getattr(text, "attention_chunk_size", None)
    if chunk is not None and (not layers or "chunked_attention" in layers) and max_length > chunk:
        raise ValueError(
            f"prompt + max_new_tokens + tree ({max_length} tokens) exceeds the model's attention chunk "
            f"(attention_chunk_size {chunk}); tree verification keeps a full cache, so shorten the "
            "generation"
        )
    for rope in rope_settings(text):
        kind = rope.get("rope_type", rope.get("type"))
        if kind not in ("longrope", "dynamic"):
            continue
        switch = (
            rope.get("original_max_position_embeddings")
            or getattr(text, "original_max_position_embeddings", None)
            or getattr(text, "max_position_embeddings", None)
        )
        if switch is not None and max_length > switch:
            raise ValueError(
                f"prompt + max_new_tokens + tree ({max_length} tokens) passes {switch} positions, where "
                f"the model's {kind} RoPE switches its frequencies by the largest position of a forward: "
                f"a tree's nodes would get other frequencies than plain decoding; keep the generation "
                f"within {switch} tokens"
            )


def rope_settings(text: Any) -> list[dict]:
    """The RoPE parameter dicts of a text config: one, or one per layer type (Gemma-3)."""
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return []
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return list(rope.values())
    return [rope]
