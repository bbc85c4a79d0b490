"""Trees from drafters that propose every depth at once (DFlash, P-EAGLE): depth d's distribution does not
depend on the tokens drafted before it, so every node at depth d - 1 shares depth d's top_k as its children.

  - top_k 1: the chain of each depth's argmax, `depth` nodes;
  - top_k > 1: EAGLE-2's selection over those candidates: each depth's frontier (its k best candidates by
    cumulative log-probability) gets the next depth's top_k, and the `total_tokens` best candidates are kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from selfspec.infer.core.tree import Tree, descend, row_trees, select_tree, tree_from_choices


class ParallelTree:
    """Builds each row's draft tree from per-depth logits (B, depth, V); `to_target` maps the logits' indices
    to target ids (a draft vocabulary), and the tokens come back as target ids."""

    def __init__(
        self,
        depth: int,
        top_k: int,
        total_tokens: int,
        device: torch.device | str,
        to_target: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.depth, self.top_k = min(depth, total_tokens), top_k
        self.to_target = to_target or (lambda ids: ids)
        if top_k == 1:  # the chain: one node per drafted depth
            self.chain = tree_from_choices([[0] * d for d in range(1, self.depth + 1)]).to(device)
            self.max_nodes = self.depth + 1
        else:
            self.max_nodes = min(total_tokens, top_k + (self.depth - 1) * top_k**2) + 1
        self.slots = torch.arange(top_k, device=device)

    def rows(self, roots: torch.Tensor, logits: torch.Tensor) -> list[tuple[torch.Tensor, Tree]]:
        """roots (B,) and per-depth logits (B, >= depth, V) -> each row's tree tokens (root first) and
        tree."""
        logits = logits[:, : self.depth]
        if self.top_k == 1:
            tokens = torch.cat([roots[:, None], self.to_target(logits.argmax(-1))], dim=1)
            return [(row, self.chain) for row in tokens]
        scores, drafted, parents, ranks = self.candidates(logits)
        chosen, tree = select_tree(scores, parents, ranks, self.max_nodes - 1, self.depth, self.top_k)
        return row_trees(roots, drafted, chosen, tree)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """EAGLE-2's candidates from per-depth logits (B, D, V): depth 1 is depth 1's top_k; a depth-d
        frontier (its k best candidates) each gets depth d + 1's top_k as children. Scores, target tokens,
        parent candidates (-1: the root) and sibling ranks (B, C) each, in depth order (tree.select_tree's
        input)."""
        B, k = logits.shape[0], self.top_k
        logp = torch.log_softmax(logits.float(), dim=-1).nan_to_num(nan=-1e4, neginf=-1e4)
        top = logp.topk(k, dim=-1)  # (B, D, k)
        ids = self.to_target(top.indices)
        scores, tokens = [top.values[:, 0]], [ids[:, 0]]
        parents = [torch.full((B, k), -1, dtype=torch.long, device=logits.device)]
        ranks = [self.slots.expand(B, k)]
        front_scores, front_index, offset = top.values[:, 0], self.slots.expand(B, k), k
        for d in range(1, logits.shape[1]):
            child = descend(front_scores, top.values[:, d, None, :].expand(B, k, k)).flatten(1)  # (B, k·k)
            scores.append(child)
            tokens.append(ids[:, d].repeat(1, k))
            parents.append(front_index.repeat_interleave(k, dim=1))
            ranks.append(self.slots.repeat(k).expand(B, -1))
            best = child.topk(k).indices
            front_scores, front_index = child.gather(1, best), offset + best
            offset += k * k
        return tuple(torch.cat(x, dim=1) for x in (scores, tokens, parents, ranks))
