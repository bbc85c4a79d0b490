"""DFlash drafter: one forward fills a whole block of masked positions (block-parallel drafting).

    target hidden_states hs[l_1..l_K]    (C, K·H) --fc--> hidden_norm --> ctx (C, H)     (context features)
    block                                 [last accepted token, MASK × (B − 1)] at positions p .. p + B − 1
    each draft layer                      queries from the block only; keys/values from [ctx ; block] through
                                          the same k/v projections; no causal mask inside the block
    output at block position j ≥ 1        final norm, the target's lm_head: the token AT position p + j

The context features are the target's, never the drafter's own: their keys/values per layer go into a
`DraftCache` that only ever holds confirmed positions, and a step drafts all B − 1 tokens in one call.
(DFlash, arXiv 2602.06036; z-lab's DFlashDraftModel is the published layout.) Parameter names follow it:
`fc`, `hidden_norm`, `layers.{i}.*` of transformers' Llama decoder layer (+ `self_attn.{q,k}_norm` for
Qwen3-family layers), `norm`. The target's embedding and lm_head are passed in, never stored.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, repeat_kv

from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import (
    DraftCache,
    Float32RotaryEmbedding,
    key_values,
    llama_config,
    project,
    rotate,
    use_draft_norms,
)
from selfspec.heads.gqa import grouped_sdpa
from selfspec.heads.io import PretrainedHeads
from selfspec.heads.joined import gated_mlp
from selfspec.heads.projection import apply_head

DEFAULT_FEATURES = 5  # target layers fused (K), fewer for shallow targets


def default_target_layer_ids(num_layers: int, count: int = DEFAULT_FEATURES) -> list[int]:
    """The published spacing of the K decoder layers whose outputs DFlash reads:
    round(1 + i (L − 4) / (K − 1)), i < K (layers 1 .. L − 3); for targets under 5 layers, evenly over
    0 .. L − 2 (the last layer's output is already normed: never read)."""
    first, last = (1, num_layers - 3) if num_layers >= 5 else (0, max(num_layers - 2, 0))
    count = max(1, min(count, last - first + 1))
    if count == 1:
        return [(first + last) // 2]
    return sorted({round(first + i * (last - first) / (count - 1)) for i in range(count)})


def block_embeds(
    first: torch.Tensor, config: HeadsConfig, embed: nn.Module, dtype: torch.dtype
) -> torch.Tensor:
    """The blocks [embed(first), embed(MASK) × (B − 1)] (..., B, H) for first tokens (...,), through the
    target's own embedding module (which may scale its rows, as Gemma's does), in training and decoding
    alike."""
    ids = first[..., None].repeat_interleave(config.block_size, dim=-1)
    ids[..., 1:] = config.mask_token_id
    return embed(ids).to(dtype)


class DFlashDraft(PretrainedHeads):
    """fc (K·H -> H) + hidden_norm on the target's fused layers, L Llama/Qwen3 decoder layers attending from
    the block to [context ; block], final norm; logits through the target's frozen lm_head. See the module
    docstring."""

    kind = "dflash"  # the family (heads/families) whose configs this class builds

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.check_kind(config)
        self.config = config
        lc = llama_config(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.feature_layers) * hidden, hidden, bias=False)
        self.hidden_norm = LlamaRMSNorm(hidden, lc.rms_norm_eps)
        self.layers = nn.ModuleList(LlamaDecoderLayer(lc, i) for i in range(config.num_layers))
        if config.qk_norm:
            for layer in self.layers:
                attn = layer.self_attn
                attn.q_norm = LlamaRMSNorm(attn.head_dim, lc.rms_norm_eps)
                attn.k_norm = LlamaRMSNorm(attn.head_dim, lc.rms_norm_eps)
        self.norm = LlamaRMSNorm(hidden, lc.rms_norm_eps)
        self.rotary_emb = Float32RotaryEmbedding(lc)
        use_draft_norms(self)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ---------------------------------------------------------------- pieces

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's fused layers (..., K·H) -> the context features every draft layer reads (..., H)."""
        return self.hidden_norm(self.fc(features))

    def logits(self, out: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Block outputs (..., H) -> the target's logits over its vocabulary (..., V) through its frozen
        lm_head."""
        return apply_head(lm_head, out.to(lm_head.weight.dtype))

    def block_embeds(self, first: torch.Tensor, embed: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """Block inputs for first tokens (...,): [embed(first), embed(MASK) × (B − 1)] (..., B, H)."""
        return block_embeds(first, self.config, embed, dtype)

    def _project(self, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (B, T, H) -> rotated q (B, h, T, d), k and v (B, kv, T, d), with Qwen3's per-head norms where
        present."""
        return project(attn, x, cos, sin, self.config.qk_norm)

    def _context_kv(self, attn: nn.Module, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The context's keys and values (B, kv, C, d) for one layer: the k/v projections of the fused
        features."""
        k, v = key_values(attn, ctx, self.config.qk_norm)
        return rotate(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def _finish(self, layer: nn.Module, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        h = h + layer.self_attn.o_proj(attended)
        return h + gated_mlp(layer.mlp, layer.post_attention_layernorm(h))

    # ---------------------------------------------------------------- inference

    def forward(
        self,
        context: torch.Tensor,
        block: torch.Tensor,
        context_positions: torch.Tensor | None = None,
        block_positions: torch.Tensor | None = None,
        cache: DraftCache | None = None,
        columns: torch.Tensor | None = None,
        visible: torch.Tensor | None = None,
        anchors: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One draft forward: context (B, C, K·H) the target's fused layers at context_positions (B, C), block
        (B, Q, H) the embedded block at block_positions (B, Q) -> block outputs (B, Q, H), final norm applied.

        With a `cache`, the C + Q new keys/values go after its `length` valid columns (or, per row, into
        `columns` (B, C + Q), attending over the first visible.shape[-1] columns) and the block attends to
        everything cached; the caller then sets `cache.length` to keep the context only. `visible`
        (B, 1, Q, columns): what each block position sees, bool (True = visible) or additive (None: all of
        it).

        `anchors` (B, N) is training (`packed`, with context_positions and `segments` as it reads them): block
        holds N blocks per row (Q = N·B). It goes through forward so that DDP, DeepSpeed and FSDP wrappers see
        (and synchronise) the call."""
        if anchors is not None:
            return self.packed(context, block, anchors, context_positions, segments)
        context = self.fuse(context)
        bound = cache.capacity if cache is not None else None
        cos_c, sin_c = self.rotary_emb.at(context, context_positions, bound)
        cos_b, sin_b = self.rotary_emb.at(block, block_positions, bound)
        h = block
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            k_ctx, v_ctx = self._context_kv(attn, context, cos_c, sin_c)
            q, k, v = self._project(attn, layer.input_layernorm(h), cos_b, sin_b)
            k, v = torch.cat([k_ctx, k], dim=2), torch.cat([v_ctx, v], dim=2)  # the new columns only
            if cache is not None and columns is None:
                k, v = cache.write(i, k, v)
            elif cache is not None:
                cache.write_at(i, k, v, columns)
                width = visible.shape[-1]
                k, v = cache.keys[i, :, :, :width], cache.values[i, :, :, :width]
            out = grouped_sdpa(q, k, v, visible, attn.scaling)  # a fused kernel under the mask (heads/gqa.py)
            h = self._finish(layer, h, out.transpose(1, 2).flatten(2))
        return self.norm(h)

    # ---------------------------------------------------------------- training

    def packed(
        self,
        features: torch.Tensor,
        block: torch.Tensor,
        anchors: torch.Tensor,
        positions: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Training: N blocks per sequence in one attention pass per layer. features (B, T, K·H) the target's
        fused layers at every position, block (B, N·Bk, H) the embedded blocks (`block_embeds` of x at the
        anchors), anchors (B, N) positions a (1 <= a < T) -> block outputs (B, N, Bk, H), final norm applied;
        block n's position j predicts x_{a_n + j}.

        Block n is [x_a, MASK...] at positions a .. a + Bk − 1; its queries see the context keys at
        positions < a and its own Bk keys, in one softmax: what the inference forward of that block after the
        context 0 .. a − 1 computes, at O(N·Bk·(T + Bk)) instead of attention over every block's keys.

        Rows holding several sequences (packed training rows) pass each position's `positions` (B, T) in its
        sequence (default 0 .. T − 1) and its sequence id `segments` (B, T): a block then sees the context of
        its anchor's sequence only, at that sequence's positions."""
        B, T = features.shape[:2]
        N, Bk = anchors.shape[1], self.block_size
        ctx = self.fuse(features)  # (B, T, H)
        h = block.to(ctx.dtype)
        if positions is None:
            positions = torch.arange(T, device=ctx.device)[None].expand(B, T)
        at = (positions.gather(1, anchors)[..., None] + torch.arange(Bk, device=anchors.device)).flatten(
            1
        )  # (B, N·Bk)
        cos_c, sin_c = self.rotary_emb.at(ctx, positions, T + Bk)
        cos_b, sin_b = self.rotary_emb.at(h, at, T + Bk)
        before = torch.arange(T, device=ctx.device) < anchors[..., None]  # (B, N, T)
        if segments is not None:
            before = before & (segments[:, None, :] == segments.gather(1, anchors)[..., None])
        before = before[:, None, :, None]  # (B, 1, N, 1, T)
        for layer in self.layers:
            attn = layer.self_attn
            groups = attn.num_key_value_groups
            k_ctx, v_ctx = (
                repeat_kv(t, groups)[:, :, None] for t in self._context_kv(attn, ctx, cos_c, sin_c)
            )
            q, k, v = self._project(attn, layer.input_layernorm(h), cos_b, sin_b)
            heads, d = q.shape[1], q.shape[-1]
            q, k, v = (t.reshape(B, heads, N, Bk, d) for t in (q, repeat_kv(k, groups), repeat_kv(v, groups)))
            scores_ctx = torch.matmul(q, k_ctx.transpose(-1, -2)).float() * attn.scaling  # (B, h, N, Bk, T)
            scores_ctx = scores_ctx.masked_fill(~before, torch.finfo(torch.float32).min)
            scores_own = torch.matmul(q, k.transpose(-1, -2)).float() * attn.scaling  # (B, h, N, Bk, Bk)
            probs = torch.softmax(torch.cat([scores_ctx, scores_own], dim=-1), dim=-1).to(q.dtype)
            out = torch.matmul(probs[..., :T], v_ctx) + torch.matmul(probs[..., T:], v)  # (B, h, N, Bk, d)
            h = self._finish(layer, h, out.permute(0, 2, 3, 1, 4).reshape(B, N * Bk, heads * d))
        return self.norm(h).view(B, N, Bk, -1)
