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
from torch import nn

from selfspec.heads.io import PretrainedHeads
from selfspec.infer.arguments import (
    check_drafter_device,
    check_generator,
    check_ids,
    fit_budget,
    infer_attention_mask,
    max_positions,
    prompt_starts,
)
from selfspec.infer.cache import PreallocatedCache, keep_accepted_rows, new_cache
from selfspec.infer.generation_config import Settings, resolve
from selfspec.infer.loading import load_parts, refuse_unknown, target_placement
from selfspec.infer.mask import RowMask
from selfspec.infer.proposers import Draft, Proposer, row_copy
from selfspec.infer.rows import Rows, first_tokens, upload
from selfspec.infer.stats import GenerateOutput, GenerationStats
from selfspec.infer.target import Target
from selfspec.infer.text_stream import text_pieces
from selfspec.infer.timing import Clock
from selfspec.infer.tree import stack_trees, tree_from_choices
from selfspec.infer.verify import SamplingParams, accept, accept_greedy_rows

__all__ = ["GenerateOutput", "GenerationStats", "SpeculativeModel"]

Item = TypeVar("Item")
COMPILED_CACHE_STEP = 256  # a compiled verify attends over the whole cache, whose size is a multiple of this


def without_grad(steps: Iterator[Item]) -> Iterator[Item]:
    """`steps` advanced under torch.no_grad, each item yielded outside it (the caller's grad mode stays its own).
    Unlike torch.no_grad on a generator, closing it builds no grad-mode object, so a stream still open when the
    interpreter exits closes quietly. An exception thrown into it closes `steps` (runs its `finally` blocks)
    instead of being raised inside them."""
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


def ends_root(device: torch.device) -> torch.Tensor:
    """The end node of a row that accepted nothing (its root), as `accept` returns it."""
    return torch.zeros(1, dtype=torch.long, device=device)


class SpeculativeModel:
    """A frozen target plus a proposer; `generate` takes what `model.generate` takes, batches included.

    After each call `last_stats` (a GenerationStats, also `out.stats` with return_dict_in_generate=True) holds
    its decoding statistics: `tau` (tokens per target forward), `new_tokens`, `target_forwards`, the per-step
    `accept_lengths`, the time split `draft_s` / `verify_s` / `bookkeeping_s`."""

    def __init__(self, model: torch.nn.Module, proposer: Proposer, compile: bool | str = False) -> None:
        """`compile`: verify trees through torch.compile (fixed shapes: every step verifies the largest tree
        over the whole cache; the first steps pay the compilation); True is torch.compile's default mode, a
        string names the mode ("reduce-overhead": CUDA graphs on CUDA)."""
        self.target = Target(model, getattr(proposer, "feature_layers", None))
        if compile:
            self.target.compile(compile if isinstance(compile, str) else "default")
        check_drafter_device(proposer, self.target.lm_head.weight.device)
        self.proposer = proposer
        self.model = model
        self.last_stats = GenerationStats()
        self.last_rows: list[list[int]] = []  # new token ids of the last call, per row
        self._decoding = False  # a generation is under way (one at a time: the drafter holds its state)
        # the tree of a step that drafts nothing, where drafted trees are (by the lm_head)
        self.root_only = tree_from_choices([]).to(self.target.lm_head.weight.device)
        self._cache: PreallocatedCache | None = None  # the last finished generation's KV cache, reused by the next

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
        compile: bool | str = False,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> SpeculativeModel:
        """Load a drafter and the target its config names, as `AutoModelForCausalLM.from_pretrained` would load it.

        `pretrained_model_name_or_path`: a selfspec drafter directory, a published Medusa / EAGLE checkpoint as it
        is (converted in memory: see `selfspec.load_heads`), a Hub repo id of either (at `draft_revision`), or a
        drafter already loaded. The target takes `device_map` (default: the CPU, as transformers), `dtype`
        (`torch_dtype` is its old name; default: the drafter's training dtype), `attn_implementation`,
        `revision`, `token` and `trust_remote_code`; the drafter goes where the target's lm_head is.
        `model`: use this target instead, as it is: it is never moved, cast or otherwise changed (a
        `device_map` or `dtype` it does not match is an error). `device` is a single-device `device_map`.
        `tree` fixes a static tree (Medusa choices; EAGLE-1 style for EAGLE); `draft_depth`, `draft_top_k`
        and `draft_total_tokens` shape EAGLE's dynamic tree (default: the drafter's fitted tree);
        `compile` verifies through torch.compile (see __init__).
        """
        refuse_unknown(kwargs)
        device_map, dtype = target_placement(device_map, device, dtype, torch_dtype)
        target_options = {"attn_implementation": attn_implementation, "revision": revision, "token": token,
                          "trust_remote_code": trust_remote_code}
        draft_options = {"revision": draft_revision, "token": token}
        tree_options = {"draft_depth": draft_depth, "draft_top_k": draft_top_k, "draft_total_tokens": draft_total_tokens}
        model, proposer = load_parts(pretrained_model_name_or_path, model, device_map, dtype, target_options,
                                     draft_options, tree, tree_options)
        return cls(model, proposer, compile=compile)

    def _settings(self, generation_config: Any, kwargs: dict[str, Any]) -> Settings:
        settings = resolve(getattr(self.model, "generation_config", None), generation_config, **kwargs)
        settings.warn_default_length()
        return settings

    def decode(self, input_ids: torch.Tensor, max_new_tokens: int | None = None, **kwargs: Any) -> Iterator[list[int]]:
        """Yield the new token ids of each step (the first from prefill) for one prompt (T,) or (1, T), stopping
        at EOS or the budget. See `decode_batch`, which this is for a batch of one."""
        input_ids = check_ids("input_ids", input_ids)
        attention_mask = kwargs.pop("attention_mask", None)
        if attention_mask is not None:
            attention_mask = check_ids("attention_mask", attention_mask).reshape(1, -1)
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise ValueError(f"decode takes one prompt, got a batch of {input_ids.shape[0]}: use decode_batch "
                             "(or generate) for batches")
        rows = self.decode_batch(input_ids.reshape(1, -1), max_new_tokens, attention_mask, **kwargs)
        return (step[0] for step in rows)

    def decode_batch(self, input_ids: torch.Tensor, max_new_tokens: int | None = None,
                     attention_mask: torch.Tensor | None = None, generation_config: Any = None,
                     generator: torch.Generator | list[torch.Generator] | None = None,
                     **kwargs: Any) -> Iterator[list[list[int]]]:
        """Decode a left-padded batch (B, T) (`attention_mask` 0 on the padding, as a tokenizer with
        padding_side="left" gives it; None: inferred as model.generate does, 0 where input_ids hold the pad id
        unless that is an EOS id). Yields per step each row's new token ids ([] once the row has stopped), rows
        stopping independently at EOS or their budget.

        Settings (`generation_config`, and transformers' generation arguments as keywords: do_sample,
        temperature, top_k, top_p, max_new_tokens, max_length, eos_token_id, pad_token_id, ...) are resolved as
        model.generate resolves them, and checked here, before the first step (ValueError). A model that embeds
        at most `limit` positions (`max_positions`) gets prompt + new tokens <= limit per row: a longer budget is
        clipped to that, with a warning, and a prompt that leaves no room is an error. Drafted trees stay inside
        the limit too: a row whose tree could reach past it verifies its root alone, exactly as plain decoding.
        `generator` may be one per row: then each row's draws come from its own stream, and a seeded row's output
        does not depend on the rest of the batch.
        """
        if max_new_tokens is not None:
            kwargs["max_new_tokens"] = max_new_tokens
        return self._decode_batch(input_ids, attention_mask, self._settings(generation_config, kwargs), generator)

    def _decode_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, settings: Settings,
                      generator: torch.Generator | list[torch.Generator] | None) -> Iterator[list[list[int]]]:
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
            raise ValueError(f"got {len(generators)} generators for a batch of {input_ids.shape[0]}: give one per row")
        for g in generators:
            check_generator(g, self.target.device)
        limit = max_positions(self.model.config)
        T = input_ids.shape[1]
        max_new_tokens = settings.budget(T)
        budgets = [fit_budget(T - start, max_new_tokens, limit) for start in starts]
        if min(budgets) < max_new_tokens:
            warnings.warn(f"prompt ({T - min(starts)} tokens) + max_new_tokens ({max_new_tokens}) exceed the "
                          f"model's {limit} positions: generating at most {min(budgets)} new tokens", stacklevel=3)
        return self._decode(input_ids.to(self.model.get_input_embeddings().weight.device), starts, budgets, settings.params, settings.eos,
                            list(generators), limit)

    def _decode(self, input_ids: torch.Tensor, starts: list[int], budgets: list[int], params: SamplingParams,
                eos: set[int], generators: list[torch.Generator | None], limit: int | None) -> Iterator[list[list[int]]]:
        """The decode loop with a KV cache of its own: taken from the last finished generation when it is big
        enough (its buffers are reused), else new; handed back when this one ends, also when abandoned. A
        drafter that holds one generation's state (all but Medusa's and NoDraft) makes a second decode started
        while another is unfinished (two streams advanced in turn) an error instead of corrupting both."""
        stateful = not getattr(self.proposer, "stateless", False)
        if stateful and self._decoding:
            raise ValueError("this SpeculativeModel is still decoding another generation (an unfinished stream), and "
                             "its drafter holds that one's state: finish or close() the first, decode the prompts "
                             "together as a batch, or use one SpeculativeModel and drafter per stream")
        self._decoding = self._decoding or stateful
        cache, self._cache = self._cache, None
        training = [m for m in self.model.modules() if m.training]  # the caller's modes, restored at the end
        for module in training:
            module.eval()
        try:
            max_len = input_ids.shape[1] + max(budgets) + self.proposer.max_nodes
            if self.target.compiled is not None:  # sizes in steps of COMPILED_CACHE_STEP: one compilation serves many
                max_len = -(-max_len // COMPILED_CACHE_STEP) * COMPILED_CACHE_STEP
            if cache is None or cache.max_length < max_len:
                cache = new_cache(self.model, max_len)
            cache.reset()
            yield from without_grad(self._decode_with(cache, input_ids, starts, budgets, params, eos, generators, limit))
        finally:
            for module in training:
                module.train()
            if stateful:
                self._decoding = False
            if cache is not None:
                self._cache = cache

    def _row_proposers(self, rows: int) -> list[Proposer]:
        """One proposer per row: the drafter's weights are shared, its per-sequence state (EAGLE's cache, a draft
        model's cache, prompt lookup's index) is each row's own. The copies are made per generation, so they
        follow any change to `self.proposer`'s settings."""
        return [self.proposer, *(row_copy(self.proposer) for _ in range(rows - 1))]

    def _decode_with(self, cache: PreallocatedCache, input_ids: torch.Tensor, starts: list[int], budgets: list[int],
                     params: SamplingParams, eos: set[int], generators: list[torch.Generator | None],
                     limit: int | None) -> Iterator[list[list[int]]]:
        """The decode loop on checked arguments (see `decode_batch`), in an emptied cache: prefill, then per step
        propose -> verify -> accept -> commit. Every row's tree is written at one shared column and each row's
        accepted path moves down to its own end (`infer.rows`). Rows that stop leave the batch at the next step:
        the running ones move down to the first slots of the cache, the mask and the drafter's state (once per
        stop, never per step), so later forwards carry only them (a compiled verify keeps its fixed shapes
        instead: its stopped rows stay as padding)."""
        # devices by where things meet: tokens, trees and the rows' state where drafts are made (the drafter sits by
        # the lm_head), what the model reads (ids, positions, mask) where its input embedding is; the outputs are
        # used where they come out (under accelerate's device_map the logits return to the input's device)
        target = self.target
        device, feed = target.lm_head.weight.device, self.model.get_input_embeddings().weight.device
        B, T = input_ids.shape
        together = B > 1 and getattr(self.proposer, "drafts_rows", False)  # the drafter batches rows itself
        fixed = target.compiled is not None
        proposers = [self.proposer] if together else self._row_proposers(B)
        max_nodes = self.proposer.max_nodes
        stats = self.last_stats = GenerationStats()
        max_len = T + max(budgets) + max_nodes
        last_tree_at = None if limit is None else limit - max_nodes  # the latest root position a tree fits after
        # as wide as the cache's buffers (a reused cache may be larger): a compiled verify keeps one shape
        mask = RowMask(B, max_nodes, cache.max_length, target.dtype, feed)
        context = torch.empty(B, max_len + 1, dtype=torch.long, device=device)  # each row's tokens, then its root
        context[:, :T] = input_ids
        for proposer, generator in zip(proposers, generators):
            proposer.reset(max_len, params, generator)
        if together:
            self.proposer.reset_rows(B, max_len)
        clock = Clock(device)
        columns = torch.arange(max_nodes, device=device)

        # 0. prefill: the prompts once; their last logits give each row's first token (its first tree root)
        t0 = time.perf_counter()
        start_t = upload(starts, feed)
        logits, features = target.prefill_rows(input_ids.to(feed), cache, start_t if any(starts) else None)
        roots = first_tokens(logits, params, generators)
        context[:, T] = roots
        mask.open(start_t, T)
        first = roots.tolist()
        observers = [getattr(p, "observe", None) for p in proposers] if not together else []
        if any(observers):  # drafters that keep the context on the host (prompt lookup) get it once, then each
            prompts = input_ids.tolist()  # step's new tokens from the step's one read
            for see, prompt, start, tok in zip(observers, prompts, starts, first):
                if see is not None:
                    see(prompt[start:] + [tok])
        stats.record_prefill(time.perf_counter() - t0, B)
        rows = Rows(starts, budgets, T, first, eos, generators, [features[b, s:] for b, s in enumerate(starts)], device)
        self.last_rows = rows.emitted
        yield [[tok] for tok in first]

        while not rows.finished:
            began, m1 = time.perf_counter(), clock.mark()
            if not fixed and any(rows.done):  # rows that stopped leave the batch: no target or drafter work on them
                width = max(rows.filled)
                keep, index = rows.drop_stopped()
                cache.select_rows(keep, index.to(feed))
                mask.select_rows(keep, index.to(feed), width)
                if together:
                    proposers[0].select_rows(keep, index)
                else:
                    proposers = [proposers[s] for s in keep]
                    observers = [observers[s] for s in keep] if observers else []
                context[: len(keep), : width + 1] = context[:, : width + 1].index_select(0, index)
                context = context[: len(keep)]
            # 1. propose: each row's drafter builds a tree below its root (near the position limit, or once the
            # row has stopped: the root alone, padding)
            drafting = rows.drafting(last_tree_at)
            contexts = [context[b, s : f + 1] for b, (s, f) in enumerate(zip(rows.starts, rows.filled))]
            if together:  # one set of drafter calls for the whole batch
                drafts = proposers[0].propose_rows(drafting, contexts, rows.hiddens)
            else:
                drafts = [p.propose(c, h) if on else None
                          for p, c, h, on in zip(proposers, contexts, rows.hiddens, drafting)]
            drafts = [d if d is not None else Draft(c[-1:], self.root_only) for d, c in zip(drafts, contexts)]
            trees = stack_trees([d.tree for d in drafts], max_nodes if fixed else 0)
            N = trees.parents.shape[1]
            tokens = torch.stack([d.tokens if d.tokens.numel() == N else nn.functional.pad(d.tokens, (0, N - d.tokens.numel()))
                                  for d in drafts])  # (B, N)
            # 2. verify: one target forward over every row's tree, all written at column `at`
            m2 = clock.mark()
            at = rows.tree_column()
            positions = rows.positions(trees.depths).to(feed)
            tree_mask = mask.at(at, trees.ancestors.to(feed), full=fixed)  # compiled: the whole cache, every step
            logits, node_features = target.verify_rows(tokens.to(feed), positions, tree_mask, cache,
                                                       at=rows.filled_t.max().to(feed) if fixed else None)
            # 3. accept: per row the deepest node whose path the target agrees with, plus a bonus token (on the
            # logits' device: the drafts move there, not the logits)
            on = logits.device
            if params.greedy:
                ends, bonus = accept_greedy_rows(logits, tokens.to(on), trees.to(on))
            else:  # each row on its own tree and generator: its draws never depend on the other rows
                picks = [accept(logits[b, : d.tree.size], d.tokens.to(on), d.tree.to(on), params, rows.generators[b],
                                None if d.probs is None else d.probs.to(on))
                         if not rows.done[b] else (ends_root(on), tokens[b, :1].to(on)[0]) for b, d in enumerate(drafts)]
                ends, bonus = torch.cat([e for e, _ in picks]), torch.stack([t for _, t in picks])
            ends, bonus = ends.to(device), bonus.to(device)
            m3 = clock.mark()
            W = trees.paths.shape[-1]
            paths = trees.paths.gather(1, ends[:, None, None].expand(len(rows), 1, W))[:, 0]  # (B, D+1) root first
            path_tokens = tokens.gather(1, paths)
            end_depths = trees.depths.gather(1, ends[:, None])  # (B, 1)
            host = torch.cat([end_depths, path_tokens, bonus[:, None]], 1).tolist()  # the one sync
            # 4. commit: each row keeps its prefix + accepted path (cut at EOS or its budget); its bonus is its
            # next root
            new_rows, lengths, counts = rows.take(host, [d.tree.size for d in drafts])
            for see, new in zip(observers, new_rows):
                if see is not None:
                    see(new)
            dst, kept = rows.advance(lengths, end_depths, columns[:W])
            keep_accepted_rows(cache, at + paths, dst, rows.cache_end())
            mask.commit(at, N, dst.to(feed), kept.to(feed))
            context.scatter_(1, dst, path_tokens)
            context.scatter_(1, rows.filled_t[:, None], bonus[:, None])
            rows.end_step()
            path_features = node_features.gather(1, paths.to(node_features.device)[:, :, None].expand(
                -1, -1, node_features.shape[-1]))  # where the features came out: each drafter moves its own
            rows.hiddens = [path_features[b, :n] for b, n in enumerate(lengths)]
            stats.record_step(counts["drafted"], counts["accepted"], counts["made"], began, (m1, m2, m3), clock)
            yield rows.in_caller_order(new_rows)

    @property
    def last_tokens(self) -> list[int]:
        """The new token ids of the last call's first row (the only one for a single prompt)."""
        return self.last_rows[0] if self.last_rows else []

    def generate(self, input_ids: torch.Tensor | None = None, generation_config: Any = None, streamer: Any = None,
                 attention_mask: torch.Tensor | None = None,
                 generator: torch.Generator | list[torch.Generator] | None = None,
                 **kwargs: Any) -> torch.Tensor | GenerateOutput:
        """Like `model.generate`: (B, T) left-padded prompts (with their attention_mask) -> (B, T + new) token ids,
        rows that stopped early filled with the pad id (the generation config's, else the first EOS id).

        `generation_config` and transformers' generation arguments (do_sample, temperature, top_k, top_p,
        max_new_tokens, max_length, eos_token_id, pad_token_id, return_dict_in_generate) are resolved as
        model.generate resolves them; anything else is refused in one line. `streamer` follows transformers'
        protocol (`put` the prompt, then each step's tokens; `end`), so TextStreamer and TextIteratorStreamer
        work as with model.generate (a batch of one). `return_dict_in_generate=True` returns a `GenerateOutput`:
        `.sequences` and `.stats`. `generator` (one, or one per row) seeds sampling.
        """
        if input_ids is None:
            input_ids = kwargs.pop("inputs", None)
        if input_ids is None:
            raise ValueError("generate needs input_ids: the prompt's token ids (a tokenizer's return_tensors='pt')")
        settings = self._settings(generation_config, kwargs)
        prompt = check_ids("input_ids", input_ids)
        prompt = prompt if prompt.dim() == 2 else prompt[None]
        if streamer is not None and prompt.shape[0] != 1:
            raise ValueError(f"a streamer takes one prompt, as with model.generate; got a batch of {prompt.shape[0]}")
        steps = self._decode_batch(prompt, attention_mask, settings, generator)  # checked before the streamer starts
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
        new = torch.tensor([row + [pad] * (width - len(row)) for row in rows], dtype=prompt.dtype, device=prompt.device)
        sequences = torch.cat([prompt, new], dim=1)
        return GenerateOutput(sequences, self.last_stats) if settings.return_dict else sequences

    def stream(self, input_ids: torch.Tensor, tokenizer: Any, max_new_tokens: int | None = None,
               **kwargs: Any) -> Iterator[str]:
        """Yield text pieces as steps are accepted. Each piece is the text the newest ids add when decoded
        after a few earlier ids (so tokenizers that drop a leading space at the start still join right);
        a piece ending mid-character waits for the next step. (transformers' streamers work through
        `generate(..., streamer=...)`.)"""
        yield from text_pieces(self.decode(input_ids, max_new_tokens, **kwargs), tokenizer)
