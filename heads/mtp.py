"""The target's own multi-token-prediction (MTP) layers as a drafter: DeepSeek-V3's MTP modules, GLM-4.5's
NextN layers and the other architectures whose config has `num_mtp_layers`. The layers are transformers' own
`MtpLayer`s (transformers.modeling_layers), built for the target's architecture from its config; the embedding
and the lm_head are the target's, bound at run time and never stored.

One MTP step reads the target's last hidden state at t (what its lm_head reads) and the embedding of x_{t+1},
and predicts x_{t+2}: EAGLE-1's pair, so it decodes through the shared feature drafter
(infer/drafters/feature_drafter.py). Every tree depth runs MTP layer 0 on its own previous output, as serving
engines reuse a checkpoint's one layer for several speculative tokens; the checkpoint's further layers (where
it has them) are kept and exported unchanged. Training (train/mtp.py) unrolls the same reuse (EAGLE-3's
training-time test).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from selfspec.heads.config import HeadsConfig
from selfspec.heads.io import PretrainedHeads

DEFAULT_TREE = {"depth": 3, "top_k": 1, "total_tokens": 3}  # a chain of 3 until a tree is fitted
MIN_TRANSFORMERS = "5.25"  # the first transformers with modeling_layers.MtpModel


def mtp_model_class() -> type:
    """transformers' MtpModel, or a one-line error naming the version that has it."""
    try:
        from transformers.modeling_layers import MtpModel
    except ImportError:
        import transformers

        raise ValueError(
            f"MTP drafting builds on transformers' MtpModel (transformers >= {MIN_TRANSFORMERS}); this is "
            f"{transformers.__version__}: pip install -U 'transformers>={MIN_TRANSFORMERS}'"
        ) from None
    return MtpModel


def mtp_layer_count(config: PretrainedConfig) -> int:
    """How many MTP layers a target's config declares (0: none)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "num_mtp_layers", None) or 0)


def target_config(config: HeadsConfig) -> PretrainedConfig:
    """The target's (text) config an MTP drafter stores in `layer`, rebuilt."""
    fields = dict(config.layer or {})
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise ValueError("an mtp config needs `layer`: the target's config (with its model_type)")
    fields.pop("transformers_version", None)
    return AutoConfig.for_model(model_type, **fields)


def check_supported(config: PretrainedConfig) -> None:
    """Refuse, in one line, the MTP variants this drafter would run differently from the target's own code."""
    kinds = set(getattr(config, "mtp_layer_types", None) or []) - {"full_attention"}
    unsupported = [
        f"{name} {getattr(config, name)}"
        for name in ("logits_mup_width_multiplier", "unpadded_vocab_size")
        if getattr(config, name, None) is not None
    ]
    if kinds:
        unsupported.append(f"MTP layers of type {', '.join(sorted(kinds))}")
    if unsupported:
        raise ValueError(
            f"selfspec drafts with full-attention MTP layers projected by the plain lm_head; this "
            f"{config.model_type} target has {'; '.join(unsupported)}: not supported yet"
        )


class MtpDraft(PretrainedHeads):
    """The MTP layers of a target (transformers' MtpModel without the embedding and lm_head it shares)."""

    kind = "mtp"  # the family (heads/families) whose configs this class builds

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.check_kind(config)
        self.config = config
        main_config = target_config(config)
        main_config.num_mtp_layers = config.num_layers
        check_supported(main_config)
        with torch.device("meta"):  # only the layer classes and the config are read from it
            skeleton = AutoModelForCausalLM.from_config(main_config)
        mtp = mtp_model_class()(skeleton, config.num_layers)
        # the target family's own initialisation (MtpModel's generic one leaves e.g. MoE routers
        # uninitialised)
        mtp.layers.apply(skeleton._init_weights)
        rotary = mtp.rotary_emb
        for name in ("embed_tokens", "shared_head", "rotary_emb"):  # the target's, bound at run time
            delattr(mtp, name)
        mtp.config._attn_implementation = "sdpa"  # the explicit masks of tree drafting and of training
        self.mtp = mtp
        # RoPE (non-persistent buffers only): the skeleton's lives on the meta device, so a real one of
        # its class
        self.rotary = type(rotary)(config=mtp.config) if rotary is not None else None
        self._bound: tuple[nn.Module, ...] = ()

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        """Moves and casts (`.to`, `.cuda`, `.half`) leave RoPE's frequencies in float32, as the target keeps
        its own: in bf16 the draft's angles would drift from the target's at long positions."""
        frequencies = dict(self.rotary.named_buffers()) if self.rotary is not None else {}
        super()._apply(fn, recurse)
        if frequencies:
            device = next(self.parameters()).device
            for name, value in frequencies.items():
                setattr(self.rotary, name, value.to(device))
        return self

    def bind(self, lm_head: nn.Module) -> MtpDraft:
        """Project through the target's `lm_head` (shared with the MTP layers, never stored with them)."""
        self._bound = (lm_head,)
        return self

    def __deepcopy__(self, memo: dict) -> MtpDraft:
        """A copy of the MTP layers still bound to the same target lm_head (shared, never copied)."""
        for module in self._bound:
            memo[id(module)] = module
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return copied

    @property
    def lm_head(self) -> nn.Module:
        if not self._bound:
            raise ValueError(
                "this MTP drafter is not bound to its target: call draft.bind(target.get_output_embeddings())"
            )
        return self._bound[0]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The features an MTP layer reads are the target's last hidden states as they are."""
        return features

    def step(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        embed: nn.Module,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        cache: Any,
    ) -> torch.Tensor:
        """One pass of MTP layer 0: hidden (B, T, H) at t, the tokens x_{t+1} (B, T), a 4D mask over `cache`'s
        keys then these (additive or boolean), positions (B, T) -> outputs (B, T, H), each predicting x_{t+2}.

        The outputs are the decoder block's, before the layer's output norm: what the next MTP step reads as
        its hidden state (DeepSeek-V3's sequential modules; vLLM's and SGLang's MTP drafting), while `logits`
        applies the norm (MtpLayer.forward would apply it before handing the state on). The layer's own parts
        are called in MtpLayer.forward's order. The pair at position 0 reads a zero embedding (the engines'
        convention)."""
        layer = self.mtp.layers[0]
        # the pair at position 0 reads no token embedding, as vLLM's and SGLang's MTP layers have it
        # (measured: with it, vLLM 0.32 accepts exactly our drafts; without, a few later drafts differ)
        embeds = embed(input_ids).to(hidden.dtype).masked_fill(position_ids[..., None] == 0, 0)
        rope = None
        if self.rotary is not None:  # per-layer-type RoPE (Mellum): layer 0's type, as MtpModel.forward asks
            per_type = getattr(self.mtp, "has_per_layer_rope", False)
            kind = {"layer_type": self.mtp.config.layer_types[0]} if per_type else {}
            rope = self.rotary(embeds, position_ids=position_ids, **kind)
        parts = [layer.enorm(embeds), layer.hnorm(hidden)]
        if getattr(layer.config, "mtp_hidden_states_first", False):
            parts.reverse()
        return layer.mtp_block(
            layer.eh_proj(torch.cat(parts, dim=-1)),
            attention_mask=attention_mask,
            position_embeddings=rope,
            position_ids=position_ids,
            cache=cache,
        )

    def output_norm(self, out: torch.Tensor) -> torch.Tensor:
        """The norm MTP layer 0 applies to its output before the lm_head."""
        layer = self.mtp.layers[0]
        if layer.post_norm is not None:
            out = layer.post_norm(out)
        shared = getattr(self.mtp, "shared_post_norm", None)
        return shared(out) if shared is not None else out

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        embed: nn.Module,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        unroll: int = 0,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Decoding: one step over `cache` (a transformers Cache). Training (`unroll` > 0): `unroll` steps
        over whole sequences (`unrolled`); through forward so that DDP, DeepSpeed and FSDP see the call."""
        if unroll > 0:
            return self.unrolled(hidden, input_ids, embed, attention_mask, unroll, position_ids)
        return self.step(hidden, input_ids, embed, attention_mask, position_ids, cache)

    def unrolled(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        embed: nn.Module,
        context: torch.Tensor,
        steps: int,
        position_ids: torch.Tensor,
    ) -> list[torch.Tensor]:
        """The training-time test over whole sequences, as decoding reuses the layer:

            step 0 at t: the target's hidden state at t, token x_{t+1}, position t -> o0_t (predicts x_{t+2})
            step i at t: o(i-1)_t, token x_{t+1+i}, position t + i -> oi_t (predicts x_{t+2+i})

        Step i at t attends to step 0's keys at the positions `context` (B, 1, T, T) bool shows it (its causal
        past) and to its own earlier steps' keys at t: what a depth-i draft node sees. Returns each step's
        outputs.
        """
        from transformers import DynamicCache

        B, T = input_ids.shape
        cache = DynamicCache()
        own = torch.eye(T, dtype=torch.bool, device=input_ids.device).expand(B, 1, T, T)
        hidden, outputs, mask = features, [], context.bool()
        for i in range(steps):
            ids = nn.functional.pad(input_ids[:, i:], (0, i))  # x_{t+1+i}; past the end: masked from the loss
            if i > 0:
                mask = torch.cat([mask, own], dim=-1)  # the keys of steps 0 .. i, each T wide
            hidden = self.step(hidden, ids, embed, mask, position_ids + i, cache)
            outputs.append(hidden)
        return outputs

    def logits(self, out: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Logits over the target's vocabulary: the layer's output norm, then the target's lm_head
        (shared)."""
        head = lm_head if lm_head is not None else self.lm_head
        return head(self.output_norm(out).to(head.weight.dtype))

    # the target's whole vocabulary: draft ids are target ids
    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    @property
    def draft_ids(self) -> torch.Tensor:
        return torch.arange(self.config.vocab_size, device=self.lm_head.weight.device)

    @property
    def t2d(self) -> torch.Tensor:
        return torch.ones(self.config.vocab_size, dtype=torch.bool, device=self.lm_head.weight.device)

    def check_draft_vocab(self, where: object) -> None:
        """Nothing to check: MTP drafts over the target's vocabulary."""


def mtp_config_for(
    target: nn.Module, base_model: str, layers: int | None = None, dtype: str = "float32", **tree: int
) -> HeadsConfig:
    """The HeadsConfig of `target`'s MTP layers (its own count, or `layers` new ones); the tree by default a
    chain of 3 (DEFAULT_TREE), as engines draft with a checkpoint's one MTP layer."""
    text = target.config.get_text_config()
    fields = text.to_dict()
    fields["model_type"] = text.model_type
    count = layers or mtp_layer_count(target.config)
    # new layers for a target whose config types each layer (Qwen3, ...): full attention and its MLP
    for kinds, mtp_kinds in (("layer_types", "mtp_layer_types"), ("mlp_layer_types", "mtp_mlp_layer_types")):
        if fields.get(kinds) is not None and fields.get(mtp_kinds) is None:
            fields[mtp_kinds] = ["full_attention" if kinds == "layer_types" else fields[kinds][-1]] * count
    return HeadsConfig(
        kind="mtp",
        base_model=base_model,
        hidden_size=text.hidden_size,
        vocab_size=target.get_output_embeddings().weight.shape[0],
        num_layers=count,
        layer=fields,
        dtype=dtype,
        **(DEFAULT_TREE | tree),
    )
