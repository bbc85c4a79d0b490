"""One generation's decode state and its step: propose -> verify -> accept (the one host read) -> commit.

Every row's tree is written at one shared cache column and each row's accepted path moves down to its own end
(`infer.rows`), so rows accept different lengths without copying any prefix. How a step's tensors are shaped
is one strategy chosen per generation: `Shapes` (as small as the step needs; stopped rows leave the batch) or
`FixedShapes` (the same shapes at every step, for a compiled verify).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from selfspec.infer.core.cache import PreallocatedCache
from selfspec.infer.core.mask import RowMask
from selfspec.infer.core.rows import Rows, first_tokens, upload
from selfspec.infer.core.target import Target
from selfspec.infer.core.timing import Clock, Mark
from selfspec.infer.core.tree import Tree, stack_trees
from selfspec.infer.core.verify import SamplingParams, accept_greedy_rows, accept_sampled_rows
from selfspec.infer.core.verify import accept as accept_tree
from selfspec.infer.drafters.drafter import Draft, Drafter

COMPILED_CACHE_STEP = 256  # a compiled verify attends over the whole cache: 256 columns, or a doubling of it


class Shapes:
    """Each step's tensors as small as it needs: rows that stopped leave the batch (the running ones move down
    to the first slots of the cache, the mask and the drafter's state, once per stop), trees stack to the
    widest one, the mask ends at the tree."""

    def cache_length(self, needed: int) -> int:
        """The KV cache's length for a generation that needs `needed` columns."""
        return needed

    def tree_width(self, max_nodes: int) -> int:
        """The node count trees are padded to (0: the widest tree of the step)."""
        return 0

    def leave_stopped(self, state: DecodeState) -> None:
        """Drop the rows that stopped from every per-row structure, so that later forwards carry only the
        rest."""
        rows = state.rows
        if not any(rows.done):
            return
        width = max(rows.filled)
        keep, index = rows.drop_stopped()
        state.cache.select_rows(keep, index.to(state.feed))
        state.mask.select_rows(keep, index.to(state.feed), width)
        state.drafter.keep_rows(keep, index)
        state.context[: len(keep), : width + 1] = state.context[:, : width + 1].index_select(0, index)
        state.context = state.context[: len(keep)]

    def verify(
        self,
        state: DecodeState,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        at: int,
        ancestors: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target forward over every row's tree at column `at`: tokens and positions (B, N), ancestors
        (B, N, N) -> logits (B, N, V) and the features the drafter reads (B, N, ·)."""
        mask = state.mask.at(at, ancestors)
        return state.target.verify_rows(tokens, positions, mask, state.cache)


class FixedShapes(Shapes):
    """The same shapes at every step, for a compiled verify: the cache COMPILED_CACHE_STEP columns doubled
    until it fits (so a session whose generations grow to n columns compiles for about log2(n / 256) + 1 cache
    lengths per batch size: the cache is reused while it is big enough), every tree padded to the largest, the
    mask over the whole cache, and stopped rows stay as padding."""

    def cache_length(self, needed: int) -> int:
        length = COMPILED_CACHE_STEP
        while length < needed:
            length *= 2
        return length

    def tree_width(self, max_nodes: int) -> int:
        return max_nodes

    def leave_stopped(self, state: DecodeState) -> None:
        pass

    def verify(
        self,
        state: DecodeState,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        at: int,
        ancestors: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mask = state.mask.at(at, ancestors, full=True)
        return state.target.verify_rows(
            tokens, positions, mask, state.cache, at=state.rows.filled_t.max().to(state.feed)
        )


@dataclasses.dataclass
class Proposal:
    """A step's drafts: per row, and stacked (trees (B, N) padded to one width, tokens (B, N) root first)."""

    drafts: list[Draft]
    trees: Tree
    tokens: torch.Tensor


@dataclasses.dataclass
class Verified:
    """The target's verdict on a step's trees, written at cache column `at`: logits (B, N, V) and the features
    the drafter reads (B, N, ·)."""

    at: int
    logits: torch.Tensor
    features: torch.Tensor


@dataclasses.dataclass
class Accepted:
    """Per row the accepted path: node indices (B, D + 1) root first, their tokens, the depth reached (B, 1),
    the bonus token (B,), the features at the path's nodes, and the step's one host copy (depth, path tokens,
    bonus)."""

    paths: torch.Tensor
    path_tokens: torch.Tensor
    end_depths: torch.Tensor
    bonus: torch.Tensor
    path_features: torch.Tensor
    host: list[list[int]]
    verified: Mark  # the clock's mark once verify and accept were queued (before the host read)


class DecodeState:
    """Everything one generation's steps read and update, and the steps. Tokens, trees and the rows' state
    live where drafts are made (`device`: the drafter sits by the lm_head); what the model reads
    (ids, positions, mask) where its input embedding is (`feed`); outputs are used where they come out
    (under accelerate's device_map the logits return to the input's device)."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter,
        shapes: Shapes,
        params: SamplingParams,
        cache: PreallocatedCache,
        feed: torch.device,
        limit: int | None,
        root_only: Tree,
    ) -> None:
        self.target, self.drafter, self.shapes, self.params, self.cache = (
            target,
            drafter,
            shapes,
            params,
            cache,
        )
        self.device, self.feed = target.lm_head.weight.device, feed
        self.clock = Clock(self.device)
        self.root_only = root_only  # the tree of a row that drafts nothing
        self.max_nodes = drafter.max_nodes
        self.columns = torch.arange(self.max_nodes, device=self.device)
        # the latest root position a tree fits after (the model's position limit)
        self.last_tree_at = None if limit is None else limit - self.max_nodes

    def prefill(
        self,
        input_ids: torch.Tensor,
        prompts: list[list[int]],
        starts: list[int],
        budgets: list[int],
        eos: set[int],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """The prompts (B, T) (host copy: `prompts`), left-padded at `starts`, through the target once into
        the emptied cache; their last logits give each row's first token (its first tree root), returned
        (read to the host: the prefill's one sync)."""
        B, T = input_ids.shape
        max_len = T + max(budgets) + self.max_nodes
        self.context = torch.empty(
            B, max_len + 1, dtype=torch.long, device=self.device
        )  # tokens, then the root
        self.context[:, :T] = input_ids
        # as wide as the cache's buffers (a reused cache may be larger): a compiled verify keeps one shape
        self.mask = RowMask(B, self.max_nodes, self.cache.max_length, self.target.dtype, self.feed)
        self.drafter.start(B, max_len, self.params, generators)
        start_t = upload(starts, self.feed)
        logits, features = self.target.prefill_rows(
            input_ids.to(self.feed), self.cache, start_t if any(starts) else None
        )
        roots = first_tokens(logits, self.params, generators)
        self.context[:, T] = roots
        self.mask.open(start_t, T)
        first = roots.tolist()
        self.drafter.observe([prompt[start:] + [tok] for prompt, start, tok in zip(prompts, starts, first)])
        self.rows = Rows(
            starts,
            budgets,
            T,
            first,
            eos,
            generators,
            [features[b, s:] for b, s in enumerate(starts)],
            self.device,
        )
        return first

    def propose(self) -> Proposal:
        """Each running row's tree below its root, from the drafter; a row near the position limit, or
        stopped, gets its root alone (padding)."""
        rows, context = self.rows, self.context
        contexts = [context[b, s : f + 1] for b, (s, f) in enumerate(zip(rows.starts, rows.filled))]
        drafts = self.drafter.propose(rows.drafting(self.last_tree_at), contexts, rows.hiddens)
        drafts = [d if d is not None else Draft(c[-1:], self.root_only) for d, c in zip(drafts, contexts)]
        trees = stack_trees([d.tree for d in drafts], self.shapes.tree_width(self.max_nodes))
        N = trees.parents.shape[1]
        tokens = torch.stack(
            [
                d.tokens if d.tokens.numel() == N else nn.functional.pad(d.tokens, (0, N - d.tokens.numel()))
                for d in drafts
            ]
        )
        return Proposal(drafts, trees, tokens)

    def verify(self, proposal: Proposal) -> Verified:
        """One target forward over every row's tree, all written at one cache column."""
        at = self.rows.tree_column()
        positions = self.rows.positions(proposal.trees.depths).to(self.feed)
        logits, features = self.shapes.verify(
            self, proposal.tokens.to(self.feed), positions, at, proposal.trees.ancestors.to(self.feed)
        )
        return Verified(at, logits, features)

    def accept(self, proposal: Proposal, verified: Verified) -> Accepted:
        """Per row the deepest node whose path the target agrees with, plus a bonus token (on the logits'
        device: the drafts move there, not the logits), then the step's one host read."""
        trees, tokens, rows, logits = proposal.trees, proposal.tokens, self.rows, verified.logits
        on = logits.device
        if self.params.greedy:
            ends, bonus = accept_greedy_rows(logits, tokens.to(on), trees.to(on))
        elif all(d.probs is None for d in proposal.drafts):  # point proposals: every row at once
            shapes = [
                None if done else tuple(d.tree.children.shape) for done, d in zip(rows.done, proposal.drafts)
            ]
            ends, bonus = accept_sampled_rows(
                logits, tokens.to(on), trees.to(on), self.params, rows.generators, shapes
            )
        else:  # drafts sampled from q (a draft model): each row on its own, its draws from its own generator
            picks = [
                accept_tree(
                    logits[b, : d.tree.size],
                    d.tokens.to(on),
                    d.tree.to(on),
                    self.params,
                    rows.generators[b],
                    None if d.probs is None else d.probs.to(on),
                )
                if not rows.done[b]
                else (torch.zeros(1, dtype=torch.long, device=on), tokens[b, :1].to(on)[0])
                for b, d in enumerate(proposal.drafts)
            ]
            ends, bonus = torch.cat([e for e, _ in picks]), torch.stack([t for _, t in picks])
        ends, bonus = ends.to(self.device), bonus.to(self.device)
        mark = self.clock.mark()
        W = trees.paths.shape[-1]
        paths = trees.paths.gather(1, ends[:, None, None].expand(len(rows), 1, W))[:, 0]
        path_tokens = tokens.gather(1, paths)
        end_depths = trees.depths.gather(1, ends[:, None])
        host = torch.cat([end_depths, path_tokens, bonus[:, None]], 1).tolist()  # the one sync
        features = verified.features
        path_features = features.gather(
            1, paths.to(features.device)[:, :, None].expand(-1, -1, features.shape[-1])
        )
        return Accepted(paths, path_tokens, end_depths, bonus, path_features, host, mark)

    def commit(
        self, proposal: Proposal, verified: Verified, accepted: Accepted
    ) -> tuple[list[list[int]], dict]:
        """Each row keeps its prefix + accepted path (cut at EOS or its budget) in the cache, the mask and the
        context; its bonus is its next root. Returns each row's new tokens and the step's counters."""
        rows, at = self.rows, verified.at
        # trees of the root alone (plain decoding) written where every row ends: nothing to move
        in_place = proposal.tokens.shape[1] == 1 and all(f == at for f in rows.filled)
        new_rows, lengths, counts = rows.take(accepted.host, [d.tree.size for d in proposal.drafts])
        self.drafter.observe(new_rows)
        dst, kept = rows.advance(lengths, accepted.end_depths, self.columns[: accepted.paths.shape[1]])
        if in_place:
            self.cache.set_length(rows.cache_end())
        else:  # each row's path moves to its end
            self.cache.keep_rows(at + accepted.paths, dst, rows.cache_end())
        self.mask.commit(at, proposal.tokens.shape[1], dst.to(self.feed), kept.to(self.feed))
        self.context.scatter_(1, dst, accepted.path_tokens)
        self.context.scatter_(1, rows.filled_t[:, None], accepted.bonus[:, None])
        rows.end_step()
        rows.hiddens = [
            accepted.path_features[b, :n] for b, n in enumerate(lengths)
        ]  # each drafter moves its own
        return new_rows, counts
