"""Running the target through its own forward: prefill, and one-pass tree verification."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from selfspec.heads.projection import is_plain_linear, vocab_logits
from selfspec.infer.core.attention import ATTENTION, model_configs, using_grouped_attention
from selfspec.infer.core.cache import PreallocatedCache
from selfspec.infer.core.exactness import check_architecture
from selfspec.infer.core.mask import padding_mask

LAYOUT_ROWS = 64  # the most rows vocab_layout projects through vocab_logits (the range it was measured on)


COMPILED_SHAPES: set[tuple[int, ...]] = set()  # (model, batch, tree width, cache length) compiled so far


def note_compiled_shape(shape: tuple[int, ...]) -> None:
    """Count a compiled verify's input shapes; warn once, when a new one is the last torch.compile compiles
    (`torch._dynamo.config.recompile_limit`; after it the verify would run eagerly without a word)."""
    if shape in COMPILED_SHAPES:
        return
    COMPILED_SHAPES.add(shape)
    config = torch._dynamo.config
    limit = getattr(config, "recompile_limit", None) or config.cache_size_limit  # its name before torch 2.7
    if len(COMPILED_SHAPES) == limit:
        seen = sorted({(b, n) for _, b, _, n in COMPILED_SHAPES})
        warnings.warn(
            f"torch.compile has compiled the verify for {limit} shapes (batch size, cache length: {seen}), "
            "its recompile limit: a new batch size or a longer generation now verifies eagerly; keep to a "
            "few batch sizes, or raise torch._dynamo.config.recompile_limit",
            stacklevel=4,
        )


class Target:
    """A frozen HF causal LM and how to call it: the cache keyword, logits_to_keep, hidden states."""

    def __init__(
        self, model: nn.Module, feature_layers: list[int] | None = None, grouped_attention: bool = True
    ) -> None:
        self.model = model  # its train/eval mode is the caller's: decoding runs in eval mode and restores it
        # what the drafter reads: the last hidden states (what the lm_head reads), or EAGLE-3's fused layers
        self.feature_layers = feature_layers
        check_architecture(
            model.config
        )  # ALiBi, recurrent and hybrid layers: never exact (infer/core/exactness.py)
        attn = getattr(model.config, "_attn_implementation", None) or "eager"
        if attn not in ("eager", "sdpa", ATTENTION):
            raise ValueError(
                "tree verification passes a custom 4D attention mask, which "
                f"attn_implementation={attn!r} does not take as given; load the target with "
                "attn_implementation='sdpa' (or 'eager')"
            )
        # "sdpa" runs as ATTENTION during our forwards: the same masks and kernels, minus repeat_kv's KV copy
        self.configs = model_configs(model) if grouped_attention else []  # False: transformers' sdpa as it is
        params = inspect.signature(model.forward).parameters
        # transformers renamed `past_key_values` to `cache`; use whichever this version has.
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_kw = "logits_to_keep" if "logits_to_keep" in params else None
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.base = model.base_model  # its output's last_hidden_state is what the lm_head reads
        if feature_layers is not None:
            self.layers = decoder_layers(model)
            if not all(0 <= i < len(self.layers) for i in feature_layers):
                raise ValueError(
                    f"feature layers {feature_layers} must be hidden_states indices 0..{len(self.layers) - 1}"
                    f" (what layer i reads); this model has {len(self.layers)} layers"
                )

    @torch.no_grad()
    def prefill_rows(
        self,
        input_ids: torch.Tensor,
        cache: PreallocatedCache,
        start: torch.Tensor | None = None,
        hidden: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids (B, T), row b left-padded up to start[b] (None: no padding) -> logits (B, V) at the last
        position and the drafter's features (B, T, H or nH) (None without `hidden`)."""
        kwargs = {self.cache_kw: cache, "use_cache": True}
        if self.keep_kw:
            kwargs[self.keep_kw] = 1
        if start is not None:  # positions count from each row's first real token, as model.generate does
            T = input_ids.shape[1]
            # a (B, cached + T) padding mask, as model.generate passes it: the model builds its own (boolean)
            # 4D mask from it, or none at all
            kwargs["attention_mask"] = padding_mask(start, cache.get_seq_length() + T)
            kwargs["position_ids"] = (torch.arange(T, device=start.device)[None] - start[:, None]).clamp(
                min=0
            )
        with self.capture(hidden) as features, self.vocab_layout(), using_grouped_attention(self.configs):
            out = self.model(input_ids=input_ids, **kwargs)
        return out.logits[:, -1], features() if hidden else None

    def compile(self, mode: str = "default") -> None:
        """Run tree verification through torch.compile from now on (`verify_rows(..., at=...)`), with shapes
        that never change, so it compiles once. `mode`: torch.compile's ("reduce-overhead": CUDA graphs on
        CUDA, the cache and mask buffers being static addresses; on the CPU the same compiled code without
        graphs)."""
        self.compiled = torch.compile(self._features_and_logits, dynamic=False, mode=mode)

    compiled: Callable | None = None

    def _features_and_logits(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: PreallocatedCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify forward as one function of tensors (what `compile` compiles): logits and the drafter's
        features, the latter from output_hidden_states (a tree's few tokens: cheap) instead of hooks."""
        out = self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=True,
            **{self.cache_kw: cache},
        )
        if self.feature_layers is None:  # the last entry is what the lm_head read
            return out.logits, out.hidden_states[-1]
        return out.logits, torch.cat([out.hidden_states[i] for i in self.feature_layers], dim=-1)

    @torch.no_grad()
    def verify_rows(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: PreallocatedCache,
        at: torch.Tensor | None = None,
        hidden: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ONE forward over a batch of trees: tokens and their position ids (B, N), the additive mask
        (B, 1, N, cached + N) -> logits (B, N, V) and the drafter's features (B, N, H or nH; None without
        `hidden`). Compiled
        (`compile`): the trees are written at column `at` (a 0-dim tensor) and the mask covers the whole cache
        (B, 1, N, max)."""
        if self.compiled is not None:
            note_compiled_shape((id(self.model), *tokens.shape, cache.max_length))
            with cache.fixed(at), using_grouped_attention(self.configs):
                return self.compiled(tokens, positions, mask, cache)
        with self.capture(hidden) as features, self.vocab_layout(), using_grouped_attention(self.configs):
            out = self.model(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self.cache_kw: cache},
            )
        return out.logits, features()

    @contextlib.contextmanager
    def vocab_layout(self) -> Iterator[None]:
        """Within: a plain `nn.Linear` lm_head computes through `heads.projection.vocab_logits`, laid out for
        the CPU's GEMM (float32 on CPU: W @ x.T, 2-5x faster for the 2-64 rows of a tree; elsewhere F.linear
        as before). Only the head's own matmul changes: whatever the model does to its output (softcapping,
        scaling) still happens. The model is left as it was on exit."""
        head = self.lm_head
        if (
            not is_plain_linear(head)
            or "forward" in vars(head)
            or type(head.weight) not in (torch.Tensor, nn.Parameter)
        ):  # tensor subclasses: quantised weights
            yield
            return

        def forward(input: torch.Tensor) -> torch.Tensor:  # nn.Linear's own argument name
            if (
                input.numel() > LAYOUT_ROWS * input.shape[-1]
            ):  # a long prompt's logits: F.linear, no second buffer
                return nn.functional.linear(input, head.weight, head.bias)
            return vocab_logits(input, head.weight, head.bias)

        head.forward = forward
        try:
            yield
        finally:
            if vars(head).get("forward") is forward:
                del head.forward

    @contextlib.contextmanager
    def capture(self, enabled: bool = True) -> Iterator[Callable[[], torch.Tensor]]:
        """Keep, during one forward, only the hidden states the drafter reads, instead of asking the model for
        every layer's (output_hidden_states holds layers x tokens x hidden: ~2 GB for an 8B target and an
        8K prompt). Yields a function giving them after the forward: the last hidden states (B, T, H) -- the
        base model's output, what the lm_head reads -- or EAGLE-3's layers concatenated, low to high
        (B, T, nH)."""
        if not enabled:
            yield lambda: None
            return
        kept: dict[int, torch.Tensor] = {}
        if self.feature_layers is None:  # the base model's output

            def last(module: nn.Module, args: tuple, output: Any) -> None:
                kept[0] = output.last_hidden_state  # (B, T, H)

            handles = [self.base.register_forward_hook(last)]
        else:  # hidden_states[i] is what decoder layer i reads (the embeddings, or layer i - 1's output)

            def reads(index: int) -> Callable:
                def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                    kept[index] = args[0] if args else kwargs["hidden_states"]  # (B, T, H)

                return hook

            handles = [
                self.layers[i].register_forward_pre_hook(reads(n), with_kwargs=True)
                for n, i in enumerate(self.feature_layers)
            ]
        try:
            yield (
                lambda: (
                    kept[0]
                    if len(handles) == 1
                    else torch.cat([kept[n] for n in range(len(handles))], dim=-1)
                )
            )
        finally:
            for handle in handles:
                handle.remove()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers: the ModuleList with one entry per hidden layer (`model.layers` in
    Llama-style models, `transformer.h` in GPT-2)."""
    count = model.config.get_text_config().num_hidden_layers
    for module in model.base_model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise ValueError(
        f"cannot find the {count} decoder layers of {type(model).__name__} to read EAGLE-3 features from"
    )
