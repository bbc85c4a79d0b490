"""P-EAGLE (parallel EAGLE): the EAGLE-3 body (heads/fused_draft.py) drafting every depth in one forward.

After the confirmed pairs (target features f_t, token x_{t+1}) come K - 1 parallel slots, each reading a
learned token embedding `mask_embedding` and a learned pre-fc feature `mask_hidden` in place of a token and a
target feature, at the next positions, under ordinary causal attention:

    slot        input                               position   output predicts
    last pair   (fc(f_p), x_{p+1})                  p          x_{p+2}        depth 1
    slot j      (fc(mask_hidden), mask_embedding)   p + j      x_{p+2+j}      depth j + 1, j = 1 .. K - 1

Slot j sees the context, the last pair and the slots before it; no drafted token feeds a later depth, so one
drafter forward gives all K distributions (a chain of their argmaxes, or a tree of each depth's top-k).

This is the layout vLLM 0.32 serves with `parallel_drafting` (docs/design/peagle-vllm-0.32.md): its
`mask_hidden` buffer is the same pre-fc (n * H) vector, and its slot token is `mask_token_id`, whose row of
the exported `embed_tokens` is `mask_embedding`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import repeat_kv

from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import DraftCache, project, rotate, version
from selfspec.heads.fused_draft import FusedDraft, attend_with_own


class PEagleDraft(FusedDraft):
    """A FusedDraft with the parallel slots' learned inputs; see the module docstring."""

    kind = "peagle"  # the family (heads/families) whose configs this class builds

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__(config)
        fused = len(config.feature_layers) * config.hidden_size
        self.mask_hidden = nn.Parameter(
            torch.empty(fused).normal_(0.0, 0.02)
        )  # vLLM's `mask_hidden`, before fc
        self.mask_embedding = nn.Parameter(torch.empty(config.hidden_size).normal_(0.0, 0.02))
        self._slots: tuple | None = None  # (weights' key, fc(mask_hidden), mask_embedding) for decoding

    def slot_inputs(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The parallel slots' hidden state (after fc) and token embedding, (H,) each. Without grad (decoding)
        they are computed once per weight version and dtype, not at every step."""
        if torch.is_grad_enabled():
            return self.fuse(self.mask_hidden.to(dtype)), self.mask_embedding.to(dtype)
        reads = (
            self.mask_hidden,
            self.mask_embedding,
            *self.fc.parameters(),
            *(() if self.input_norm is None else self.input_norm.parameters()),
        )
        key = (dtype, *((t.data_ptr(), t.device, version(t)) for t in reads))
        if self._slots is None or self._slots[0] != key:
            self._slots = (key, self.fuse(self.mask_hidden.to(dtype)), self.mask_embedding.to(dtype))
        return self._slots[1], self._slots[2]

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        embed: nn.Module,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: DraftCache | None = None,
        slots: int = 0,
        depths: int = 0,
        anchors: list[torch.Tensor | None] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Decoding: hidden (B, M, H) (fused target features through `fuse`) and input_ids (B, M) of the
        confirmed pairs, then `slots` parallel slots -> the layer's outputs (B, M + slots, H). attention_mask
        (B, 1, M + slots, past + M + slots) and position_ids (B, M + slots) cover the slots too (see the
        module docstring).

        `depths` > 0 is training (`parallel`): hidden is the target's features (B, T, nH), attention_mask the
        pairs' context mask, and the result one output tensor per depth. It goes through forward so that DDP,
        DeepSpeed and FSDP wrappers see (and synchronise) the call."""
        if depths > 0:
            return self.parallel(hidden, input_ids, embed, attention_mask, position_ids, depths, anchors)
        embeds = embed(input_ids).to(hidden.dtype)
        if slots:
            B = hidden.shape[0]
            slot_hidden, slot_embed = self.slot_inputs(hidden.dtype)
            hidden = torch.cat([hidden, slot_hidden.expand(B, slots, -1)], dim=1)
            embeds = torch.cat([embeds, slot_embed.expand(B, slots, -1)], dim=1)
        return self.run_layer(hidden, embeds, attention_mask, position_ids, cache)

    def parallel(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        embed: nn.Module,
        context: torch.Tensor,
        position_ids: torch.Tensor | None,
        depths: int,
        anchors: list[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """Every depth over whole sequences, as decoding computes them:

        depth 0 at t: the pair (fc(features_t), x_{t+1}), position t, sees the pairs <= t -> predicts x_{t+2}
        depth j at t: slot j of anchor t, position t + j, sees the pairs <= t and slots 1..j -> x_{t+2+j}

        features (B, T, nH), input_ids (B, T) = x_{t+1}, context (B, 1, T, T) bool (True = visible; packed
        rows pass their block mask), position_ids (B, T). `anchors` (B, T) bool per depth (None: every
        position) limits a depth's MLP to the positions trained (P-EAGLE's depth subsampling); elsewhere its
        outputs are 0."""
        B, T = input_ids.shape
        layer, attn = self.midlayer, self.midlayer.self_attn
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        context = context.bool()
        hidden = self.fuse(features)
        cos, sin = self.rotary_emb.at(hidden, position_ids, T + depths)
        q, k, v = project(attn, layer.attention_input(embed(input_ids).to(hidden.dtype), hidden), cos, sin)
        keys, values = repeat_kv(k, attn.num_key_value_groups), repeat_kv(v, attn.num_key_value_groups)
        attended = attend_with_own(q, keys, values, context, [], [], attn.scaling)
        outputs = [layer.finish(hidden, attn.o_proj(attended.transpose(1, 2).reshape(B, T, -1)))]
        # every slot has the same input: its query, key and value differ by the rotation of its position only
        slot_hidden, slot_embed = self.slot_inputs(hidden.dtype)
        slot_in = layer.attention_input(slot_embed[None, None], slot_hidden[None, None])  # (1, 1, 2H)
        qc, kc, vc = (
            proj(slot_in).view(1, 1, -1, attn.head_dim).transpose(1, 2)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
        )  # (1, heads, 1, d)
        own_keys, own_values = [], []
        for j in range(1, depths):
            cos_j, sin_j = self.rotary_emb.at(hidden, position_ids + j, T + depths)
            qj, kj = (rotate(t.expand(B, -1, T, -1), cos_j, sin_j) for t in (qc, kc))
            own_keys.append(repeat_kv(kj, attn.num_key_value_groups))
            own_values.append(repeat_kv(vc.expand(B, -1, T, -1), attn.num_key_value_groups))
            attended = attend_with_own(qj, keys, values, context, own_keys, own_values, attn.scaling)
            attended = attended.transpose(1, 2).reshape(B, T, -1)
            keep = anchors[j] if anchors is not None else None
            if keep is None:
                outputs.append(layer.finish(slot_hidden.expand(B, T, -1), attn.o_proj(attended)))
                continue
            rows = attended[keep]  # (n, heads * d)
            out = layer.finish(slot_hidden.expand(rows.shape[0], -1), attn.o_proj(rows))
            outputs.append(hidden.new_zeros(B, T, hidden.shape[-1]).masked_scatter(keep[..., None], out))
        return outputs
