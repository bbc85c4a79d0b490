"""SpeculativeModel: the decode loop. Propose a tree, verify it in one target forward, accept, commit.

Greedy output is token-identical to the target's own greedy decoding; sampled output has exactly
the target's distribution (see verify.py). `generate` takes what `model.generate` takes, by the same rules
(`infer.generation_config`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from selfspec.heads.io import PretrainedHeads
from selfspec.infer.core.arguments import (
    check_drafter_device,
    check_generator,
    check_ids,
    fit_budget,
    infer_attention_mask,
    max_positions,
    prompt_starts,
)
from selfspec.infer.core.cache import PreallocatedCache, new_cache
from selfspec.infer.core.decode_step import DecodeState, FixedShapes, Shapes
from selfspec.infer.core.generation_config import Settings, resolve
from selfspec.infer.core.loading import load_mtp_parts, load_parts, refuse_unknown, target_placement
from selfspec.infer.core.stats import GenerateOutput, GenerationStats
from selfspec.infer.core.target import Target
from selfspec.infer.core.text_stream import text_pieces
from selfspec.infer.core.tree import tree_from_choices
from selfspec.infer.core.verify import SamplingParams
from selfspec.infer.drafters.drafter import Drafter, SequenceDrafter, as_drafter

__all__ = ["GenerateOutput", "GenerationStats", "SpeculativeModel"]

Item = TypeVar("Item")


def without_grad(steps: Iterator[Item]) -> Iterator[Item]:
    """`steps` advanced under torch.no_grad, each item yielded outside it (the caller's grad mode stays
    its own). Unlike torch.no_grad on a generator, closing it builds no grad-mode object, so a stream still
    open when the interpreter exits closes quietly. An exception thrown into it closes `steps`
    (runs its `finally` blocks) instead of being raised inside them."""
    try:
        while True:
            with torch.no_grad():
                try:
                    item = next(steps)
                except StopIteration:
                    return
            yield item
    finally:
        steps.close()


class SpeculativeModel:
    """A frozen target plus a proposer; `generate` takes what `model.generate` takes, batches included.

    After each call `last_stats` (a GenerationStats, also `out.stats` with return_dict_in_generate=True) holds
    its decoding statistics: `tau` (tokens per target forward), `new_tokens`, `target_forwards`, the per-step
    `accept_lengths`, the time split `draft_s` / `verify_s` / `bookkeeping_s`."""

    def __init__(
        self, model: torch.nn.Module, proposer: Drafter | SequenceDrafter, compile: bool | str = False
    ) -> None:
        """`proposer`: a drafter of a whole batch (selfspec.infer.drafters.drafter.Drafter), or of one
        sequence at a time (then each row gets its own copy). `compile`: verify trees through torch.compile
        (fixed shapes: every step verifies the largest tree over the whole cache; the first steps pay the
        compilation); True is torch.compile's default mode, a string names the mode ("reduce-overhead": CUDA
        graphs on CUDA)."""
        self.drafter = as_drafter(proposer)  # what the loop drives
        self.target = Target(model, self.drafter.feature_layers)
        if compile:
            self.target.compile(compile if isinstance(compile, str) else "default")
        check_drafter_device(self.drafter, self.target.lm_head.weight.device)
        self.proposer = proposer
        self.model = model
        self.last_stats = GenerationStats()
        self.last_rows: list[list[int]] = []  # new token ids of the last call, per row
        self._decoding = False  # a generation is under way (one at a time: the drafter holds its state)
        # the tree of a step that drafts nothing, where drafted trees are (by the lm_head)
        self.root_only = tree_from_choices([]).to(self.target.lm_head.weight.device)
        self._cache: PreallocatedCache | None = (
            None  # the last finished generation's KV cache, reused by the next
        )

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | Path | PretrainedHeads,
        model: torch.nn.Module | None = None,
        *,
        device_map: str | int | torch.device | dict | None = None,
        dtype: torch.dtype | str | None = None,
        torch_dtype: torch.dtype | str | None = None,
        attn_implementation: str | None = None,
        revision: str | None = None,
        token: str | bool | None = None,
        trust_remote_code: bool | None = None,
        draft_revision: str | None = None,
        tree: list[list[int]] | None = None,
        draft_depth: int | None = None,
        draft_top_k: int | None = None,
        draft_total_tokens: int | None = None,
        mtp: bool = False,
        compile: bool | str = False,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> SpeculativeModel:
        """Load a drafter and the target its config names, as `AutoModelForCausalLM.from_pretrained` would
        load it.

        `pretrained_model_name_or_path`: a selfspec drafter directory, a published Medusa / EAGLE checkpoint
        as it is (converted in memory: see `selfspec.load_heads`), a Hub repo id of either
        (at `draft_revision`), or a drafter already loaded. The target takes `device_map` (default: the CPU,
        as transformers), `dtype` (`torch_dtype` is its old name; default: the drafter's training dtype),
        `attn_implementation`, `revision`, `token` and `trust_remote_code`; the drafter goes where the
        target's lm_head is. `model`: use this target instead, as it is: it is never moved, cast or otherwise
        changed (a `device_map` or `dtype` it does not match is an error). `device` is a single-device
        `device_map`. `tree` fixes a static tree (Medusa choices; EAGLE-1 style for EAGLE); `draft_depth`,
        `draft_top_k` and `draft_total_tokens` shape EAGLE's dynamic tree (default: the drafter's fitted
        tree); `mtp=True` drafts with the target's own multi-token-prediction layers (DeepSeek-V3, GLM-4.5,
        ... ; read from its checkpoint): `pretrained_model_name_or_path` (or `model`) is then the target
        itself. `compile` verifies through torch.compile (see __init__).
        """
        refuse_unknown(kwargs)
        device_map, dtype = target_placement(device_map, device, dtype, torch_dtype)
        target_options = {
            "attn_implementation": attn_implementation,
            "revision": revision,
            "token": token,
            "trust_remote_code": trust_remote_code,
        }
        draft_options = {"revision": draft_revision, "token": token}
        tree_options = {
            "draft_depth": draft_depth,
            "draft_top_k": draft_top_k,
            "draft_total_tokens": draft_total_tokens,
        }
        if mtp:
            model, proposer = load_mtp_parts(
                pretrained_model_name_or_path, model, device_map, dtype, target_options, tree, tree_options
            )
        else:
            model, proposer = load_parts(
                pretrained_model_name_or_path,
                model,
                device_map,
                dtype,
                target_options,
                draft_options,
                tree,
                tree_options,
            )
        return cls(model, proposer, compile=compile)

    def _settings(self, generation_config: Any, kwargs: dict[str, Any]) -> Settings:
        settings = resolve(getattr(self.model, "generation_config", None), generation_config, **kwargs)
        settings.warn_default_length()
        return settings

    def decode(
        self, input_ids: torch.Tensor, max_new_tokens: int | None = None, **kwargs: Any
    ) -> Iterator[list[int]]:
        """Yield the new token ids of each step (the first from prefill) for one prompt (T,) or (1, T),
        stopping at EOS or the budget. See `decode_batch`, which this is for a batch of one."""
        input_ids = check_ids("input_ids", input_ids)
        attention_mask = kwargs.pop("attention_mask", None)
        if attention_mask is not None:
            attention_mask = check_ids("attention_mask", attention_mask).reshape(1, -1)
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise ValueError(
                f"decode takes one prompt, got a batch of {input_ids.shape[0]}: use decode_batch "
                "(or generate) for batches"
            )
        rows = self.decode_batch(input_ids.reshape(1, -1), max_new_tokens, attention_mask, **kwargs)
        return (step[0] for step in rows)

    def decode_batch(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int | None = None,
        attention_mask: torch.Tensor | None = None,
        generation_config: Any = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        **kwargs: Any,
    ) -> Iterator[list[list[int]]]:
        """Decode a left-padded batch (B, T) (`attention_mask` 0 on the padding, as a tokenizer with
        padding_side="left" gives it; None: inferred as model.generate does, 0 where input_ids hold the pad id
        unless that is an EOS id). Yields per step each row's new token ids ([] once the row has stopped),
        rows stopping independently at EOS or their budget.

        Settings (`generation_config`, and transformers' generation arguments as keywords: do_sample,
        temperature, top_k, top_p, max_new_tokens, max_length, eos_token_id, pad_token_id, ...) are resolved
        as model.generate resolves them, and checked here, before the first step (ValueError). A model that
        embeds at most `limit` positions (`max_positions`) gets prompt + new tokens <= limit per row: a longer
        budget is clipped to that, with a warning, and a prompt that leaves no room is an error. Drafted trees
        stay inside the limit too: a row whose tree could reach past it verifies its root alone, exactly as
        plain decoding. `generator` may be one per row: then each row's draws come from its own stream, and a
        seeded row's output does not depend on the rest of the batch.
        """
        if max_new_tokens is not None:
            kwargs["max_new_tokens"] = max_new_tokens
        return self._decode_batch(
            input_ids, attention_mask, self._settings(generation_config, kwargs), generator
        )

    def _decode_batch(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        settings: Settings,
        generator: torch.Generator | list[torch.Generator] | None,
    ) -> Iterator[list[list[int]]]:
        input_ids = check_ids("input_ids", input_ids)
        if attention_mask is not None:
            attention_mask = check_ids("attention_mask", attention_mask)
            attention_mask = attention_mask[None] if attention_mask.dim() == 1 else attention_mask
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.shape[1] == 0:
            raise ValueError("the prompt is empty: give at least one token (e.g. the tokenizer's bos token)")
        if attention_mask is None:  # as model.generate: padding is where the pad id is
            attention_mask = infer_attention_mask(input_ids, settings.pad_token_id, settings.eos)
        starts = prompt_starts(input_ids, attention_mask)
        generators = generator if isinstance(generator, (list, tuple)) else [generator] * input_ids.shape[0]
        if len(generators) != input_ids.shape[0]:
            raise ValueError(
                f"got {len(generators)} generators for a batch of {input_ids.shape[0]}: give one per row"
            )
        for g in generators:
            check_generator(g, self.target.device)
        limit = max_positions(self.model.config)
        T = input_ids.shape[1]
        max_new_tokens = settings.budget(T)
        budgets = [fit_budget(T - start, max_new_tokens, limit) for start in starts]
        if min(budgets) < max_new_tokens:
            warnings.warn(
                f"prompt ({T - min(starts)} tokens) + max_new_tokens ({max_new_tokens}) exceed the "
                f"model's {limit} positions: generating at most {min(budgets)} new tokens",
                stacklevel=3,
            )
        feed = self.model.get_input_embeddings().weight.device
        return self._decode(
            input_ids.to(feed),
            input_ids.tolist(),
            starts,
            budgets,
            settings.params,
            settings.eos,
            list(generators),
            limit,
        )

    def _decode(
        self,
        input_ids: torch.Tensor,
        prompts: list[list[int]],
        starts: list[int],
        budgets: list[int],
        params: SamplingParams,
        eos: set[int],
        generators: list[torch.Generator | None],
        limit: int | None,
    ) -> Iterator[list[list[int]]]:
        """The decode loop with a KV cache of its own: taken from the last finished generation when it is big
        enough (its buffers are reused), else new; handed back when this one ends, also when abandoned. A
        drafter that holds one generation's state (all but Medusa's and NoDraft) makes a second decode started
        while another is unfinished (two streams advanced in turn) an error instead of corrupting both."""
        stateful = self.drafter.holds_state
        if stateful and self._decoding:
            raise ValueError(
                "this SpeculativeModel is still decoding another generation (an unfinished stream), and "
                "its drafter holds that one's state: finish or close() the first, decode the prompts "
                "together as a batch, or use one SpeculativeModel and drafter per stream"
            )
        self._decoding = self._decoding or stateful
        cache, self._cache = self._cache, None
        training = [m for m in self.model.modules() if m.training]  # the caller's modes, restored at the end
        for module in training:
            module.eval()
        try:
            shapes = FixedShapes() if self.target.compiled is not None else Shapes()
            max_len = shapes.cache_length(input_ids.shape[1] + max(budgets) + self.drafter.max_nodes)
            if cache is None or cache.max_length < max_len:
                cache = new_cache(self.model, max_len)
            cache.reset()
            state = DecodeState(
                self.target,
                self.drafter,
                shapes,
                params,
                cache,
                self.model.get_input_embeddings().weight.device,
                limit,
                self.root_only,
            )
            yield from without_grad(
                self._decode_with(state, input_ids, prompts, starts, budgets, eos, generators)
            )
        finally:
            self.drafter.finish()
            for module in training:
                module.train()
            if stateful:
                self._decoding = False
            if cache is not None:
                self._cache = cache

    def _decode_with(
        self,
        state: DecodeState,
        input_ids: torch.Tensor,
        prompts: list[list[int]],
        starts: list[int],
        budgets: list[int],
        eos: set[int],
        generators: list[torch.Generator | None],
    ) -> Iterator[list[list[int]]]:
        """The decode loop on checked arguments (see `decode_batch`): prefill, then per step propose -> verify
        -> accept -> commit (`infer.decode_step`). Rows that stop leave the batch at the next step (unless the
        shapes are fixed for a compiled verify)."""
        stats = self.last_stats = GenerationStats()
        t0 = time.perf_counter()
        first = state.prefill(input_ids, prompts, starts, budgets, eos, generators)
        stats.record_prefill(time.perf_counter() - t0, len(first))
        self.last_rows = state.rows.emitted
        yield [[tok] for tok in first]
        while not state.rows.finished:
            began, m1 = time.perf_counter(), state.clock.mark()
            state.shapes.leave_stopped(state)
            proposal = state.propose()
            m2 = state.clock.mark()
            verified = state.verify(proposal)
            accepted = state.accept(proposal, verified)
            new_rows, counts = state.commit(proposal, verified, accepted)
            stats.record_step(
                counts["drafted"],
                counts["accepted"],
                counts["made"],
                began,
                (m1, m2, accepted.verified),
                state.clock,
            )
            yield state.rows.in_caller_order(new_rows)

    @property
    def last_tokens(self) -> list[int]:
        """The new token ids of the last call's first row (the only one for a single prompt)."""
        return self.last_rows[0] if self.last_rows else []

    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        generation_config: Any = None,
        streamer: Any = None,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | GenerateOutput:
        """Like `model.generate`: (B, T) left-padded prompts (with their attention_mask) -> (B, T + new) token
        ids, rows that stopped early filled with the pad id (the generation config's, else the first EOS id).

        `generation_config` and transformers' generation arguments (do_sample, temperature, top_k, top_p,
        max_new_tokens, max_length, eos_token_id, pad_token_id, return_dict_in_generate) are resolved as
        model.generate resolves them; anything else is refused in one line. `streamer` follows transformers'
        protocol (`put` the prompt, then each step's tokens; `end`), so TextStreamer and TextIteratorStreamer
        work as with model.generate (a batch of one). `return_dict_in_generate=True` returns a
        `GenerateOutput`: `.sequences` and `.stats`. `generator` (one, or one per row) seeds sampling.
        """
        if input_ids is None:
            input_ids = kwargs.pop("inputs", None)
        if input_ids is None:
            raise ValueError(
                "generate needs input_ids: the prompt's token ids (a tokenizer's return_tensors='pt')"
            )
        settings = self._settings(generation_config, kwargs)
        prompt = check_ids("input_ids", input_ids)
        prompt = prompt if prompt.dim() == 2 else prompt[None]
        if streamer is not None and prompt.shape[0] != 1:
            raise ValueError(
                f"a streamer takes one prompt, as with model.generate; got a batch of {prompt.shape[0]}"
            )
        steps = self._decode_batch(
            prompt, attention_mask, settings, generator
        )  # checked before the streamer starts
        rows: list[list[int]] = [[] for _ in range(prompt.shape[0])]
        if streamer is not None:
            streamer.put(prompt.cpu())
        try:
            for step in steps:
                for row, new in zip(rows, step):
                    row.extend(new)
                if streamer is not None and step[0]:
                    streamer.put(torch.tensor(step[0]))
        finally:
            if streamer is not None:
                streamer.end()
        width = max(map(len, rows))
        pad = settings.output_pad_id
        new = torch.tensor(
            [row + [pad] * (width - len(row)) for row in rows], dtype=prompt.dtype, device=prompt.device
        )
        sequences = torch.cat([prompt, new], dim=1)
        return GenerateOutput(sequences, self.last_stats) if settings.return_dict else sequences

    def stream(
        self, input_ids: torch.Tensor, tokenizer: Any, max_new_tokens: int | None = None, **kwargs: Any
    ) -> Iterator[str]:
        """Yield text pieces as steps are accepted. Each piece is the text the newest ids add when decoded
        after a few earlier ids (so tokenizers that drop a leading space at the start still join right);
        a piece ending mid-character waits for the next step. (transformers' streamers work through
        `generate(..., streamer=...)`.)"""
        yield from text_pieces(self.decode(input_ids, max_new_tokens, **kwargs), tokenizer)
