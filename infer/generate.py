"""SpeculativeModel: the decode loop. Propose a tree, verify it in one target forward, accept, commit.

Greedy output is token-identical to the target's own greedy decoding; sampled output has exactly
the target's distribution (see verify.py).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from heads.config import check_compatible
from heads.io import PretrainedHeads
from heads.registry import load_heads
from heads.target import check_adapted, load_target
from infer.cache import PreallocatedCache, keep_accepted, new_cache
from infer.eagle import EagleProposer
from infer.generation_config import sampling_params
from infer.mask import PrefixMask
from infer.proposers import Draft, MedusaProposer, Proposer
from infer.target import Target
from infer.timing import Clock, Mark
from infer.tree import tree_from_choices
from infer.verify import SamplingParams, accept, sample_token


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

    def record_prefill(self, seconds: float) -> None:
        """The prompt's forward, which also chose the first new token."""
        self.target_forwards += 1
        self.new_tokens = 1
        self.prefill_s = seconds

    def record_step(self, drafted: int, accepted: int, produced: int, began: float, marks: tuple[Mark, Mark, Mark],
                    clock: Clock) -> None:
        """One decode step: a tree of `drafted` nodes (root excluded), `accepted` of them on the accepted path
        (before the budget/EOS cut), `produced` new tokens. `began` is the step's perf_counter start; `marks`
        the clock's marks when it began, had proposed, and had verified + accepted (completed: read after the
        step's host sync); the rest of the step, until now, is bookkeeping."""
        now = time.perf_counter()
        self.target_forwards += 1
        self.decode_steps += 1
        self.decode_tokens += produced
        self.new_tokens += produced
        self.accept_lengths.append(produced)
        self.accepted_drafts.append(accepted)
        self.drafted.append(drafted)
        draft, verify = clock.seconds(marks[0], marks[1]), clock.seconds(marks[1], marks[2])
        self.draft_s += draft
        self.verify_s += verify
        self.bookkeeping_s += max(0.0, now - began - draft - verify)
        self.step_times.append(now - began)


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


def _eos_set(eos_token_id: int | list[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)


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
    """A frozen target plus a proposer; `generate` mirrors `model.generate` for batch size 1."""

    def __init__(self, model: torch.nn.Module, proposer: Proposer) -> None:
        self.target = Target(model, getattr(proposer, "feature_layers", None))
        check_drafter_device(proposer, self.target.lm_head.weight.device)
        self.proposer = proposer
        self.model = model
        self.last_stats = GenerationStats()
        self.last_tokens: list[int] = []  # new token ids of the last call
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
        **eagle_options: int | None,
    ) -> SpeculativeModel:
        """Load a drafter and the target named in its config (or use `model`).

        `heads_dir` is a selfspec heads directory, a published Medusa / EAGLE checkpoint as it is (converted
        in memory for `model`, named by its `name_or_path`: see `heads.registry.load_heads`), a Hub repo id of
        either, or a drafter already loaded.
        `tree` fixes a static tree (Medusa choices; EAGLE-1 style for EAGLE); `eagle_options` (depth,
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
        return cls(model, proposer_for(heads, model, tree, **eagle_options))

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
    ) -> Iterator[list[int]]:
        """Yield the new token ids of each step (the first from prefill), stopping at EOS or the budget.

        Arguments are checked here, before the first step (ValueError). A model that embeds at most `limit`
        positions (`max_positions`) gets prompt + new tokens <= limit: a longer budget is clipped to that, with
        a warning, and a prompt that leaves no room is an error. Drafted trees stay inside the limit too: a step
        whose tree could reach past it (prefix + proposer.max_nodes > limit) verifies the root alone, so the
        last few tokens before the limit are decoded one per forward, exactly as plain decoding would.
        Sampling settings and EOS ids the call leaves out (None) come from the target's generation_config, as
        in model.generate (`infer.generation_config`); a config asking for what this loop cannot apply
        exactly (a repetition penalty, ...) is refused.
        """
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"speculative decoding here is batch size 1; got a batch of {input_ids.shape[0]}")
            input_ids = input_ids[0]
        if input_ids.numel() == 0:
            raise ValueError("the prompt is empty: give at least one token (e.g. the tokenizer's bos token)")
        if max_new_tokens < 1:  # as model.generate
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        # as model.generate: what the call leaves out comes from the target's generation_config
        params = sampling_params(getattr(self.model, "generation_config", None), do_sample, temperature, top_k, top_p)
        check_generator(generator, self.target.device)
        limit = max_positions(self.model.config)
        budget = fit_budget(input_ids.numel(), max_new_tokens, limit)
        if budget < max_new_tokens:
            warnings.warn(f"prompt ({input_ids.numel()} tokens) + max_new_tokens ({max_new_tokens}) exceed the "
                          f"model's {limit} positions: generating at most {budget} new tokens", stacklevel=2)
        if eos_token_id is None:
            eos_token_id = getattr(self.model.generation_config, "eos_token_id", None)
        return self._decode(input_ids, budget, params, _eos_set(eos_token_id), generator, limit)

    def _decode(self, input_ids: torch.Tensor, max_new_tokens: int, params: SamplingParams, eos: set[int],
                generator: torch.Generator | None, limit: int | None) -> Iterator[list[int]]:
        """The decode loop with a KV cache of its own: taken from the last finished generation when it is big
        enough (its buffers are reused), else new; handed back when this one ends, also when abandoned. Two
        decodes running at once (interleaved streams) therefore never share one."""
        max_len = input_ids.numel() + max_new_tokens + self.proposer.max_nodes
        cache, self._cache = self._cache, None
        if cache is None or cache.max_length < max_len:
            cache = new_cache(self.model, max_len)
        cache.reset()
        try:
            yield from self._decode_with(cache, input_ids, max_new_tokens, params, eos, generator, limit)
        finally:
            self._cache = cache

    @torch.no_grad()
    def _decode_with(self, cache: PreallocatedCache, input_ids: torch.Tensor, max_new_tokens: int,
                     params: SamplingParams, eos: set[int], generator: torch.Generator | None,
                     limit: int | None) -> Iterator[list[int]]:
        """The decode loop on checked arguments (see `decode`), in an emptied cache."""
        target, proposer = self.target, self.proposer
        stats = self.last_stats = GenerationStats()
        self.last_tokens = emitted = []
        prefix_len = input_ids.numel()
        max_len = prefix_len + max_new_tokens + proposer.max_nodes
        last_tree_at = max_len if limit is None else limit - proposer.max_nodes  # the latest prefix a tree fits after
        mask = PrefixMask(proposer.max_nodes, max_len, target.dtype, target.device)
        context = torch.empty(max_len, dtype=torch.long, device=target.device)  # every token so far, then the root
        context[:prefix_len] = input_ids
        proposer.reset(max_len, params, generator)
        clock = Clock(target.device)

        # 0. prefill: the prompt once; its last logits give the first token (the first tree root)
        t0 = time.perf_counter()
        logits, hiddens = target.prefill(context[None, :prefix_len], cache)
        context[prefix_len] = root = sample_token(logits, params, generator)
        first = int(root)
        stats.record_prefill(time.perf_counter() - t0)
        emitted.append(first)
        yield [first]
        if first in eos or max_new_tokens == 1:
            return

        while True:
            # 1. propose: the drafter builds a tree below the root (near the position limit: the root alone)
            began, m1 = time.perf_counter(), clock.mark()
            if prefix_len <= last_tree_at:
                draft = proposer.propose(context[: prefix_len + 1], hiddens)
            else:
                draft = Draft(context[prefix_len : prefix_len + 1], self.root_only)
            tokens, tree = draft.tokens, draft.tree  # (N,)
            # 2. verify: one target forward over every node
            m2 = clock.mark()
            logits, node_hiddens = target.verify(tokens, tree, mask, prefix_len, cache)  # (N, V), (N, H)
            # 3. accept: the deepest node whose path the target agrees with, plus a bonus token
            end, bonus = accept(logits, tokens, tree, params, generator, draft.probs)
            m3 = clock.mark()
            path = tree.paths.index_select(0, end)[0]  # (D+1,) root first, padded with the end node
            path_tokens = tokens[path]
            host = torch.cat([tree.depths.index_select(0, end), path_tokens, bonus.view(1)]).tolist()  # the one sync
            length = host[0] + 1
            new = host[2 : 1 + length] + [host[-1]]  # accepted drafted tokens, then the bonus
            # 4. commit: the cache keeps prefix + accepted path; the bonus is the next root
            keep_accepted(cache, prefix_len, path, length)
            context[prefix_len : prefix_len + length] = path_tokens[:length]
            context[prefix_len + length] = bonus
            hiddens = node_hiddens.index_select(0, path[:length])
            prefix_len += length
            # 5. stop at EOS or the budget, exactly where plain decoding would
            new, done = _cut(new, max_new_tokens - stats.new_tokens, eos)
            stats.record_step(tree.size - 1, length - 1, len(new), began, (m1, m2, m3), clock)
            emitted.extend(new)
            yield new
            if done:
                return

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 128, **kwargs) -> torch.Tensor:
        """Like `model.generate` (batch 1): returns (1, prompt + new) token ids. See `decode` for options."""
        prompt = input_ids if input_ids.dim() == 2 else input_ids[None]
        new = [t for step in self.decode(prompt, max_new_tokens, **kwargs) for t in step]
        return torch.cat([prompt, torch.tensor([new], dtype=prompt.dtype, device=prompt.device)], dim=1)

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
