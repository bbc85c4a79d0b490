"""Building blocks every drafter with decoder layers of its own shares (EAGLE-1/2, EAGLE-3, P-EAGLE, DFlash):
the draft layer's Llama shape for any target, its preallocated KV cache, attention over that cache with RoPE
in float32, and a draft vocabulary (d2t) inside the target's.

They live apart from any one family so that no family's module imports another's (docs/adding-a-drafter.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm, LlamaRotaryEmbedding

from selfspec.heads.config import HeadsConfig
from selfspec.heads.gqa import grouped_sdpa
from selfspec.heads.joined import joined, joined_linear, joined_weights, needs_grad


def _rope(config: Any) -> dict[str, Any]:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope = dict(rope)
    if rope and "rope_type" not in rope and all(isinstance(v, dict) for v in rope.values()):
        rope = dict(rope.get("full_attention") or next(iter(rope.values())))  # per-layer-type RoPE (Gemma 3)
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", float(getattr(config, "rope_theta", None) or 10000.0))
    return rope


def layer_fields(target_config: Any) -> dict[str, Any]:
    """The draft decoder layer's shape for a target of any architecture: the target's attention heads,
    MLP width, norm epsilon and RoPE, laid out as a Llama layer (what EAGLE checkpoints use)."""
    c = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    hidden, heads = c.hidden_size, c.num_attention_heads
    act = getattr(c, "hidden_act", None)
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": getattr(c, "head_dim", None) or hidden // heads,
        "intermediate_size": getattr(c, "intermediate_size", None)
        or getattr(c, "n_inner", None)
        or 4 * hidden,
        "rms_norm_eps": float(
            getattr(c, "rms_norm_eps", None) or getattr(c, "layer_norm_epsilon", None) or 1e-6
        ),
        "rope_parameters": _rope(c),
        "max_position_embeddings": getattr(c, "max_position_embeddings", None)
        or getattr(c, "n_positions", 2048),
        "hidden_act": act if isinstance(act, str) else "silu",
    }


def llama_config(config: HeadsConfig) -> LlamaConfig:
    """The LlamaConfig the draft layers are built from (attention through SDPA with an explicit mask)."""
    lc = LlamaConfig(
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        num_hidden_layers=config.num_layers,
        **(config.layer or {}),
    )
    lc._attn_implementation = "sdpa"
    return lc


class DraftCache:
    """The drafter's keys and values for one generation, preallocated and written in place.

    `length` positions are valid; a call writes its T new positions after them and `advance`s. Cropping
    the draft nodes off again is setting `length` back: no copy, no reallocation, whatever the length.
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: torch.dtype,
        device: torch.device | str,
        batch: int = 1,
    ) -> None:
        self.keys = torch.zeros(layers, batch, kv_heads, max_length, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.storage = (self.keys, self.values)  # every row; keys/values: the rows in use (see `select_rows`)
        self.length = 0

    @classmethod
    def for_drafter(cls, draft: nn.Module, max_length: int, batch: int = 1) -> DraftCache:
        param = next(draft.parameters())
        layer = draft.config.layer or {}
        heads = layer.get("num_attention_heads") or 1
        return cls(
            draft.config.num_layers,
            layer.get("num_key_value_heads") or heads,
            layer.get("head_dim") or draft.config.hidden_size // heads,
            max_length,
            param.dtype,
            param.device,
            batch,
        )

    def keep_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per row b, move the entries at positions src[b] (B, W) to dst[b] in every layer (all reads before
        any write, so the two may overlap)."""
        for buffer in (self.keys, self.values):
            L, B, H, _, D = buffer.shape
            shape = (L, B, H, src.shape[1], D)
            moved = buffer.gather(3, src[None, :, None, :, None].expand(shape))
            buffer.scatter_(3, dst[None, :, None, :, None].expand(shape), moved)

    def select_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """Keep only the batch rows `keep` (in that order; `index`: the same on the device) as rows
        0 .. n - 1: the rest of a batch has stopped. Their valid part moves down in place (nothing when they
        are the first rows already)."""
        n = len(keep)
        if keep != list(range(n)):
            for storage, buffer in zip(self.storage, (self.keys, self.values)):
                storage[:, :n, :, : self.length] = buffer[:, :, :, : self.length].index_select(1, index)
        self.keys, self.values = (storage[:, :n] for storage in self.storage)

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, kv, T, d) at positions length .. length + T -> every valid key and value
        (B, kv, length + T, d)."""
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"the drafter's cache holds {self.capacity} positions; {end} needed")
        self.keys[layer, :, :, self.length : end] = k
        self.values[layer, :, :, self.length : end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def write_at(self, layer: int, k: torch.Tensor, v: torch.Tensor, columns: torch.Tensor) -> None:
        """k, v (B, kv, W, d) into row b's columns columns[b] (B, W) of one layer (distinct within a row)."""
        index = columns[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
        self.keys[layer].scatter_(2, index, k)
        self.values[layer].scatter_(2, index, v)

    def advance(self, T: int) -> None:
        self.length += T


def continue_after(
    cache: DraftCache | None,
    T: int,
    device: torch.device,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Defaults for T new positions after what `cache` holds: the next position ids, and a causal mask
    over the cached columns and these T (either kept where given)."""
    past = cache.length if cache is not None else 0
    if position_ids is None:
        position_ids = torch.arange(past, past + T, device=device)[None]
    if attention_mask is None:
        attention_mask = torch.ones(T, past + T, dtype=torch.bool, device=device).tril(past)[None, None]
    return position_ids, attention_mask


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, d) rotated by RoPE at cos, sin (B, T, d) from `Float32RotaryEmbedding.at` (whose sin
    is signed: negated on the first half) -> (B, heads, T, d): transformers' `apply_rotary_pos_emb`,
    x cos + rotate_half(x) sin, bit for bit, in four kernels instead of six (rotate_half(x) sin is the
    halves swapped times the signed sin; addcmul would save one more, but fuses the multiply-add and rounds
    differently)."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, -1) * sin[:, None]


QKV = ("q_proj", "k_proj", "v_proj")


def project(
    attn: LlamaAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_norm: bool = False
):
    """x (B, T, in) -> rotated q (B, h, T, d) and k, v (B, kv, T, d), as LlamaAttention computes them (with
    Qwen3's per-head `q_norm`/`k_norm` first where `qk_norm`): q, k and v from one matmul when drafting
    (`joined_linear`), q and k rotated together."""
    shape = (*x.shape[:-1], -1, attn.head_dim)
    qkv = joined_linear(attn, QKV, x)
    if qkv is None:
        q, k, v = (getattr(attn, name)(x) for name in QKV)
    else:
        q, k, v = qkv.split([getattr(attn, name).weight.shape[0] for name in QKV], dim=-1)
    heads = q.shape[-1] // attn.head_dim
    if qk_norm:
        qk = torch.cat([attn.q_norm(q.view(shape)), attn.k_norm(k.view(shape))], dim=-2)
    elif qkv is None:
        qk = torch.cat([q, k], dim=-1).view(shape)
    else:  # q and k side by side in the joined output already
        qk = qkv[..., : q.shape[-1] + k.shape[-1]].view(shape)
    qk = rotate(qk.transpose(1, 2), cos, sin)
    return qk[:, :heads], qk[:, heads:], v.view(shape).transpose(1, 2)


def key_values(attn: LlamaAttention, x: torch.Tensor, qk_norm: bool = False) -> tuple[torch.Tensor, ...]:
    """x (B, T, in) -> k (with `k_norm` where `qk_norm`), v (B, T, kv, d), unrotated: from the joined q/k/v
    weights' k and v rows in one matmul when drafting."""
    shape = (*x.shape[:-1], -1, attn.head_dim)
    weights = joined_weights(attn, QKV, x)
    if weights is None:
        k, v = attn.k_proj(x), attn.v_proj(x)
    else:
        rows = attn.q_proj.weight.shape[0]
        weight, bias = weights
        kv = nn.functional.linear(x, weight[rows:], None if bias is None else bias[rows:])
        k, v = kv.split([attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0]], dim=-1)
    k, v = k.view(shape), v.view(shape)
    return (attn.k_norm(k) if qk_norm else k), v


def attend(
    attn: LlamaAttention,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    cache: DraftCache | None,
    layer: int,
) -> torch.Tensor:
    """A Llama attention block's output for x (B, T, in) with RoPE (cos, sin) and a boolean or additive mask
    (B, 1, T, past + T), the keys and values going into `cache` (when given) after its valid positions."""
    B, T = x.shape[:2]
    q, k, v = project(attn, x, cos, sin)
    if cache is not None:
        k, v = cache.write(layer, k, v)
    out = grouped_sdpa(
        q, k, v, mask, attn.scaling
    )  # a fused kernel under the mask, no KV copy for a few queries
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class Float32RotaryEmbedding(LlamaRotaryEmbedding):
    """RoPE whose inverse frequencies stay float32 when the drafter is cast to another dtype: bfloat16 rounds
    them, which shifts the angle of every position by up to ~0.4% and wrecks positions past a few hundred.

    `at` gives cos and the signed sin `rotate` takes, read from one float32 table (the values `forward`
    computes) when an upper bound on the positions is known: a draft call costs one lookup instead of
    recomputing the angles."""

    _table: torch.Tensor | None = None  # (bound, 2, d): cos, signed sin

    def _apply(self, fn, recurse: bool = True):
        kept = {name: getattr(self, name) for name in ("inv_freq", "original_inv_freq")}
        super()._apply(fn, recurse)
        for name, value in kept.items():
            setattr(self, name, value.to(getattr(self, name).device))  # follow moves, not casts
        self._table = None
        return self

    def at(self, x: torch.Tensor, position_ids: torch.Tensor, bound: int | None = None):
        """cos, signed sin (B, T, d) in x's dtype for position_ids (B, T), what `rotate` takes; `bound` >
        every position enables the table."""
        if bound is None:
            return signed(*self(x, position_ids))
        if self._table is None or self._table.shape[0] < bound:
            cos, sin = signed(
                *self(self.inv_freq.new_zeros(1), torch.arange(bound, device=self.inv_freq.device)[None])
            )
            self._table = torch.stack([cos[0], sin[0]], dim=1)
        return self._table[position_ids].to(x.dtype).unbind(-2)


def signed(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos, sin (..., d) -> cos and the sin negated on its first half (what `rotate` takes)."""
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


FUSED_RMS_NORM = getattr(torch.ops.aten, "_fused_rms_norm", None)  # None on a torch without it


class DraftRMSNorm(LlamaRMSNorm):
    """transformers' Llama RMSNorm through `aten._fused_rms_norm` where the running torch has it and nothing
    needs its gradient: one kernel on CUDA instead of six (a drafter's norms run several times a decode step).
    On the CPU the op is composed of the same six, bit for bit the parent's (tested); CUDA's kernel may sum
    the squares in another order, a last-bit difference in the drafts only, never in the output. Training
    (autograd) runs the parent's forward."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if FUSED_RMS_NORM is None or needs_grad([self.weight], hidden_states):
            return super().forward(hidden_states)
        shape, eps = [hidden_states.shape[-1]], self.variance_epsilon
        if hidden_states.dtype == self.weight.dtype == torch.float32:
            return FUSED_RMS_NORM(hidden_states, shape, self.weight, eps)[0]
        normed = FUSED_RMS_NORM(hidden_states.float(), shape, None, eps)[0]  # as the parent: in float32,
        return self.weight * normed.to(hidden_states.dtype)  # cast back, then scaled


def norms_side_by_side(owner: nn.Module, names: tuple[str, ...], inputs: list[torch.Tensor]) -> torch.Tensor:
    """cat([norm(x) for each of owner's RMSNorms `names` and its input x], -1): when drafting, one norm over
    the inputs stacked and one multiply by the weights joined (`joined`), where each norm alone is six ops on
    the CPU and one kernel on CUDA. Bit for bit the norms' own results on the CPU (each row's sum of squares
    is the same reduction); the norms must share their epsilon and width."""
    norms = [getattr(owner, name) for name in names]
    eps, x = norms[0].variance_epsilon, inputs[0]
    weight = None
    alike = all(n.variance_epsilon == eps for n in norms) and all(
        i.shape == x.shape and i.dtype == x.dtype and not (i.requires_grad and torch.is_grad_enabled())
        for i in inputs
    )
    if FUSED_RMS_NORM is not None and alike:
        weight = joined(owner, "_".join(names), [n.weight for n in norms], x, stack=True)
    if weight is None:
        return torch.cat([norm(i) for norm, i in zip(norms, inputs)], dim=-1)
    stacked = torch.stack(inputs, dim=-2)  # (..., n, H)
    normed = FUSED_RMS_NORM(stacked.float(), [x.shape[-1]], None, eps)[0].to(x.dtype)
    return (weight * normed).flatten(-2)  # as each norm: weight times the normed input in its dtype


def use_draft_norms(module: nn.Module) -> None:
    """Swap every transformers `LlamaRMSNorm` inside `module` (its decoder layers' included) for a
    `DraftRMSNorm` holding the same weight: the same names, values and results."""
    for name, child in list(module.named_modules()):
        if type(child) is LlamaRMSNorm:
            norm = DraftRMSNorm(child.weight.shape[0], child.variance_epsilon)
            norm.weight = child.weight
            parent, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent), attr, norm)


def version(t: torch.Tensor) -> int | None:
    """t's in-place edit counter (None for a tensor made under torch.inference_mode, which keeps none)."""
    return None if t.is_inference() else t._version


class DraftVocabulary:
    """A drafter that drafts among `draft_vocab_size` target tokens: `d2t` maps draft id i to target id
    i + d2t[i] (SpecForge's convention; `t2d`, where a drafter has it, marks the target ids it holds)."""

    d2t: torch.Tensor

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Use these target ids (draft_vocab_size of them) as the draft vocabulary, in increasing id order."""
        ids = target_ids.unique().sort().values.to(self.d2t.device)
        if ids.numel() != self.d2t.numel():
            raise ValueError(
                f"need {self.d2t.numel()} distinct target ids for the draft vocabulary, got {ids.numel()}"
            )
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        t2d = getattr(self, "t2d", None)
        if t2d is not None:
            t2d.zero_()
            t2d[ids] = True

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft token ids as target ids."""
        return draft_ids + self.d2t[draft_ids]

    @property
    def draft_ids(self) -> torch.Tensor:
        """The target ids of the draft vocabulary, in draft order (N,)."""
        return self.to_target(torch.arange(self.d2t.numel(), device=self.d2t.device))

    def check_draft_vocab(self, where: object) -> None:
        """Refuse a d2t that is not one-to-one into the target's vocabulary (a loaded file's, once)."""
        d2t = getattr(self, "d2t", None)  # EAGLE-1/2 drafters over the whole vocabulary have none
        if d2t is not None:
            draft_targets(d2t, self.config.vocab_size, where)


def draft_targets(d2t: torch.Tensor, vocab: int, where: object) -> torch.Tensor:
    """The target ids draft ids 0..N-1 map to (id + d2t[id]), checked distinct and inside the vocabulary: a
    tree's siblings are a node's top-k draft ids, and sampled verification assumes siblings are distinct
    tokens."""
    targets = torch.arange(d2t.numel(), device=d2t.device) + d2t.long()
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"{where}: d2t maps draft ids to target ids outside [0, {vocab})")
    if targets.unique().numel() != targets.numel():
        raise ValueError(
            f"{where}: d2t maps two draft ids to one target id: the tree's siblings would repeat a "
            "token, which verification cannot accept exactly; rebuild the draft vocabulary"
        )
    return targets
