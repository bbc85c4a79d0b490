"""EAGLE draft model (EAGLE-1/2): autoregression on the target's own features.

At position t the drafter reads the target's feature f_t (the hidden state its lm_head reads) and
the embedding of the token x_{t+1} that followed, maps [embedding; feature] (2H) to H with `fc`,
runs Llama decoder layer(s) and outputs a prediction of f_{t+1}; the target's frozen lm_head turns
it into a distribution over x_{t+2}. Fed its own predictions, it drafts several tokens ahead.

Parameter names follow the EAGLE-1 checkpoints: `fc.weight` / `fc.bias` and `layers.{i}.*` from
transformers' `LlamaDecoderLayer`, with no input norm on the first layer. The target's embedding
and lm_head are passed in, never copied into the drafter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import (
    DraftVocabulary,
    Float32RotaryEmbedding,
    attend,
    continue_after,
    llama_config,
    use_draft_norms,
    version,
)
from selfspec.heads.io import PretrainedHeads
from selfspec.heads.joined import gated_mlp
from selfspec.heads.projection import apply_head, is_plain_linear, vocab_logits


class EagleDraft(DraftVocabulary, PretrainedHeads):
    """fc (2H -> H) + Llama decoder layer(s); predicts the next feature. See the module docstring."""

    kind = "eagle"  # the family (heads/families) whose configs this class builds

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.check_kind(config)
        self.config = config
        lc = llama_config(config)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(lc, i) for i in range(config.num_layers))
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1: fc's output goes straight into attention
        self.rotary_emb = Float32RotaryEmbedding(lc)  # inv_freq: a non-persistent buffer, not in the weights
        use_draft_norms(self)
        # frequency-ranked drafting: top-k over the draft vocabulary's rows of the target's lm_head only,
        # which cuts the lm_head read of every draft call by vocab / draft_vocab_size (verification is
        # unchanged)
        if config.draft_vocab_size:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self._head_rows: tuple[tuple, torch.Tensor, torch.Tensor | None] | None = None

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features as this drafter reads them (EAGLE-1: as they are; EAGLE-3 fuses layers)."""
        return features

    def logits(self, out: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Predicted features (..., H) -> logits through the target's frozen lm_head, over the draft
        vocabulary (..., N) where the drafter has one, else over the target's whole vocabulary."""
        out = out.to(lm_head.weight.dtype)
        if self.config.draft_vocab_size == 0:
            return apply_head(lm_head, out)
        if not is_plain_linear(lm_head):  # a wrapped, quantised or hooked head: its logits, then the rows
            return lm_head(out)[..., self.draft_ids.to(out.device)]
        weight, bias = self._draft_rows(lm_head)
        return vocab_logits(out, weight, bias)

    def _draft_rows(self, lm_head: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The lm_head's weight (and bias) rows of the draft vocabulary, gathered once per head weight."""
        w = lm_head.weight
        key = (id(w), w.data_ptr(), version(w), w.dtype, w.device, id(self.d2t), version(self.d2t))
        if self._head_rows is None or self._head_rows[0] != key:
            ids = self.draft_ids.to(w.device)
            bias = lm_head.bias[ids].detach() if lm_head.bias is not None else None
            self._head_rows = (key, w[ids].detach(), bias)
        return self._head_rows[1], self._head_rows[2]

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft token ids as target ids (the same ids without a draft vocabulary)."""
        return super().to_target(draft_ids) if self.config.draft_vocab_size else draft_ids

    def with_draft_vocab(self, target_ids: torch.Tensor) -> EagleDraft:
        """A copy of this drafter, same weights in the same dtype, that drafts among `target_ids` only
        (frequency-ranked drafting without training; it replaces any draft vocabulary this one has)."""
        ids = target_ids.unique()
        copy = EagleDraft(HeadsConfig.from_dict(self.config.to_dict() | {"draft_vocab_size": ids.numel()}))
        copy.to(next(self.parameters()).dtype)
        weights = {k: v for k, v in self.state_dict().items() if k not in ("d2t", "t2d")}
        loaded = copy.load_state_dict(weights, strict=False)  # all but d2t, set next
        if loaded.missing_keys != ["d2t"] or loaded.unexpected_keys:
            raise RuntimeError(f"the drafter's weights do not fit a restricted drafter: {loaded}")
        copy.set_draft_vocab(ids)
        return copy

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        embed: nn.Module,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """features (B, T, H) = f_t, input_ids (B, T) = x_{t+1} -> predicted f_{t+1} (B, T, H).

        `embed` is the target's input embedding. `attention_mask` (B, 1, T, past + T) is boolean
        (True = visible) or additive; None means causal over the cache and these T positions. `cache`
        (a `DraftCache`) keeps the drafter's keys and values across calls; `position_ids` default to
        continuing from the cached length.
        """
        if features.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"features have size {features.shape[-1]} but the drafter expects {self.config.hidden_size}"
            )
        x = self.fc(torch.cat([embed(input_ids).to(features.dtype), features], dim=-1))
        T = x.shape[1]
        position_ids, attention_mask = continue_after(cache, T, x.device, position_ids, attention_mask)
        cos, sin = self.rotary_emb.at(x, position_ids, cache.capacity if cache is not None else None)
        for i, layer in enumerate(self.layers):  # LlamaDecoderLayer's computation, attention over `cache`
            x = x + attend(layer.self_attn, layer.input_layernorm(x), cos, sin, attention_mask, cache, i)
            x = x + gated_mlp(layer.mlp, layer.post_attention_layernorm(x))
        if cache is not None:
            cache.advance(T)
        return x
