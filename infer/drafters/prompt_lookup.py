"""Prompt lookup: draft the continuation of the latest earlier occurrence of the context's last n-gram.

No model and no training: code and chat often repeat what is already in the context. An n-gram
index (n-gram -> positions after it) is updated with the new tokens only, so a step costs the
same however long the context is.
"""

from __future__ import annotations

import torch

from selfspec.infer.core.rows import upload
from selfspec.infer.core.tree import chain_choices, tree_from_choices
from selfspec.infer.core.verify import SamplingParams
from selfspec.infer.drafters.drafter import Draft, Drafter, PerRow


class PromptLookupProposer:
    """Proposes up to `num_tokens` tokens; tries the longest n-gram first (max_ngram down to min_ngram)."""

    name = "prompt_lookup"

    def __init__(
        self,
        num_tokens: int = 10,
        max_ngram: int = 3,
        min_ngram: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        if num_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"need num_tokens >= 1 and 1 <= min_ngram <= max_ngram, got {num_tokens}, "
                f"{min_ngram}, {max_ngram}"
            )
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.max_nodes = num_tokens + 1
        self.host_chains = [tree_from_choices(chain_choices(n)) for n in range(num_tokens + 1)]
        self._to(torch.device(device or "cpu"))
        self.reset(0, SamplingParams(), None)

    def reset(self, max_length: int, params: SamplingParams, generator: torch.Generator | None) -> None:
        self.tokens: list[int] = []
        self.index: dict[
            tuple[int, ...], int
        ] = {}  # n-gram -> where the token after its latest occurrence sits

    def _extend(self, new: list[int]) -> None:
        for tok in new:
            self.tokens.append(tok)
            end = len(self.tokens)
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end > n:  # the n-gram ending just before the newest token now has a continuation
                    self.index[tuple(self.tokens[end - 1 - n : end - 1])] = end - 1

    def lookup(self) -> list[int]:
        """The continuation after the latest earlier occurrence of the longest matching suffix n-gram."""
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(self.tokens) <= n:
                continue
            start = self.index.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start : start + self.num_tokens]
        return []

    def _to(self, device: torch.device) -> None:
        """Keep the trees on `device`: the target's (read from the context), whatever the constructor said."""
        self.device = device
        self.chains = [chain.to(device) for chain in self.host_chains]

    def observe(self, new: list[int]) -> None:
        """The tokens the context grew by, from the host (the decode loop has them after its one read per
        step: the prompt and first token, then each step's new tokens), so that `propose` reads nothing
        back."""
        self._extend(new)

    @torch.no_grad()
    def propose(self, context: torch.Tensor, hiddens: torch.Tensor) -> Draft:
        if context.device != self.device:
            self._to(context.device)
        if (
            len(self.tokens) < context.shape[0]
        ):  # not told by `observe`: only the new tokens cross to the host
            self._extend(context[len(self.tokens) :].tolist())
        guess = self.lookup()
        return Draft(upload([self.tokens[-1], *guess], self.device), self.chains[len(guess)])


class LookupFirst(Drafter):
    """Prompt lookup where it finds at least `min_tokens` to propose, another drafter elsewhere.

    Repetitive stretches (code, quoting, loops) then cost no draft work at all. The other drafter
    gets the hidden states of every token confirmed since it last ran, so EAGLE's cache stays in
    step, and a draft model feeds the tokens it missed at its next draft.
    """

    def __init__(self, primary: Drafter, lookup: PromptLookupProposer, min_tokens: int = 3) -> None:
        if not isinstance(primary, Drafter):
            raise ValueError(
                "lookup-first needs a batched drafter (Medusa, EAGLE, DFlash, P-EAGLE, MTP, a draft "
                f"model), not {primary.name}"
            )
        self.primary, self.lookup, self.min_tokens = primary, PerRow(lookup), min_tokens
        self.name = f"{primary.name}+lookup"
        self.max_nodes = max(primary.max_nodes, lookup.max_nodes)
        self.feature_layers = primary.feature_layers  # the target hands the primary its features
        self.weights_device = primary.weights_device
        self.pending: list[list[torch.Tensor]] = []  # per row: the features the primary has not been fed yet

    def start(
        self, rows: int, max_length: int, params: SamplingParams, generators: list[torch.Generator | None]
    ) -> None:
        # the primary may be fed a row's whole context at once after lookup steps: room for twice the length
        self.primary.start(rows, 2 * max_length, params, generators)
        self.lookup.start(rows, max_length, params, generators)
        self.pending = [[] for _ in range(rows)]

    def observe(self, new: list[list[int]]) -> None:
        self.lookup.observe(new)
        self.primary.observe(new)  # most primaries read the device context; a draft model prefills here

    def finish(self) -> None:
        self.primary.finish()

    def keep_rows(self, keep: list[int], index: torch.Tensor) -> None:
        self.primary.keep_rows(keep, index)
        self.lookup.keep_rows(keep, index)
        self.pending = [self.pending[i] for i in keep]

    def propose(
        self, active: list[bool], contexts: list[torch.Tensor], hiddens: list[torch.Tensor]
    ) -> list[Draft | None]:
        found = self.lookup.propose(active, contexts, hiddens)
        for b, on in enumerate(active):
            if on:
                self.pending[b].append(hiddens[b])
        drafting = [d is not None and d.tokens.numel() - 1 < self.min_tokens for d in found]
        feeds = [torch.cat(self.pending[b]) if on else h for b, (h, on) in enumerate(zip(hiddens, drafting))]
        for b, on in enumerate(drafting):
            if on:
                self.pending[b] = []
        drafted = self.primary.propose(drafting, contexts, feeds) if any(drafting) else found
        return [d if on else f for d, f, on in zip(drafted, found, drafting)]
