"""Drafting by a module that autoregresses on the target's features to grow a token tree under the root: the
shared machinery of EAGLE-1/2/3 (heads/eagle.py, heads/eagle3.py) and the target's own MTP layers
(heads/mtp.py).

Each step first feeds the drafter what the target just confirmed — (feature, next token) pairs of
the accepted path — into its own KV cache, then expands a tree:
  - EAGLE-2 (dynamic, the default): for `depth` steps, run the `top_k` frontier nodes with the best
    cumulative draft log-probability, record their top_k children each, then keep the best
    `total_tokens` candidates overall (ancestor-closed; see tree.select_tree);
  - EAGLE-1 (static): the same expansion over a fixed tree of choices.
Draft nodes go into the drafter's cache with a tree mask and are cropped off again before the
next step, so its cache only ever holds confirmed positions plus the current draft. A batch of rows
drafts together: depth + 1 drafter calls per step whatever the batch size.

The drafter module answers: forward(features, tokens, embed, mask, positions, cache) -> its outputs, `fuse`,
`logits(out, lm_head)`, `to_target(draft ids)`, `check_draft_vocab(what)` and `config` (kind, feature_layers,
depth, top_k, total_tokens, draft_vocab_size, vocab_size).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from selfspec.heads.draft_layers import DraftCache
from selfspec.heads.joined import for_drafting, unjoin
from selfspec.infer.core.mask import RowMask
from selfspec.infer.core.tree import Tree, choices_width, descend, row_trees, select_tree, tree_from_choices
from selfspec.infer.core.verify import SamplingParams
from selfspec.infer.drafters.confirmed_pairs import ConfirmedPairs
from selfspec.infer.drafters.drafter import Draft, Drafter
from selfspec.infer.drafters.proposers import embedding_for


class FeatureDrafter(Drafter):
    """Drafts with a feature drafter (see the module's docstring) on the target's features; dynamic (EAGLE-2)
    unless `choices` are given. A drafter with a vocabulary of its own (EAGLE-3) drafts in it, mapped to
    target ids before anything leaves the proposer.

    It holds the drafter's cache for the batch being decoded: one generation at a time per proposer.
    """

    label = "feature"  # how messages name the drafter

    @property
    def drafter(self) -> torch.nn.Module:
        """The trained module this proposer drafts with (what `selfspec tune` fits a tree for)."""
        return self.draft

    def __init__(
        self,
        draft: nn.Module,
        embed: nn.Module,
        lm_head: nn.Module,
        depth: int | None = None,
        top_k: int | None = None,
        total_tokens: int | None = None,
        choices: list[list[int]] | None = None,
    ) -> None:
        cfg = draft.config
        self.draft = draft.eval()
        self.name = cfg.kind  # eagle | eagle3 | mtp
        self.feature_layers = (
            cfg.feature_layers
        )  # what the target hands over (EAGLE-3's fused layers; EAGLE-1: none)
        self.device = self.weights_device = next(
            draft.parameters()
        ).device  # by the lm_head; what it reads moves here
        self.embed, self.lm_head = embedding_for(embed, self.device), lm_head
        self.dtype = next(draft.parameters()).dtype
        self.depth = depth if depth is not None else cfg.depth
        self.top_k = top_k if top_k is not None else cfg.top_k
        self.total_tokens = total_tokens if total_tokens is not None else cfg.total_tokens
        for name in ("depth", "top_k", "total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"the tree's {name} must be >= 1, got {getattr(self, name)}")
        self.depth = min(self.depth, self.total_tokens)  # a kept tree is never deeper than its node count
        draft.check_draft_vocab(
            f"this {self.label} drafter"
        )  # an in-memory d2t too: siblings must be distinct tokens
        drafted = cfg.draft_vocab_size or cfg.vocab_size
        width = choices_width(choices)
        for wanted, what in ((self.top_k, "top_k"), (width, "children per node in the static tree")):
            if wanted > drafted:
                raise ValueError(
                    f"this drafter drafts among {drafted} tokens, fewer than its {wanted} {what}: use "
                    f"at most {drafted}"
                )
        # per-step constants of the dynamic tree, made once: frontier slots, each child's rank among its
        # parent's k, and the frontier's view of its own new cache columns
        k, device = self.top_k, self.device
        self.slots = torch.arange(k, device=device)
        self.own = torch.eye(k, dtype=torch.bool, device=device)
        self.ranks = self.slots.repeat(1 + (self.depth - 1) * k)  # each candidate's rank among its siblings
        self.root_parents = torch.full((1, k), -1, device=device)
        # where each level's candidates start: k at the first level, k·k below
        self.level_offsets = torch.tensor([0] + [k + d * k * k for d in range(self.depth - 2)], device=device)
        self.neg_inf = torch.tensor(-torch.inf, device=device)
        drafted_ids = torch.arange(cfg.draft_vocab_size or cfg.vocab_size, device=device)
        self.target_ids = draft.to_target(drafted_ids)  # draft id -> target id, one lookup
        self.static: Tree | None = None
        if choices is not None:
            self.static = tree_from_choices(choices).to(self.device)
            self.max_nodes = self.static.size
            # level d of the static tree: node indices [start_d, end_d), and which of them have children
            depths = self.static.depths.tolist()
            self.levels = [
                (depths.index(d), len(depths) - depths[::-1].index(d)) for d in range(max(depths) + 1)
            ]
            self.static_width = width
        else:
            self.max_nodes = min(self.total_tokens, self.top_k + (self.depth - 1) * self.top_k**2) + 1
        # each level's offset from a row's newest position: as deep as the dynamic tree, or the static one
        levels = len(self.levels) if self.static is not None else self.depth
        self.levels_below = torch.arange(max(levels, self.depth), device=device)

    def _log_probs(self, out: torch.Tensor) -> torch.Tensor:
        """Predicted features (..., H) -> log-probabilities over the draft vocabulary (..., V), float32, with
        a finite floor that keeps scores strictly falling along paths (NaN would break the tree selection)."""
        logp = torch.log_softmax(self.draft.logits(out, self.lm_head).float(), dim=-1)
        return logp.nan_to_num(nan=-1e4, neginf=-1e4)

    def start(
        self, rows: int, max_length: int, params: SamplingParams, generators: list[torch.Generator | None]
    ) -> None:
        """A batch of `rows` sequences of at most `max_length` tokens starts: one drafter cache for all of
        them. Row b's confirmed pairs sit in columns 0 .. lengths[b] - 1; each call writes at the shared
        column max(lengths), then moves each row's pairs down to its own end, as the target's cache does."""
        for_drafting(self.draft)  # its layers join their parameters until `finish` (heads/joined.py)
        draft_columns = max(self.max_nodes, self.depth * self.top_k)
        capacity = max_length + draft_columns + self.max_nodes
        self.cache = self.new_cache(capacity, rows)
        self.mask = RowMask(rows, max(self.top_k, self.max_nodes), capacity, self.dtype, self.device)
        self.pairs = ConfirmedPairs(self.cache, self.mask, rows)

    @property
    def lengths(self) -> list[int]:
        """Each row's confirmed positions in the drafter's cache."""
        return self.pairs.lengths

    def new_cache(self, capacity: int, rows: int) -> DraftCache:
        """The drafter's KV cache for `rows` rows of `capacity` positions: `length`, `keep_rows(src, dst)` and
        `select_rows(keep, index)`, written by the drafter's forward."""
        return DraftCache.for_drafter(self.draft, capacity, batch=rows)

    def finish(self) -> None:
        unjoin(self.draft)

    def keep_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """The batch goes on with rows `keep` only, in that order (the others stopped; `index`: the same on
        the device): their drafter cache and mask rows move down, and later calls draft for len(keep) rows."""
        self.pairs.keep_rows(keep, index)

    @torch.no_grad()
    def propose(
        self, active: list[bool], contexts: list[torch.Tensor], hiddens: list[torch.Tensor]
    ) -> list[Draft | None]:
        """Every row's tree from depth + 1 drafter calls for the whole batch (a static tree: one per level
        with children). Rows not `active` (stopped, or verifying their root alone) feed nothing and get
        None."""
        B, k = len(contexts), self.top_k
        if not any(active):  # nothing to feed or draft (e.g. every row near the position limit)
            return [None] * B
        cache, mask = self.cache, self.mask
        # 1. the confirmed pairs (f_t, x_{t+1}) of each row, written at the shared column
        feed = self.pairs.feed(active, contexts, hiddens, self.dtype, self.device)
        # the prompts: right padding after causal pairs is never seen by them
        block = None if feed.at == 0 else mask.at(feed.at, feed.pair_block())
        feats = self.draft.fuse(feed.feats.to(self.dtype))
        out = self.draft(feats, feed.tokens, self.embed, block, feed.positions, cache)
        last = feed.newest(out)  # (B, H)
        root_logp = self._log_probs(last)
        lengths = self.pairs.settle(feed, feed.tokens.shape[1])
        base = cache.length
        positions = lengths[:, None] - 1 + self.levels_below  # (B, depth): each level's position, per row

        # 2. the tree below each root: EAGLE-2's expansion or the static tree, every row in one call per depth
        def run(features: torch.Tensor, tokens: torch.Tensor, visible: torch.Tensor, d: int):
            q = tokens.shape[1]
            at = positions[:, d, None].expand(B, q)
            out = self.draft(features, tokens, self.embed, mask.at(base, visible), at, cache)
            return out, self._log_probs(out)

        roots = torch.stack([c[-1] for c in contexts])
        if self.static is not None:
            tokens = self._static(roots, last, root_logp, run)
        else:
            scores, drafted, parents, ranks = self._expand(last, root_logp, run)
        mask.hide(base, cache.length - base)
        cache.length = base  # the draft nodes are dropped (overwritten next time)
        if self.static is not None:
            rows = [(row, self.static) for row in tokens]
        else:
            chosen, tree = select_tree(scores, parents, ranks, self.max_nodes - 1, self.depth, k)
            rows = row_trees(roots, drafted, chosen, tree)
        return [Draft(*row) if on else None for row, on in zip(rows, active)]

    def _expand(
        self, root_feature: torch.Tensor, root_logp: torch.Tensor, run: Callable
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """EAGLE-2's candidates for a batch of rows (one row: B = 1): from each root's predicted feature
        (B, H) and log-probabilities (B, V), `depth` levels, each running the `top_k` best frontier nodes
        through `run(features (B, k, H), tokens (B, k), visible (B, k, n), depth)` -> (out (B, k, H), logp
        (B, k, V)). Returns every candidate's cumulative score, target token, parent candidate (-1: the root)
        and rank among its siblings, (B, C) each, in depth order (what tree.select_tree takes).

        Candidates are recorded in draft ids and mapped to target ids once at the end; parents and ranks
        follow from each level's frontier choice, so a level costs a dozen launches whatever k and B."""
        B, k = root_feature.shape[0], self.top_k
        top = root_logp.topk(k)
        scores, drafted = [top.values], [top.indices]  # (B, k), then (B, k·k) per level
        fronts = [self.slots.expand(B, k)]  # each level's frontier, as indices into that level's candidates
        front_scores, front_ids = top.values, top.indices
        front_features = root_feature[:, None].expand(B, k, root_feature.shape[-1])
        visible = self.own.expand(B, k, k)  # frontier x draft columns so far
        for d in range(1, self.depth):
            out, logp = run(front_features, self.target_ids[front_ids], visible, d)
            top = logp.topk(k)  # (B, k, k) children of each frontier node
            scores.append(descend(front_scores, top.values, self.neg_inf).flatten(1))
            drafted.append(top.indices.flatten(1))
            if d == self.depth - 1:
                break  # the deepest level is not expanded
            front_scores, best = scores[-1].topk(k)  # (B, k)
            fronts.append(best)
            parent_slot = (best // k)[..., None]
            front_ids = drafted[-1].gather(1, best)
            front_features = out.gather(1, parent_slot.expand(-1, -1, out.shape[-1]))
            shared = visible.gather(1, parent_slot.expand(-1, -1, visible.shape[-1]))
            visible = torch.cat([shared, self.own.expand(B, k, k)], dim=2)
        parents = [self.root_parents.expand(B, k)]
        if len(drafted) > 1:
            # level d's k·k candidates: child j of frontier slot i is candidate offset_d + i·k + j; its parent
            # is that slot's node of level d - 1, candidate level_offsets[d - 1] + fronts[d - 1][i]
            levels = len(drafted) - 1
            up = torch.stack(fronts[:levels], 1) + self.level_offsets[:levels, None]  # (B, levels, k)
            parents.append(up[..., None].expand(B, levels, k, k).reshape(B, -1))
        parents = torch.cat(parents, dim=1)
        tokens = self.target_ids[torch.cat(drafted, dim=1)]
        return torch.cat(scores, dim=1), tokens, parents, self.ranks[: parents.shape[1]].expand(B, -1)

    def _static(
        self, roots: torch.Tensor, root_feature: torch.Tensor, root_logp: torch.Tensor, run: Callable
    ) -> torch.Tensor:
        """EAGLE-1's static tree for a batch of rows: roots (B,), each root's predicted feature (B, H) and
        log-probabilities (B, V) -> tokens (B, N) of `self.static`, root first. Each level with children runs
        through `run` (see `_expand`), every node on its parent's predicted feature, seeing its drafted
        ancestors."""
        tree, width, B = self.static, self.static_width, roots.shape[0]
        tokens = torch.empty(B, tree.size, dtype=torch.long, device=self.device)
        tokens[:, 0] = roots
        features = root_feature.new_empty(
            B, tree.size, root_feature.shape[-1]
        )  # the drafter's output at each node
        features[:, 0] = root_feature
        kids = torch.empty(
            B, tree.size, width, dtype=torch.long, device=self.device
        )  # each node's top-`width`
        kids[:, 0] = self.target_ids[root_logp.topk(width).indices]
        for d, (start, end) in enumerate(self.levels[1:], start=1):
            parents = tree.parents[start:end]
            tokens[:, start:end] = kids[:, parents].gather(2, tree.ranks[start:end, None].expand(B, -1, 1))[
                ..., 0
            ]
            if d == len(self.levels) - 1:
                break  # the deepest level has no children to draft
            visible = tree.ancestors[start:end, 1:end].expand(B, -1, -1)
            features[:, start:end], logp = run(features[:, parents], tokens[:, start:end], visible, d)
            kids[:, start:end] = self.target_ids[logp.topk(width).indices]
        return tokens
