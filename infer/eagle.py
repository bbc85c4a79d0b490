"""EAGLE drafting: the draft model autoregresses on features to grow a token tree under the root.

Each step first feeds the drafter what the target just confirmed — (feature, next token) pairs of
the accepted path — into its own KV cache, then expands a tree:
  - EAGLE-2 (dynamic, the default): for `depth` steps, run the `top_k` frontier nodes with the best
    cumulative draft log-probability, record their top_k children each, then keep the best
    `total_tokens` candidates overall (ancestor-closed; see tree.select_tree);
  - EAGLE-1 (static): the same expansion over a fixed tree of choices.
Draft nodes go into the drafter's cache with a tree mask and are cropped off again before the
next step, so its cache only ever holds confirmed positions plus the current draft.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from selfspec.heads.draft_layers import DraftCache
from selfspec.heads.eagle import EagleDraft
from selfspec.infer.mask import PrefixMask, RowMask
from selfspec.infer.proposers import Draft, embedding_for
from selfspec.infer.rows import upload
from selfspec.infer.tree import Tree, choices_width, descend, select_tree, tree_from_choices
from selfspec.infer.verify import SamplingParams


class EagleProposer:
    """Drafts with an `EagleDraft` (or `Eagle3Draft`) on the target's features; dynamic (EAGLE-2) unless
    `choices` are given. EAGLE-3 reads fused target layers and drafts in its own vocabulary, mapped to
    target ids before anything leaves the proposer.

    It holds the drafter's cache for the sequence being decoded: one generation at a time per proposer.
    """

    @property
    def drafter(self) -> torch.nn.Module:
        """The trained module this proposer drafts with (what `selfspec tune` fits a tree for)."""
        return self.draft

    def __init__(
        self,
        draft: EagleDraft,
        embed: nn.Module,
        lm_head: nn.Module,
        depth: int | None = None,
        top_k: int | None = None,
        total_tokens: int | None = None,
        choices: list[list[int]] | None = None,
    ) -> None:
        cfg = draft.config
        self.draft = draft.eval()
        self.name = cfg.kind  # eagle | eagle3
        self.feature_layers = cfg.feature_layers  # what the target hands over (EAGLE-3's fused layers; EAGLE-1: none)
        self.device = next(draft.parameters()).device  # the drafter's own (by the lm_head); what it reads moves here
        self.embed, self.lm_head = embedding_for(embed, self.device), lm_head
        self.dtype = next(draft.parameters()).dtype
        self.depth = depth if depth is not None else cfg.depth
        self.top_k = top_k if top_k is not None else cfg.top_k
        self.total_tokens = total_tokens if total_tokens is not None else cfg.total_tokens
        for name in ("depth", "top_k", "total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EAGLE {name} must be >= 1, got {getattr(self, name)}")
        self.depth = min(self.depth, self.total_tokens)  # a kept tree is never deeper than its node count
        draft.check_draft_vocab("this EAGLE drafter")  # an in-memory d2t too: siblings must be distinct tokens
        drafted = cfg.draft_vocab_size or cfg.vocab_size
        width = choices_width(choices)
        for wanted, what in ((self.top_k, "top_k"), (width, "children per node in the static tree")):
            if wanted > drafted:
                raise ValueError(f"this drafter drafts among {drafted} tokens, fewer than its {wanted} {what}: use "
                                 f"at most {drafted}")
        # per-step constants of the dynamic tree, made once: frontier slots, each child's rank among its
        # parent's k, and the frontier's view of its own new cache columns
        self.slots = torch.arange(self.top_k, device=self.device)
        self.child_ranks = self.slots.repeat(self.top_k)
        self.own = torch.eye(self.top_k, dtype=torch.bool, device=self.device)
        self.static: Tree | None = None
        if choices is not None:
            self.static = tree_from_choices(choices).to(self.device)
            self.max_nodes = self.static.size
            # level d of the static tree: node indices [start_d, end_d), and which of them have children
            depths = self.static.depths.tolist()
            self.levels = [(depths.index(d), len(depths) - depths[::-1].index(d)) for d in range(max(depths) + 1)]
            self.static_width = width
        else:
            self.max_nodes = min(self.total_tokens, self.top_k + (self.depth - 1) * self.top_k**2) + 1
        self.reset(0)

    def reset(self, max_length: int, params: SamplingParams | None = None, generator=None) -> None:
        self.length = 0  # confirmed positions in the drafter's cache
        draft_columns = max(self.max_nodes, self.depth * self.top_k)
        self.cache = DraftCache.for_drafter(self.draft, max_length + draft_columns)
        self.mask = PrefixMask(max(self.top_k, self.max_nodes), max_length + draft_columns, self.dtype, self.device)

    def _run(self, features: torch.Tensor, tokens: torch.Tensor, visible: torch.Tensor, position: torch.Tensor,
             last_only: bool = False):
        """One drafter call on q new positions after the confirmed ones and the draft so far.

        visible (q, n) bool over the newest n cache columns (the draft so far plus these q) -> the
        predicted features (q, H) and their log-probabilities over the vocabulary (q, V), or only the
        last position's with `last_only` (confirmed pairs: only the newest drafts anything).
        """
        # None: plain causal attention, right for confirmed pairs; used for more of them than the buffer has rows
        fits = self.length and visible.shape[0] <= self.mask.buffer.shape[-2]
        mask = self.mask.at(self.length, visible) if fits else None
        out = self.draft(features[None], tokens[None], self.embed, mask, position[None], self.cache)[0]
        if last_only:
            out = out[-1:]
        return out, self._log_probs(out)

    def _log_probs(self, out: torch.Tensor) -> torch.Tensor:
        """Predicted features (..., H) -> log-probabilities over the draft vocabulary (..., V), float32, with a
        finite floor that keeps scores strictly falling along paths (NaN would break the tree selection)."""
        logp = torch.log_softmax(self.draft.logits(out, self.lm_head).float(), dim=-1)
        return logp.nan_to_num(nan=-1e4, neginf=-1e4)

    @torch.no_grad()
    def propose(self, context: torch.Tensor, hiddens: torch.Tensor) -> Draft:
        m = hiddens.shape[0]
        self.cache.length = self.length  # drop the last step's draft nodes (they are overwritten in place)
        # the confirmed pairs (f_t, x_{t+1}); the last one holds the root, so its output drafts depth 1
        positions = torch.arange(self.length, self.length + m, device=self.device)
        causal = torch.ones(m, m, dtype=torch.bool, device=self.device).tril()
        feats, logp = self._run(self.draft.fuse(hiddens.to(self.device, self.dtype)), context[-m:], causal, positions,
                                last_only=True)
        self.length += m
        root_feature, root_logp = feats[-1], logp[-1]
        if self.static is not None:
            return Draft(*self._static(context[-1:], root_feature, root_logp))
        return Draft(*self._dynamic(context[-1:], root_feature, root_logp))

    @property
    def drafts_rows(self) -> bool:
        """Whether `propose_rows` drafts a batch in one set of drafter calls (the dynamic tree does)."""
        return self.static is None

    def reset_rows(self, rows: int, max_length: int) -> None:
        """A batch of `rows` sequences of at most `max_length` tokens starts (`propose_rows`): one drafter cache for
        all of them. Row b's confirmed pairs sit in columns 0 .. lengths[b] - 1; each call writes at the shared
        column max(lengths), then moves each row's pairs down to its own end, as the target's cache does."""
        draft_columns = max(self.max_nodes, self.depth * self.top_k)
        capacity = max_length + draft_columns + self.max_nodes
        self.row_cache = DraftCache.for_drafter(self.draft, capacity, batch=rows)
        self.row_mask = RowMask(rows, max(self.top_k, self.max_nodes), capacity, self.dtype, self.device)
        self.row_lengths = [0] * rows

    def select_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """The batch goes on with rows `keep` only, in that order (the others stopped; `index`: the same on the
        device): their drafter cache and mask rows move down, and later calls draft for len(keep) rows."""
        self.row_cache.select_rows(keep, index)
        self.row_mask.select_rows(keep, index, self.row_cache.length)
        self.row_lengths = [self.row_lengths[i] for i in keep]

    @torch.no_grad()
    def propose_rows(self, active: list[bool], contexts: list[torch.Tensor], hiddens: list[torch.Tensor]
                     ) -> list[Draft | None]:
        """`propose` for every row of a batch at once (after `reset_rows`): the same drafts each row's own
        proposer would make, from depth + 1 drafter calls for the whole batch instead of per row. Rows not
        `active` (stopped, or verifying their root alone) feed nothing and get None."""
        B, device, k = len(contexts), self.device, self.top_k
        if not any(active):  # nothing to feed or draft (e.g. every row near the position limit)
            return [None] * B
        counts = [h.shape[0] if on else 0 for h, on in zip(hiddens, active)]
        M = max(counts)
        cache, mask = self.row_cache, self.row_mask
        # 1. the confirmed pairs (f_t, x_{t+1}) of each row, right-padded to M and written at the shared column
        feats = torch.zeros(B, M, hiddens[0].shape[-1], dtype=self.dtype, device=device)  # rows' features move here
        tokens = torch.zeros(B, M, dtype=torch.long, device=device)
        for b, m in enumerate(counts):
            if m:
                feats[b, :m] = hiddens[b]
                tokens[b, :m] = contexts[b][-m:]
        at = cache.length
        lengths = upload(self.row_lengths, device)
        cols = torch.arange(M, device=device)
        count_t = upload(counts, device)
        positions = lengths[:, None] + cols
        if at == 0:  # the prompts: right padding after causal pairs is never seen by them
            block = None
        else:
            causal = torch.ones(M, M, dtype=torch.bool, device=device).tril()
            block = mask.at(at, (causal[None] & (cols < count_t[:, None])[:, None, :]) | torch.eye(M, dtype=torch.bool, device=device))
        out = self.draft(self.draft.fuse(feats.to(self.dtype)), tokens, self.embed, block, positions, cache)
        last = out.gather(1, (count_t - 1).clamp(min=0)[:, None, None].expand(B, 1, out.shape[-1]))[:, 0]  # (B, H)
        root_logp = self._log_probs(last)
        # each row's pairs move down to its own end; the shared column becomes the longest row's end
        dst = lengths[:, None] + cols
        cache.keep_rows(at + cols.expand(B, M), dst)
        mask.commit(at, M, dst, cols < count_t[:, None])
        self.row_lengths = [n + m for n, m in zip(self.row_lengths, counts)]
        cache.length = base = max(self.row_lengths)
        lengths = lengths + count_t
        # 2. EAGLE-2's expansion, every row's frontier in one call per depth
        def run(features: torch.Tensor, tokens: torch.Tensor, visible: torch.Tensor, d: int):
            out = self.draft(features, tokens, self.embed, mask.at(base, visible), (lengths - 1 + d)[:, None].expand(B, k),
                             cache)
            return out, self._log_probs(out)

        scores, drafted, parents, ranks = self._expand(last, root_logp, run)
        mask.hide(base, cache.length - base)
        cache.length = base  # the draft nodes are dropped (overwritten next time)
        drafts: list[Draft | None] = []
        for b in range(B):
            if not active[b]:
                drafts.append(None)
                continue
            chosen, tree = select_tree(scores[b], parents[b], ranks[b], self.max_nodes - 1, self.depth, k)
            drafts.append(Draft(torch.cat([contexts[b][-1:], drafted[b][chosen]]), tree))
        return drafts

    def _dynamic(self, root: torch.Tensor, root_feature: torch.Tensor, root_logp: torch.Tensor) -> tuple[torch.Tensor, Tree]:
        def run(features: torch.Tensor, tokens: torch.Tensor, visible: torch.Tensor, d: int):
            position = torch.full((self.top_k,), self.length - 1 + d, device=self.device)
            out, logp = self._run(features[0], tokens[0], visible[0], position)
            return out[None], logp[None]

        scores, tokens, parents, ranks = self._expand(root_feature[None], root_logp[None], run)
        chosen, tree = select_tree(scores[0], parents[0], ranks[0], self.max_nodes - 1, self.depth, self.top_k)
        return torch.cat([root, tokens[0][chosen]]), tree

    def _expand(self, root_feature: torch.Tensor, root_logp: torch.Tensor, run: Callable
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """EAGLE-2's candidates for a batch of rows (one row: B = 1): from each root's predicted feature (B, H) and
        log-probabilities (B, V), `depth` levels, each running the `top_k` best frontier nodes through
        `run(features (B, k, H), tokens (B, k), visible (B, k, n), depth)` -> (out (B, k, H), logp (B, k, V)).
        Returns every candidate's cumulative score, target token, parent candidate (-1: the root) and rank among
        its siblings, (B, C) each, in depth order (what tree.select_tree takes)."""
        B, k = root_feature.shape[0], self.top_k
        top = root_logp.topk(k)
        scores, tokens = [top.values], [self.draft.to_target(top.indices)]
        parents = [torch.full((B, k), -1, dtype=torch.long, device=self.device)]
        ranks = [self.slots.expand(B, k)]
        # the frontier: the k best nodes of the newest depth; each runs on its parent's predicted feature
        front_scores, front_tokens, front_index = top.values, tokens[0], self.slots.expand(B, k)
        front_features = root_feature[:, None].expand(B, k, root_feature.shape[-1])
        visible = self.own.expand(B, k, k)  # frontier x draft columns so far
        offset = k  # candidates recorded so far
        for d in range(1, self.depth):
            out, logp = run(front_features, front_tokens, visible, d)
            top = logp.topk(k)  # (B, k, k) children of each frontier node
            child_scores = descend(front_scores, top.values).flatten(1)
            scores.append(child_scores)
            tokens.append(self.draft.to_target(top.indices.flatten(1)))
            parents.append(front_index.repeat_interleave(k, dim=1))
            ranks.append(self.child_ranks.expand(B, -1))
            best = child_scores.topk(k).indices  # (B, k)
            parent_slot = best // k
            front_scores, front_tokens = child_scores.gather(1, best), tokens[-1].gather(1, best)
            front_index = offset + best
            front_features = out.gather(1, parent_slot[..., None].expand(-1, -1, out.shape[-1]))
            visible = torch.cat([visible.gather(1, parent_slot[..., None].expand(-1, -1, visible.shape[-1])),
                                 self.own.expand(B, k, k)], dim=2)
            offset += k * k
        return tuple(torch.cat(x, dim=1) for x in (scores, tokens, parents, ranks))

    def _static(self, root: torch.Tensor, root_feature: torch.Tensor, root_logp: torch.Tensor) -> tuple[torch.Tensor, Tree]:
        tree, width = self.static, self.static_width
        tokens = torch.empty(tree.size, dtype=torch.long, device=self.device)
        tokens[:1] = root
        features = root_feature.new_empty(tree.size, root_feature.shape[-1])  # the drafter's output at each node
        features[0] = root_feature
        kids = torch.empty(tree.size, width, dtype=torch.long, device=self.device)  # each node's top-`width` tokens
        kids[0] = self.draft.to_target(root_logp.topk(width).indices)
        for d, (start, end) in enumerate(self.levels[1:], start=1):
            parents = tree.parents[start:end]
            tokens[start:end] = kids[parents].gather(1, tree.ranks[start:end, None])[:, 0]
            if d == len(self.levels) - 1:
                break  # the deepest level has no children to draft
            # run this level: each node on its parent's predicted feature, seeing its drafted ancestors
            position = torch.full((end - start,), self.length - 1 + d, device=self.device)
            visible = tree.ancestors[start:end, 1:end]
            features[start:end], logp = self._run(features[parents], tokens[start:end], visible, position)
            kids[start:end] = self.draft.to_target(logp.topk(width).indices)
        return tokens, tree


def eagle_proposer(draft: EagleDraft, model: nn.Module, tree: list[list[int]] | None = None, dynamic: bool = False,
                   **tree_options: int | None) -> EagleProposer:
    """The EAGLE-1/2 and EAGLE-3 families' proposer: `tree` (else the drafter's own) is a static tree of paths;
    without one, or with `dynamic` (what `selfspec tune` measures), `tree_options` (depth, top_k, total_tokens)
    shape EAGLE-2's dynamic tree."""
    choices = None if dynamic else tree if tree is not None else draft.config.tree
    return EagleProposer(draft, model.get_input_embeddings(), model.get_output_embeddings(), choices=choices,
                         **tree_options)
