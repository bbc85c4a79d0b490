"""SpeculativeModel: the decode loop. Propose a tree, verify it in one target forward, accept, commit.

Greedy output is token-identical to the target's own greedy decoding; sampled output has exactly
the target's distribution (see verify.py).
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
import operator
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from heads.config import check_compatible
from heads.io import PretrainedHeads
from heads.registry import load_heads
from heads.target import check_adapted, load_target
from infer.cache import PreallocatedCache, keep_accepted_rows, new_cache
from infer.eagle import EagleProposer
from infer.generation_config import sampling_params
from infer.mask import RowMask
from infer.proposers import Draft, MedusaProposer, Proposer
from infer.target import Target
from infer.timing import Clock, Mark
from infer.tree import stack_trees, tree_from_choices
from infer.verify import SamplingParams, accept, accept_greedy_rows, sample_token

Item = TypeVar("Item")


@dataclasses.dataclass
class GenerationStats:
    """Counters of one generate call. tau counts decode steps only (bonus token included)."""

    new_tokens: int = 0
    target_forwards: int = 0  # prefill included
    decode_steps: int = 0
    decode_tokens: int = 0
    accept_lengths: list[int] = dataclasses.field(default_factory=list)  # tokens produced per decode step
    accepted_drafts: list[int] = dataclasses.field(default_factory=list)  # drafted tokens accepted, before any cut
    drafted: list[int] = dataclasses.field(default_factory=list)  # tree nodes drafted per step (root excluded)
    step_times: list[float] = dataclasses.field(default_factory=list)  # seconds per decode step
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0

    @property
    def tau(self) -> float:
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["tau"] = self.tau
        return out

    def record_prefill(self, seconds: float, rows: int = 1) -> None:
        """The prompt's forward, which also chose each row's first new token."""
        self.target_forwards += 1
        self.new_tokens = rows
        self.prefill_s = seconds

    def record_step(self, drafted: list[int], accepted: list[int], produced: list[int], began: float,
                    marks: tuple[Mark, Mark, Mark], clock: Clock) -> None:
        """One decode step (one target forward) of the rows still decoding: per row a tree of `drafted` nodes
        (root excluded), `accepted` of them on the accepted path (before the budget/EOS cut), `produced` new
        tokens; each row counts as a decode step of its own, so tau is tokens per row and forward. `began` is the
        step's perf_counter start; `marks` the clock's marks when it began, had proposed, and had verified +
        accepted (completed: read after the step's host sync); the rest of the step, until now, is bookkeeping."""
        now = time.perf_counter()
        self.target_forwards += 1
        self.decode_steps += len(produced)
        self.decode_tokens += sum(produced)
        self.new_tokens += sum(produced)
        self.accept_lengths.extend(produced)
        self.accepted_drafts.extend(accepted)
        self.drafted.extend(drafted)
        draft, verify = clock.seconds(marks[0], marks[1]), clock.seconds(marks[1], marks[2])
        self.draft_s += draft
        self.verify_s += verify
        self.bookkeeping_s += max(0.0, now - began - draft - verify)
        self.step_times.append(now - began)


COMPILED_CACHE_STEP = 256  # a compiled verify attends over the whole cache, whose size is a multiple of this


def max_positions(config) -> int | None:
    """How many positions a model embeds: `max_position_embeddings` (`n_positions` in GPT-2-style configs);
    None when its config names no limit."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions"):
        limit = getattr(config, name, None)
        if limit:
            return int(limit)
    return None


def fit_budget(prompt_len: int, max_new_tokens: int, limit: int | None) -> int:
    """`max_new_tokens` clipped so that prompt + new tokens fit in `limit` positions (None: no limit).
    A prompt that leaves no room for a single new token is a ValueError."""
    if limit is None:
        return max_new_tokens
    if prompt_len >= limit:
        raise ValueError(f"the prompt is {prompt_len} tokens but the model takes at most {limit} positions "
                         "(max_position_embeddings), so no new token fits after it: shorten the prompt")
    return min(max_new_tokens, limit - prompt_len)


def check_drafter_device(proposer: Proposer, device: torch.device) -> None:
    """A drafter reading the target's hidden states must sit where they come out (the device of the target's
    last layer, also under device_map="auto"); a clear error now instead of a device mismatch mid-generation."""
    module = getattr(proposer, "heads", None) or getattr(proposer, "draft", None)
    if not isinstance(module, torch.nn.Module):  # a draft model (its own Target) runs where it was put
        return
    param = next(module.parameters(), None)
    if param is not None and param.device != device:
        raise ValueError(f"the drafter's weights are on {param.device} but the target's last layer is on {device}: "
                         f"move the drafter there (SpeculativeModel.from_pretrained(..., device='{device}'))")


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one (an accelerator without an index means the current one)."""
    if a.type != b.type:
        return False
    if a.type == "cpu" or a.index == b.index:
        return True
    current = torch.accelerator.current_device_index() if torch.accelerator.is_available() else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def check_generator(generator: torch.Generator | None, device: torch.device) -> None:
    """Sampling draws on the target's device: a generator made for another device would fail mid-generation."""
    if generator is not None and not same_device(torch.device(generator.device), device):
        raise ValueError(f"the random generator is on {generator.device} but the target runs on {device}: create it "
                         f"there, torch.Generator(device='{device}').manual_seed(...)")


def _cut(new: list[int], budget: int, eos: set[int]) -> tuple[list[int], bool]:
    """A step's new tokens cut where plain decoding would stop (the budget, or an EOS, kept), and whether it did."""
    done = len(new) >= budget
    new = new[:budget]
    for i, tok in enumerate(new):
        if tok in eos:
            return new[: i + 1], True
    return new, done


def token_ids(value: Any, name: str) -> list[int]:
    """Token ids as model.generate takes them -- an int, a list of them, a tensor or a numpy array or integer --
    as a list of ints; anything else (floats, bools, strings) is a one-line error."""
    if hasattr(value, "reshape") and hasattr(value, "tolist"):  # torch and numpy, any shape
        value = value.reshape(-1).tolist()
    values = list(value) if isinstance(value, (list, tuple, set)) else [value]
    try:
        if any(isinstance(v, bool) or getattr(v, "dtype", None) in (torch.bool, bool) for v in values):
            raise TypeError
        return [operator.index(v) for v in values]
    except TypeError:
        raise ValueError(f"{name} must be a token id or a list of them, got {value!r}") from None


def eos_set(eos_token_id: Any) -> set[int]:
    """The EOS id or ids as a set of ints (None: none); see `token_ids` for what it takes."""
    return set() if eos_token_id is None else set(token_ids(eos_token_id, "eos_token_id"))


def infer_attention_mask(input_ids: torch.Tensor, pad_token_id: int | None, eos: set[int]) -> torch.Tensor | None:
    """The attention mask model.generate infers when none is given: 0 where input_ids hold the pad id, if they
    hold it and it is not an EOS id; None (no padding) otherwise."""
    if pad_token_id is None or pad_token_id in eos or not bool((input_ids == pad_token_id).any()):
        return None
    mask = (input_ids != pad_token_id).long()
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError(f"input_ids hold the pad id {pad_token_id} after a prompt's first token, and no "
                         "attention_mask was given (model.generate would mask those tokens out): pass the "
                         "tokenizer's attention_mask")
    return mask


def check_ids(name: str, value: Any) -> torch.Tensor:
    """`input_ids` / `attention_mask` as the caller gave them: an integer (or bool mask) tensor of 1 or 2
    dimensions, else a TypeError / ValueError naming what was given."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids (as a tokenizer's return_tensors='pt' gives), "
                        f"got {type(value).__name__}")
    allowed = (torch.bool,) if name == "attention_mask" else ()
    if value.is_floating_point() or value.is_complex() or (value.dtype == torch.bool and not allowed):
        raise TypeError(f"{name} must hold integers, got a {str(value.dtype).removeprefix('torch.')} tensor")
    if value.dim() not in (1, 2):
        raise ValueError(f"{name} must be (tokens,) or (batch, tokens), got shape {tuple(value.shape)}")
    return value


def prompt_starts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Where each row's prompt begins after its left padding (attention_mask 0 on padding, 1 on tokens)."""
    if attention_mask is None:
        return [0] * input_ids.shape[0]
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must have the shape of input_ids "
                         f"{tuple(input_ids.shape)}")
    m = attention_mask.to(torch.long).cpu()
    if not bool(((m == 0) | (m == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (tokens) only")
    if bool((m[:, 1:] < m[:, :-1]).any()):
        raise ValueError("attention_mask has padding after tokens: pad on the left (tokenizer.padding_side = 'left')")
    starts = (m == 0).sum(1).tolist()
    if max(starts) == input_ids.shape[1]:
        raise ValueError(f"row {starts.index(input_ids.shape[1])} of the batch is all padding: give every row a token")
    return starts


def first_tokens(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Each row's first new token from its prompt's last logits (B, V), as plain decoding chooses it."""
    if params.greedy:
        return logits.argmax(-1)
    return torch.stack([sample_token(row, params, g) for row, g in zip(logits, generators)])


def ends_root(device: torch.device) -> torch.Tensor:
    """The end node of a row that accepted nothing (its root), as `accept` returns it."""
    return torch.zeros(1, dtype=torch.long, device=device)


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


def row_copy(proposer: Proposer) -> Proposer:
    """A proposer for one more row: the same weights and settings, its own per-sequence state (set by `reset`);
    a composite (lookup-first) copies the proposers it names in `parts`."""
    twin = copy.copy(proposer)
    for part in getattr(proposer, "parts", ()):
        setattr(twin, part, row_copy(getattr(proposer, part)))
    return twin


def proposer_for(heads: torch.nn.Module, model: torch.nn.Module, tree: list[list[int]] | None = None,
                 **eagle_options: int | None) -> Proposer:
    """The proposer that drafts with these heads on this target."""
    if heads.config.kind in ("eagle", "eagle3"):
        choices = tree if tree is not None else heads.config.tree
        return EagleProposer(heads, model.get_input_embeddings(), model.get_output_embeddings(), choices=choices,
                             **eagle_options)
    if eagle_options and any(v is not None for v in eagle_options.values()):
        raise ValueError(f"depth/top_k/total_tokens shape EAGLE's dynamic tree; {heads.config.kind} heads take `tree`")
    return MedusaProposer(heads, model.get_output_embeddings(), tree)


class SpeculativeModel:
    """A frozen target plus a proposer; `generate` mirrors `model.generate`, batches included."""

    def __init__(self, model: torch.nn.Module, proposer: Proposer, compile: bool = False) -> None:
        """`compile`: verify trees through torch.compile (fixed shapes: every step verifies the largest tree
        over the whole cache; the first steps pay the compilation)."""
        self.target = Target(model, getattr(proposer, "feature_layers", None))
        if compile:
            self.target.compile()
        check_drafter_device(proposer, self.target.lm_head.weight.device)
        self.proposer = proposer
        self.model = model
        self.last_stats = GenerationStats()
        self.last_rows: list[list[int]] = []  # new token ids of the last call, per row
        self._decoding = False  # a generation is under way (one at a time: the drafter holds its state)
        self.root_only = tree_from_choices([]).to(self.target.device)  # the tree of a step that drafts nothing
        self._cache: PreallocatedCache | None = None  # the last finished generation's KV cache, reused by the next

    @classmethod
    def from_pretrained(
        cls,
        heads_dir: str | Path | PretrainedHeads,
        model: torch.nn.Module | None = None,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device = "cpu",
        tree: list[list[int]] | None = None,
        compile: bool = False,
        **eagle_options: int | None,
    ) -> SpeculativeModel:
        """Load a drafter and the target named in its config (or use `model`).

        `heads_dir` is a selfspec heads directory, a published Medusa / EAGLE checkpoint as it is (converted
        in memory for `model`, named by its `name_or_path`: see `heads.registry.load_heads`), a Hub repo id of
        either, or a drafter already loaded.
        `tree` fixes a static tree (Medusa choices; EAGLE-1 style for EAGLE); `compile` verifies through
        torch.compile (see __init__); `eagle_options` (depth,
        top_k, total_tokens) override an EAGLE drafter's dynamic-tree defaults.
        """
        if isinstance(heads_dir, PretrainedHeads):
            heads = heads_dir.to(device)
        else:
            heads = load_heads(heads_dir, device=device, base_model=getattr(model, "name_or_path", None))
        if model is None:
            if not heads.config.base_model and not heads.config.merged_target:
                where = "" if isinstance(heads_dir, PretrainedHeads) else f" in {heads_dir}"
                raise ValueError(f"the drafter{where} names no target model (SafeAILab's EAGLE checkpoints never do): "
                                 "pass model=..., the model it was trained for")
            model = load_target(heads, dtype=dtype or heads.config.dtype).to(device)
        elif dtype is not None:
            model = model.to(dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        check_adapted(heads.config, model)
        check_compatible(heads.config, model)
        # the drafter runs in the target's dtype (on CPU too: bf16 halves its weight reads, measured 6.8 vs 10.3
        # ms per EAGLE-3 draft and 12.1 vs 11.5-15.7 ms per EAGLE-2 draft on the demo, 2 threads)
        heads = heads.to(dtype=next(model.parameters()).dtype)
        return cls(model, proposer_for(heads, model, tree, **eagle_options), compile=compile)

    def decode(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 128,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        generator: torch.Generator | None = None,
        do_sample: bool | None = None,
        attention_mask: torch.Tensor | None = None,
        pad_token_id: int | None = None,
    ) -> Iterator[list[int]]:
        """Yield the new token ids of each step (the first from prefill) for one prompt (T,) or (1, T), stopping
        at EOS or the budget. See `decode_batch`, which this is for a batch of one."""
        input_ids = check_ids("input_ids", input_ids)
        if attention_mask is not None:
            check_ids("attention_mask", attention_mask)
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise ValueError(f"decode takes one prompt, got a batch of {input_ids.shape[0]}: use decode_batch "
                             "(or generate) for batches")
        rows = self.decode_batch(input_ids.reshape(1, -1), max_new_tokens,
                                 None if attention_mask is None else attention_mask.reshape(1, -1),
                                 temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                                 generator=generator, do_sample=do_sample, pad_token_id=pad_token_id)
        return (step[0] for step in rows)

    def decode_batch(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 128,
        attention_mask: torch.Tensor | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        do_sample: bool | None = None,
        pad_token_id: int | None = None,
    ) -> Iterator[list[list[int]]]:
        """Decode a left-padded batch (B, T) (`attention_mask` 0 on the padding, as a tokenizer with
        padding_side="left" gives it; None: inferred as model.generate does, 0 where input_ids hold
        `pad_token_id` (default: the generation config's) unless that is an EOS id). Yields per step each row's
        new token ids ([] once the row has stopped), rows stopping independently at EOS or their budget.

        Arguments are checked here, before the first step (ValueError). A model that embeds at most `limit`
        positions (`max_positions`) gets prompt + new tokens <= limit per row: a longer budget is clipped to that,
        with a warning, and a prompt that leaves no room is an error. Drafted trees stay inside the limit too: a
        row whose tree could reach past it verifies its root alone, so the last few tokens before the limit are
        decoded one per forward, exactly as plain decoding would.
        Sampling settings and EOS ids the call leaves out (None) come from the target's generation_config, as
        in model.generate (`infer.generation_config`); a config asking for what this loop cannot apply
        exactly (a repetition penalty, ...) is refused. `generator` may be one per row: then each row's draws
        come from its own stream, and a seeded row's output does not depend on the rest of the batch.
        """
        input_ids = check_ids("input_ids", input_ids)
        if attention_mask is not None:
            attention_mask = check_ids("attention_mask", attention_mask)
            attention_mask = attention_mask[None] if attention_mask.dim() == 1 else attention_mask
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.shape[1] == 0:
            raise ValueError("the prompt is empty: give at least one token (e.g. the tokenizer's bos token)")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise ValueError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:  # as model.generate
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        config = getattr(self.model, "generation_config", None)
        if eos_token_id is None:
            eos_token_id = getattr(config, "eos_token_id", None)
        eos = eos_set(eos_token_id)
        if attention_mask is None:  # as model.generate: padding is where the pad id is
            pad = getattr(config, "pad_token_id", None) if pad_token_id is None else pad_token_id
            pad = None if pad is None else token_ids(pad, "pad_token_id")[0]
            attention_mask = infer_attention_mask(input_ids, pad, eos)
        starts = prompt_starts(input_ids, attention_mask)
        # as model.generate: what the call leaves out comes from the target's generation_config
        params = sampling_params(config, do_sample, temperature, top_k, top_p)
        generators = generator if isinstance(generator, (list, tuple)) else [generator] * input_ids.shape[0]
        if len(generators) != input_ids.shape[0]:
            raise ValueError(f"got {len(generators)} generators for a batch of {input_ids.shape[0]}: give one per row")
        for g in generators:
            check_generator(g, self.target.device)
        limit = max_positions(self.model.config)
        T = input_ids.shape[1]
        budgets = [fit_budget(T - start, max_new_tokens, limit) for start in starts]
        if min(budgets) < max_new_tokens:
            warnings.warn(f"prompt ({T - min(starts)} tokens) + max_new_tokens ({max_new_tokens}) exceed the "
                          f"model's {limit} positions: generating at most {min(budgets)} new tokens", stacklevel=2)
        return self._decode(input_ids.to(self.target.device), starts, budgets, params, eos, list(generators), limit)

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
        try:
            max_len = input_ids.shape[1] + max(budgets) + self.proposer.max_nodes
            if self.target.compiled is not None:  # sizes in steps of COMPILED_CACHE_STEP: one compilation serves many
                max_len = -(-max_len // COMPILED_CACHE_STEP) * COMPILED_CACHE_STEP
            if cache is None or cache.max_length < max_len:
                cache = new_cache(self.model, max_len)
            cache.reset()
            yield from without_grad(self._decode_with(cache, input_ids, starts, budgets, params, eos, generators, limit))
        finally:
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
        """The decode loop on checked arguments (see `decode_batch`), in an emptied cache.

        Row b's tokens sit in cache columns starts[b] .. filled[b] - 1 (left padding before them); every step's
        trees are written at the shared column `at` = max(filled), and each row's accepted path moves down to its
        own end, so rows accept different lengths without any copy of the prefix. Rows that stop leave the batch
        at the next step: the running ones move down to the first slots of the cache, the mask and the drafter's
        state (once per stop, never per step), so later forwards carry only them (a compiled verify keeps its
        fixed shapes instead: its stopped rows stay as padding)."""
        target, device = self.target, self.target.device
        B, T = input_ids.shape
        together = B > 1 and getattr(self.proposer, "drafts_rows", False)  # the drafter batches rows itself
        fixed = target.compiled is not None
        proposers = [self.proposer] if together else self._row_proposers(B)
        max_nodes = self.proposer.max_nodes
        stats = self.last_stats = GenerationStats()
        self.last_rows = emitted = [[] for _ in range(B)]
        max_len = T + max(budgets) + max_nodes
        last_tree_at = None if limit is None else limit - max_nodes  # the latest root position a tree fits after
        # as wide as the cache's buffers (a reused cache may be larger): a compiled verify keeps one shape
        mask = RowMask(B, max_nodes, cache.max_length, target.dtype, device)
        context = torch.empty(B, max_len + 1, dtype=torch.long, device=device)  # each row's tokens, then its root
        context[:, :T] = input_ids
        start_t = torch.tensor(starts, device=device)
        for proposer, generator in zip(proposers, generators):
            proposer.reset(max_len, params, generator)
        if together:
            self.proposer.reset_rows(B, max_len)
        clock = Clock(device)

        # 0. prefill: the prompts once; their last logits give each row's first token (its first tree root)
        t0 = time.perf_counter()
        logits, features = target.prefill_rows(input_ids, cache, start_t if any(starts) else None)
        roots = first_tokens(logits, params, generators)
        context[:, T] = roots
        mask.open(start_t, T)
        first = roots.tolist()
        stats.record_prefill(time.perf_counter() - t0, B)
        hiddens = [features[b, starts[b]:] for b in range(B)]
        filled = [T] * B  # cache columns used per row (padding included); its root sits in context[b, filled[b]]
        produced = [1] * B
        done = [tok in eos or budget == 1 for tok, budget in zip(first, budgets)]
        # the same on the device, so that a step sends nothing there (a copy from the host would wait for the device)
        filled_t = torch.full((B,), T, dtype=torch.long, device=device)
        stopped = list(done)
        stopped_t = torch.tensor(stopped, device=device)  # sent again only when a row stops
        columns = torch.arange(max_nodes, device=device)
        for row, tok in zip(emitted, first):
            row.append(tok)
        yield [[tok] for tok in first]
        if all(done):
            return

        slots = list(range(B))  # the batch row each slot of the cache (and of every per-row tensor) holds
        while True:
            began, m1 = time.perf_counter(), clock.mark()
            if not fixed and any(done):  # rows that stopped leave the batch: no target or drafter work on them
                keep = [s for s, off in enumerate(done) if not off]
                index = torch.tensor(keep, device=device)
                cache.select_rows(keep, index)
                mask.select_rows(keep, index, max(filled))
                if together:
                    proposers[0].select_rows(keep, index)
                else:
                    proposers = [proposers[s] for s in keep]
                used = max(filled) + 1  # every row's tokens and root
                context[: len(keep), :used] = context[:, :used].index_select(0, index)
                context = context[: len(keep)]
                start_t, filled_t = start_t[index], filled_t[index]
                slots, done, filled, produced, budgets, starts, generators, hiddens = (
                    [values[s] for s in keep]
                    for values in (slots, done, filled, produced, budgets, starts, generators, hiddens))
                stopped = list(done)
                stopped_t = torch.tensor(stopped, device=device)
                B = len(keep)
            # 1. propose: each row's drafter builds a tree below its root (near the position limit, or once the
            # row has stopped: the root alone, padding)
            active = [not done[b] and (last_tree_at is None or filled[b] - starts[b] <= last_tree_at) for b in range(B)]
            contexts = [context[b, starts[b] : filled[b] + 1] for b in range(B)]
            if together:  # one set of drafter calls for the whole batch
                drafts = proposers[0].propose_rows(active, contexts, hiddens)
            else:
                drafts = [p.propose(c, h) if on else None for p, c, h, on in zip(proposers, contexts, hiddens, active)]
            drafts = [d if d is not None else Draft(c[-1:], self.root_only) for d, c in zip(drafts, contexts)]
            trees = stack_trees([d.tree for d in drafts], max_nodes if fixed else 0)
            N = trees.parents.shape[1]
            tokens = torch.stack([d.tokens if d.tokens.numel() == N else nn.functional.pad(d.tokens, (0, N - d.tokens.numel()))
                                  for d in drafts])  # (B, N)
            # 2. verify: one target forward over every row's tree, all written at column `at`
            m2 = clock.mark()
            at = max(f for f, off in zip(filled, done) if not off)  # a stopped row's columns are free
            # a stopped row stands where the trees go: its leftover moves and writes stay inside the tree block
            filled = [at if off else f for f, off in zip(filled, done)]
            filled_t = torch.where(stopped_t, at, filled_t)
            # a stopped row's padding tree sits at position 0: its place in the cache may be past the model's limit
            positions = torch.where(stopped_t[:, None], trees.depths, (filled_t - start_t)[:, None] + trees.depths)
            if fixed:  # compiled: the same shapes every step (the largest tree, the whole cache)
                logits, node_features = target.verify_rows(tokens, positions, mask.at(at, trees.ancestors, full=True),
                                                           cache, at=filled_t.max())
            else:
                logits, node_features = target.verify_rows(tokens, positions, mask.at(at, trees.ancestors), cache)
            # 3. accept: per row the deepest node whose path the target agrees with, plus a bonus token
            if params.greedy:
                ends, bonus = accept_greedy_rows(logits, tokens, trees)
            else:  # each row on its own tree and generator: its draws never depend on the other rows
                picks = [accept(logits[b, : d.tree.size], d.tokens, d.tree, params, generators[b], d.probs)
                         if not done[b] else (ends_root(device), tokens[b, 0]) for b, d in enumerate(drafts)]
                ends, bonus = torch.cat([e for e, _ in picks]), torch.stack([t for _, t in picks])
            m3 = clock.mark()
            W = trees.paths.shape[-1]
            paths = trees.paths.gather(1, ends[:, None, None].expand(B, 1, W))[:, 0]  # (B, D+1) root first
            path_tokens = tokens.gather(1, paths)
            end_depths = trees.depths.gather(1, ends[:, None])  # (B, 1)
            host = torch.cat([end_depths, path_tokens, bonus[:, None]], 1).tolist()  # the one sync
            # 4. commit: each row keeps its prefix + accepted path; its bonus is its next root
            lengths, new_rows, drafted, accepted, made = [], [], [], [], []
            for b in range(B):
                if done[b]:
                    lengths.append(0)
                    new_rows.append([])
                    continue
                length = host[b][0] + 1
                new, done[b] = _cut(host[b][2 : 1 + length] + [host[b][-1]], budgets[b] - produced[b], eos)
                lengths.append(length)
                new_rows.append(new)
                produced[b] += len(new)
                emitted[slots[b]].extend(new)
                drafted.append(drafts[b].tree.size - 1)
                accepted.append(length - 1)
                made.append(len(new))
            lengths_t = torch.where(stopped_t, 0, end_depths[:, 0] + 1)  # the rows that stopped before this step keep none
            dst = filled_t[:, None] + columns[:W]  # (B, D+1) where each row's accepted path moves to
            kept = columns[None, :W] < lengths_t[:, None]
            filled = [f + n for f, n in zip(filled, lengths)]
            filled_t = filled_t + lengths_t
            keep_accepted_rows(cache, at + paths, dst, max(f for f, off in zip(filled, done) if not off)
                               if not all(done) else max(filled))
            mask.commit(at, N, dst, kept)
            context.scatter_(1, dst, path_tokens)
            context.scatter_(1, filled_t[:, None], bonus[:, None])
            if done != stopped:  # rows stopped in this step: the device learns it (once per row)
                stopped = list(done)
                stopped_t = torch.tensor(done, device=device)
            path_features = node_features.gather(1, paths[:, :, None].expand(-1, -1, node_features.shape[-1]))
            hiddens = [path_features[b, : lengths[b]] for b in range(B)]
            # 5. rows stop at EOS or their budget, exactly where plain decoding would
            stats.record_step(drafted, accepted, made, began, (m1, m2, m3), clock)
            if len(slots) == len(emitted):
                yield new_rows
            else:  # in the caller's row order, [] for the rows that left the batch
                by_row = [[] for _ in emitted]
                for slot, new in zip(slots, new_rows):
                    by_row[slot] = new
                yield by_row
            if all(done):
                return

    @property
    def last_tokens(self) -> list[int]:
        """The new token ids of the last call's first row (the only one for a single prompt)."""
        return self.last_rows[0] if self.last_rows else []

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 128, attention_mask: torch.Tensor | None = None,
                 pad_token_id: int | None = None, **kwargs) -> torch.Tensor:
        """Like `model.generate`: (B, T) left-padded prompts (with their attention_mask) -> (B, T + new) token ids,
        rows that stopped early filled with `pad_token_id` (default: the generation config's, else the first EOS
        id). See `decode_batch` for options."""
        input_ids = check_ids("input_ids", input_ids)
        prompt = input_ids if input_ids.dim() == 2 else input_ids[None]
        rows: list[list[int]] = [[] for _ in range(prompt.shape[0])]
        for step in self.decode_batch(prompt, max_new_tokens, attention_mask=attention_mask,
                                      pad_token_id=pad_token_id, **kwargs):
            for row, new in zip(rows, step):
                row.extend(new)
        width = max(map(len, rows))
        if pad_token_id is None:
            pad_token_id = getattr(self.model.generation_config, "pad_token_id", None)
        if pad_token_id is None:
            eos = kwargs.get("eos_token_id", getattr(self.model.generation_config, "eos_token_id", None))
            pad_token_id = ([*token_ids(eos, "eos_token_id"), 0] if eos is not None else [0])[0]
        new = torch.tensor([row + [pad_token_id] * (width - len(row)) for row in rows], dtype=prompt.dtype,
                           device=prompt.device)
        return torch.cat([prompt, new], dim=1)

    def stream(self, input_ids: torch.Tensor, tokenizer, max_new_tokens: int = 128, **kwargs) -> Iterator[str]:
        """Yield text pieces as steps are accepted. Each piece is the text the newest ids add when decoded
        after a few earlier ids (so tokenizers that drop a leading space at the start still join right);
        a piece ending mid-character waits for the next step."""
        ids: list[int] = []
        prefix, read = 0, 0  # ids[prefix:read] is context already printed; ids[read:] is not printed yet
        for step in self.decode(input_ids, max_new_tokens, **kwargs):
            ids.extend(step)
            before = tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
            after = tokenizer.decode(ids[prefix:], skip_special_tokens=True)
            if len(after) > len(before) and not after.endswith("\ufffd"):
                yield after[len(before) :]
                prefix, read = read, len(ids)
        if read < len(ids):  # whatever was held back at the end
            before = tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
            after = tokenizer.decode(ids[prefix:], skip_special_tokens=True)
            if len(after) > len(before):
                yield after[len(before) :]
