"""EAGLE-3 draft model (Li et al. 2025): the fused-feature body (heads/fused_draft.py) trained with the
training-time test, which `unrolled` computes over whole sequences; decoding is the body's forward, one draft
step a call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import repeat_kv

from selfspec.heads.draft_layers import DraftCache, project
from selfspec.heads.fused_draft import FusedDraft, attend_with_own


class Eagle3Draft(FusedDraft):
    """The EAGLE-3 drafter: a FusedDraft whose training unrolls its own draft steps."""

    kind = "eagle3"  # the family (heads/families) whose configs this class builds

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        embed: nn.Module,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: DraftCache | None = None,
        unroll: int = 0,
    ) -> torch.Tensor | list[torch.Tensor]:
        """FusedDraft.forward, or with `unroll` > 0 training: hidden is the target's features (B, T, nH),
        attention_mask and position_ids as `unrolled` reads them, and the result its list of step outputs. It
        goes through forward so that DDP, DeepSpeed and FSDP wrappers see (and synchronise) the call."""
        if unroll > 0:
            return self.unrolled(hidden, input_ids, embed, attention_mask, unroll, position_ids)
        return super().forward(hidden, input_ids, embed, attention_mask, position_ids, cache)

    def unrolled(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        embed: nn.Module,
        attention_mask: torch.Tensor,
        steps: int,
        position_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """The training-time test: `steps` draft steps over a whole sequence in one masked attention each.

            step 0 at t: hidden = fc(features_t), token x_{t+1},   position t     -> o0_t (predicts x_{t+2})
            step i at t: hidden = o(i-1)_t,       token x_{t+1+i}, position t + i -> oi_t (predicts x_{t+2+i})

        The query of step i at t sees step 0's keys at positions <= t (the context, from target features)
        and step j's key at t for j = 1..i (its own earlier drafts along this path): what the drafter
        sees at inference after i of its own steps. features (B, T, nH), input_ids (B, T) = x_{t+1}
        (padded with anything past the end), attention_mask (B, T) 0/1 -> the outputs of each step, (B, T, H).
        Packed rows (several sequences in one) pass the context mask itself, boolean (B, 1, T, T) (True =
        visible, every row seeing at least itself), and each position's position_ids (B, T) in its sequence.
        """
        B, T = input_ids.shape
        layer, attn = self.midlayer, self.midlayer.self_attn
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        if attention_mask.dim() == 4:
            context = attention_mask.bool()
        else:
            context = (
                torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()[None]
                & attention_mask.bool()[:, None]
            )
            context = context | torch.eye(
                T, dtype=torch.bool, device=input_ids.device
            )  # (B, T, T): no empty rows
            context = context[:, None]  # (B, 1, T, T)
        hidden, own_keys, own_values, outputs = self.fuse(features), [], [], []
        for i in range(steps):
            ids = F.pad(input_ids[:, i:], (0, i))  # x_{t+1+i}, padding past the end (masked from the loss)
            embeds = embed(ids).to(hidden.dtype)
            cos, sin = self.rotary_emb.at(hidden, position_ids + i, T + steps)
            q, k, v = project(attn, layer.attention_input(embeds, hidden), cos, sin)
            k, v = repeat_kv(k, attn.num_key_value_groups), repeat_kv(v, attn.num_key_value_groups)
            if i == 0:
                keys, values = k, v  # the context: step 0's keys at every position
            else:
                own_keys.append(k)
                own_values.append(v)
            attended = attn.o_proj(
                attend_with_own(q, keys, values, context, own_keys, own_values, attn.scaling)
                .transpose(1, 2)
                .reshape(B, T, -1)
            )
            hidden = layer.finish(hidden, attended)
            outputs.append(hidden)
        return outputs
