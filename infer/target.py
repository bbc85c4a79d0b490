"""Running the target through its own forward: prefill, and one-pass tree verification."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from infer.cache import PreallocatedCache
from infer.mask import PrefixMask
from infer.tree import Tree


class Target:
    """A frozen HF causal LM and how to call it: the cache keyword, logits_to_keep, hidden states."""

    def __init__(self, model: nn.Module, feature_layers: list[int] | None = None) -> None:
        self.model = model.eval()
        # what the drafter reads: the last hidden states (what the lm_head reads), or EAGLE-3's fused layers
        self.feature_layers = feature_layers
        attn = getattr(model.config, "_attn_implementation", None) or "eager"
        if attn not in ("eager", "sdpa"):
            raise ValueError(
                f"tree verification passes a custom 4D attention mask, which attn_implementation={attn!r} does not "
                "take as given; load the target with attn_implementation='sdpa' (or 'eager')"
            )
        params = inspect.signature(model.forward).parameters
        # transformers renamed `past_key_values` to `cache`; use whichever this version has.
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_kw = "logits_to_keep" if "logits_to_keep" in params else None
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.Tensor, cache: PreallocatedCache, hidden: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids (1, T) after the cached tokens -> logits (V,) at the last position and the last
        hidden states (T, H) at every position (None without `hidden`)."""
        kwargs = {self.cache_kw: cache, "use_cache": True, "output_hidden_states": hidden}
        if self.keep_kw:
            kwargs[self.keep_kw] = 1
        out = self.model(input_ids=input_ids, **kwargs)
        return out.logits[0, -1], self.features(out.hidden_states) if hidden else None

    def features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The drafter's input from a forward's hidden_states: the last layer's (T, H), or the concatenation of
        the named layers' (T, nH), low to high."""
        if self.feature_layers is None:
            return hidden_states[-1][0]
        return torch.cat([hidden_states[i][0] for i in self.feature_layers], dim=-1)

    @torch.no_grad()
    def verify(
        self, tokens: torch.Tensor, tree: Tree, mask: PrefixMask, prefix_len: int, cache: PreallocatedCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ONE forward over all tree nodes on top of the cache -> logits (N, V), the drafter's features (N, H or nH)."""
        positions = (prefix_len + tree.depths)[None]  # (1, N)
        out = self.model(
            input_ids=tokens[None],
            attention_mask=mask.at(prefix_len, tree.ancestors),
            position_ids=positions,
            use_cache=True,
            output_hidden_states=True,
            **{self.cache_kw: cache},
        )
        return out.logits[0], self.features(out.hidden_states)
