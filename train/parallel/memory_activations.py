"""Activation bytes of one training micro-batch on one rank, counted from the shapes of the target and the
drafter.

Each term is a tensor the step holds, read off the code that makes it (heads/eagle3.py, train/eagle3.py,
heads/medusa.py, train/methods/medusa.py, transformers' Llama modules); docs/memory.md lists them. Under
autocast (bf16 mixed precision) a Linear saves the bf16 cast of its input, one cast per Linear; an RMSNorm
computes in float32 and saves a float32 copy of its input and a bf16 copy of its normed output; accelerate
turns a prepared module's outputs into float32. Without mixed precision everything is float32 and the casts
vanish.

    n = rows x positions        H hidden, I MLP width, h heads x d head_dim,
                                V target vocabulary, N draft vocabulary
"""

from __future__ import annotations

from typing import Any

from torch import nn

from selfspec.heads.families import family
from selfspec.train.methods.chunked_loss import chunk_rows

F32 = 4


def _width(cfg: Any) -> tuple[int, bool]:
    """Bytes of an activation under the run's precision, and whether autocast casts (bf16/fp16) happen."""
    cast = cfg.precision in ("bf16", "fp16")
    return (2 if cast else F32), cast


def _target_width(cfg: Any) -> int:
    return cfg.target_dtype.itemsize


def _shape(target: nn.Module) -> tuple[int, int, int, int]:
    text = target.config.get_text_config()
    return (
        text.hidden_size,
        text.num_hidden_layers,
        getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        target.get_output_embeddings().weight.shape[0],
    )


def target_forward_bytes(cfg: Any, target: nn.Module, draft: nn.Module, rows: int, length: int) -> int:
    """Peak of the frozen target's no-grad forward: the hidden states it returns (every layer's with EAGLE-3's
    output_hidden_states, else the last), the fused features, and one layer's working tensors (q, k, v,
    attention output, and the MLP's gate, up and product)."""
    at = _target_width(cfg)
    H, L, inner, _ = _shape(target)
    tokens = rows * length
    layers = getattr(draft.config, "feature_layers", None)
    kept = (L + 1 + len(layers) + 1) * H if layers else H
    return at * tokens * (kept + 4 * H + 3 * inner)


def _norm(n: int, H: int, a: int, cast: bool, grad: bool) -> int:
    """An RMSNorm's saved bytes (the weight's grad needs the normed input; a grad to the input needs the
    input)."""
    if not cast:
        return F32 * n * H if grad else F32 * n * H
    return (F32 + a) * n * H if grad else a * n * H


def eagle3_bytes(cfg: Any, target: nn.Module, draft: nn.Module, rows: int, length: int) -> int:
    """The peak of an EAGLE-3 step (heads/eagle3.py, train/methods/step_loss.py): `ttt_steps` unrolled draft
    steps over length - 1 positions."""
    a, cast = _width(cfg)
    at = _target_width(cfg)
    H, _, _, V = _shape(target)
    layer = draft.config.layer
    h, d, inner = layer["num_attention_heads"], layer["head_dim"], layer["intermediate_size"]
    N, fused, steps = draft.lm_head.out_features, len(draft.config.feature_layers), cfg.ttt_steps
    B, T = rows, length - 1
    n, hd = B * T, h * d  # k and v are repeated to h heads (repeat_kv) before they are saved

    def step(i: int) -> int:
        norms = _norm(n, H, a, cast, True) + _norm(
            n, H, a, cast, False
        )  # hidden_norm, input_layernorm(embeds)
        qkv_in = (
            3 * a * 2 * H if cast else F32 * 2 * H
        ) * n  # q/k/v_proj each cast cat(normed embeds, hidden)
        # q, repeated k and v, the contiguous copies matmul makes of q, keys and values for its bmm, o_proj's
        # input
        attn_proj = 7 * a * n * hd
        rope = 2 * a * B * T * d  # cos, sin
        scores = B * h * T * (T + i) * (F32 + (a if cast else 0)) + B * T * T  # softmax out, its cast, ~mask
        post = _norm(n, H, a, cast, True) + (2 * a * n * H if cast else F32 * n * H)  # norm, gate/up inputs
        mlp = 4 * a * n * inner  # gate (silu input), silu output, up, product (down_proj's input)
        return norms + qkv_in + attn_proj + rope + scores + post + mlp

    saved = sum(step(i) for i in range(steps)) + (a * n * fused * H if cast else 0)  # fc's cast input
    features = at * B * (T + 1) * (fused + 1) * H  # the target's fused layers and last hidden states
    unroll_end = saved + features + (F32 * n * fused * H if cast else 0) + steps * a * n * H  # fp32 fc input
    outputs = steps * F32 * n * H  # the step outputs, float32 once they leave the prepared module
    label_rows = B * (T - 1)  # positions whose next token carries the loss (all of a packed text block)
    chunk = min(label_rows, chunk_rows(V))
    labels = at * label_rows * H + min(label_rows, chunk) * V * (
        at + (F32 if at < F32 else 0)
    )  # argmax chunk
    kept = sum(B * (T - 1 - i) * H * (F32 + at) for i in range(steps))  # checkpointed chunks' inputs
    ce_chunk = chunk * N * (3 * F32 + a + at)  # soft labels, logits, log-softmax of the live chunk
    loss = (
        saved + features + outputs + at * label_rows * H + max(labels - at * label_rows * H, kept + ce_chunk)
    )
    backward = (
        saved + kept + outputs + B * h * T * (T + steps) * (a + 2 * F32)
    )  # the last step's softmax grads
    return max(unroll_end + steps * F32 * n * H, loss, backward)


def medusa_bytes(cfg: Any, target: nn.Module, draft: nn.Module, rows: int, length: int) -> int:
    """The peak of a Medusa-1 step (train/methods/medusa.py): K heads of residual blocks on the last hidden
    states."""
    a, _ = _width(cfg)
    at = _target_width(cfg)
    H, _, _, V = _shape(target)
    K, layers = draft.config.num_heads, draft.config.num_layers
    B, T = rows, length
    M = B * (T - 2)  # positions some head learns from
    hidden = at * B * T * H + at * M * H  # the target's last hidden states and their loss positions
    blocks = K * layers * 2 * a * M * H  # per residual block: the SiLU's input and the block's output
    outputs = K * F32 * M * H  # the heads' features, float32 once they leave the prepared module
    kept = sum(
        F32 * B * (T - 2 - k) * H for k in range(K)
    )  # each head's loss positions, held by its checkpoint
    chunk = min(M, chunk_rows(V))
    ce_chunk = chunk * V * (a + 2 * F32) + chunk * H * a  # bf16 logits, float32 copy, log-softmax
    return hidden + blocks + outputs + kept + ce_chunk


def activation_bytes(cfg: Any, target: nn.Module, draft: nn.Module, rows: int, length: int) -> int:
    """Peak activation bytes of one micro-batch of `rows` sequences of `length` tokens (the drafter's
    side)."""
    drafter_family = family(draft.config.kind)
    title = (
        "Medusa-2 (a LoRA trained inside the target)"
        if getattr(cfg, "medusa2", False)
        else drafter_family.title
    )
    if drafter_family.activation_bytes is None or getattr(cfg, "medusa2", False):
        raise ValueError(
            f"no activation model for {title} drafters yet: Medusa-1 and EAGLE-3 are modelled "
            "(docs/memory.md)"
        )
    return drafter_family.load("activation_bytes")(cfg, target, draft, rows, length)
