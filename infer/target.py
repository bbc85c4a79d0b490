"""Running the target through its own forward: prefill, and one-pass tree verification."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import DynamicCache

from infer.tree import Tree


class Target:
    """A frozen HF causal LM and how to call it: the cache keyword, logits_to_keep, hidden states."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model.eval()
        params = inspect.signature(model.forward).parameters
        # transformers renamed `past_key_values` to `cache`; use whichever this version has.
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_kw = "logits_to_keep" if "logits_to_keep" in params else None
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (1, T) -> logits (V,) and last hidden state (H,) at the last prompt position."""
        kwargs = {self.cache_kw: cache, "use_cache": True, "output_hidden_states": True}
        if self.keep_kw:
            kwargs[self.keep_kw] = 1
        out = self.model(input_ids=input_ids, **kwargs)
        return out.logits[0, -1], out.hidden_states[-1][0, -1]

    @torch.no_grad()
    def verify(
        self, tokens: torch.Tensor, tree: Tree, bias: torch.Tensor, prefix_len: int, cache: DynamicCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ONE forward over all tree nodes on top of the cache -> logits (N, V), last hidden states (N, H).

        `bias` is the tree's additive mask (1, 1, N, N) in the model's dtype; the prefix columns are added here.
        """
        n = tokens.shape[0]
        prefix = torch.zeros(1, 1, n, prefix_len, dtype=bias.dtype, device=bias.device)
        mask = torch.cat([prefix, bias], dim=-1)  # (1, 1, N, prefix_len + N)
        positions = (prefix_len + tree.depths)[None]  # (1, N)
        out = self.model(
            input_ids=tokens[None],
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=True,
            **{self.cache_kw: cache},
        )
        return out.logits[0], out.hidden_states[-1][0]
