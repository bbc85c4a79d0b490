"""The body EAGLE-3 and P-EAGLE share: fc over a fusion of target layers' hidden states, one decoder layer
whose attention reads [normed embedding; normed hidden], a final norm and an lm_head of its own over a draft
vocabulary.

    target hidden_states hs[l1], hs[l2], hs[l3]   (B, T, 3H)  --fc-->  h (B, T, H)      (target features only)
    layer input   cat(input_layernorm(embed(x_{t+1})), hidden_norm(h))        (B, T, 2H) -> q, k, v
    residual      h (before hidden_norm); then post-attention norm + MLP, residual again  -> o (B, T, H)
    logits        lm_head(norm(o))  over draft_vocab_size tokens; target id = draft id + d2t[draft id]

Two variants of vllm-project/speculators (computed as vLLM 0.32's llama_eagle3.py does), off by default:
    norm_before_fc        fc(input_norm(cat(hs[l1], hs[l2], hs[l3])))  one RMSNorm over all nH features
    norm_before_residual  residual hidden_norm(h) instead of h (the attention input is unchanged)

Parameter names follow the SafeAILab/SGLang EAGLE-3 checkpoints (`fc`, `midlayer.*`, `norm`, `lm_head`,
`d2t`, `t2d`; `input_norm` as speculators, vLLM and SGLang name it); the attention and MLP are transformers'
Llama modules with 2H-wide q/k/v inputs. The target's embedding is passed in, never stored.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import (
    DraftCache,
    DraftVocabulary,
    Float32RotaryEmbedding,
    attend,
    continue_after,
    llama_config,
    norms_side_by_side,
    use_draft_norms,
)
from selfspec.heads.io import PretrainedHeads
from selfspec.heads.joined import gated_mlp
from selfspec.heads.projection import apply_head


def default_feature_layers(num_layers: int) -> list[int]:
    """hidden_states indices of a low, a middle and a high layer: [2, L // 2, L - 3] (hs[0] is the embedding
    output; hs[L] already has the final norm applied, so it is never used)."""
    return sorted({min(max(i, 1), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)})


class Eagle3Layer(nn.Module):
    """The draft decoder layer: attention over [normed embedding; normed hidden], residual from the hidden."""

    def __init__(self, config: Any, norm_before_residual: bool = False) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.self_attn = LlamaAttention(config, layer_idx=0)
        attn = self.self_attn
        for name, heads in (
            ("q_proj", config.num_attention_heads),
            ("k_proj", config.num_key_value_heads),
            ("v_proj", config.num_key_value_heads),
        ):
            setattr(attn, name, nn.Linear(2 * hidden, heads * attn.head_dim, bias=config.attention_bias))
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[input_layernorm(embeds); hidden_norm(hidden)] (B, T, 2H)."""
        return norms_side_by_side(self, ("input_layernorm", "hidden_norm"), [embeds, hidden])

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual from the un-normed hidden state (norm_before_residual: the normed one), then the MLP
        block."""
        residual = self.hidden_norm(hidden) if self.norm_before_residual else hidden  # (B, T, H)
        hidden = residual + attended
        return hidden + gated_mlp(self.mlp, self.post_attention_layernorm(hidden))


class FusedDraft(DraftVocabulary, PretrainedHeads):
    """fc (nH -> H) on fused target features + one EAGLE-3 layer + norm + lm_head over the draft vocabulary; a
    family's drafter class subclasses it and names its `kind`."""

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.check_kind(config)
        self.config = config
        lc = llama_config(config)
        hidden, vocab = config.hidden_size, config.vocab_size
        draft_vocab = config.draft_vocab_size or vocab
        fused = len(config.feature_layers) * hidden
        # norm_before_fc: one RMSNorm over the whole concatenated fc input (not one per hidden state: fc_norm)
        self.input_norm = LlamaRMSNorm(fused, lc.rms_norm_eps) if config.norm_before_fc else None
        self.fc = nn.Linear(fused, hidden, bias=False)
        self.midlayer = Eagle3Layer(lc, norm_before_residual=config.norm_before_residual)
        self.norm = LlamaRMSNorm(hidden, lc.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        # draft id -> target id offset, and which target ids the draft vocabulary holds (identity by default)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(vocab) < draft_vocab)
        self.rotary_emb = Float32RotaryEmbedding(lc)
        use_draft_norms(self)

    # ---------------------------------------------------------------- forward

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Fused target features (..., nH) -> the layer's hidden input (..., H)."""
        if self.input_norm is not None:
            features = self.input_norm(features)  # (..., nH)
        return self.fc(features)

    def logits(self, out: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Layer outputs (..., H) -> logits over the draft vocabulary (..., N) (the target's lm_head is
        unused)."""
        return apply_head(self.lm_head, self.norm(out))

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        embed: nn.Module,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: DraftCache | None = None,
    ) -> torch.Tensor:
        """hidden (B, T, H) (fused target features through `fuse`, or the drafter's own outputs), input_ids
        (B, T) = the next tokens -> layer outputs (B, T, H), before the final norm. `attention_mask`
        (B, 1, T, past + T) is boolean (True = visible) or additive; None means causal over the cache and
        these T positions. `cache` (a `DraftCache`) keeps the keys and values across calls; `position_ids`
        default to continuing from the cached length."""
        return self.run_layer(hidden, embed(input_ids).to(hidden.dtype), attention_mask, position_ids, cache)

    def run_layer(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache: DraftCache | None,
    ) -> torch.Tensor:
        """The decoder layer on hidden states and input embeddings (B, T, H) each -> its outputs (B, T, H)."""
        T = hidden.shape[1]
        position_ids, attention_mask = continue_after(cache, T, hidden.device, position_ids, attention_mask)
        cos, sin = self.rotary_emb.at(hidden, position_ids, cache.capacity if cache is not None else None)
        layer = self.midlayer
        attended = attend(
            layer.self_attn, layer.attention_input(embeds, hidden), cos, sin, attention_mask, cache, 0
        )
        if cache is not None:
            cache.advance(T)
        return layer.finish(hidden, attended)


def attend_with_own(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    context: torch.Tensor,
    own_keys: list[torch.Tensor],
    own_values: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Training attention of draft steps over whole sequences: one softmax over the masked context keys
    (B, h, T, T) (`context` (B, 1, T, T) bool, True = visible) and, per position, its own keys of the later
    steps (B, h, T, d) each: the same as attention over all of them with the block mask, at O(T^2 + iT).
    q (B, h, T, d) -> (B, h, T, d)."""
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~context, torch.finfo(torch.float32).min)
    own = [(q * k).sum(-1, keepdim=True).float() * scale for k in own_keys]  # (B, h, T, 1) each
    probs = torch.softmax(torch.cat([scores, *own], dim=-1), dim=-1).to(q.dtype)
    T = keys.shape[-2]
    out = torch.matmul(probs[..., :T], values)
    for j, v in enumerate(own_values):
        out = out + probs[..., T + j, None] * v
    return out
