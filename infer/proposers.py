"""Proposers: given the root token and the target's last hidden state, draft the tree's tokens.

A proposer never calls the target; the decode loop verifies what it drafts.
"""

from __future__ import annotations

from typing import Protocol

import torch

from heads.medusa import MedusaHeads
from infer.tree import Tree, best_choices, tree_from_choices


class Proposer(Protocol):
    name: str
    tree: Tree

    def propose(self, root: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """root () token id, hidden (H,) target state that produced it -> tokens (N,) for `self.tree`."""
        ...


def default_medusa_choices(num_heads: int, num_nodes: int = 24) -> list[list[int]]:
    """A tree for untuned heads from a typical accuracy profile (falls with depth and rank)."""
    depth = torch.arange(num_heads, dtype=torch.float)[:, None]
    rank = torch.arange(10, dtype=torch.float)[None, :]
    accuracy = 0.6 * 0.75**depth / (rank + 1) ** 1.5
    return best_choices(accuracy, num_nodes)


class MedusaProposer:
    """Medusa: all heads read the one hidden state the root came from; the tree picks their top-k ranks."""

    name = "medusa"

    def __init__(self, heads: MedusaHeads, lm_head: torch.nn.Module, choices: list[list[int]] | None = None) -> None:
        if choices is None:
            choices = heads.config.tree if heads.config.tree is not None else default_medusa_choices(heads.config.num_heads)
        tree = tree_from_choices(choices)
        if tree.max_depth > heads.config.num_heads:
            raise ValueError(
                f"the tree is {tree.max_depth} deep but there are only {heads.config.num_heads} Medusa heads; "
                "use a shallower tree (--tree) or more heads"
            )
        device = next(heads.parameters()).device
        self.heads = heads.eval()
        self.lm_head = lm_head
        self.tree = tree.to(device)
        self.node_head = (self.tree.depths[1:] - 1).clone()  # (N-1,) which head drafts each node
        self.node_rank = self.tree.ranks[1:].clone()  # (N-1,) which of its top-k
        self.top_k = int(self.node_rank.max()) + 1 if len(choices) else 1
        self.dtype = next(heads.parameters()).dtype

    @torch.no_grad()
    def propose(self, root: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.stack(self.heads(hidden.to(self.dtype), self.lm_head))  # (K, V)
        top = logits.topk(self.top_k, dim=-1).indices  # (K, k)
        return torch.cat([root.view(1), top[self.node_head, self.node_rank]])  # (N,)


class NoDraft:
    """Drafts nothing: the tree is the root alone, so the loop becomes plain one-token decoding."""

    name = "plain"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.tree = tree_from_choices([]).to(device)

    def propose(self, root: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return root.view(1)
