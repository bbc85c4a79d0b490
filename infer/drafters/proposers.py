"""Medusa's drafter, the drafter that drafts nothing, and what every drafter needs from the target (its input
embedding where the drafter sits; the tree options' names)."""

from __future__ import annotations

import torch

from selfspec.heads.medusa import MedusaHeads
from selfspec.infer.core.tree import best_choices, tree_from_choices
from selfspec.infer.core.verify import SamplingParams
from selfspec.infer.drafters.drafter import Draft, Drafter

# from_pretrained's names for the dynamic tree's shape (EAGLE, DFlash), and the proposers' own
TREE_OPTIONS = {"draft_depth": "depth", "draft_top_k": "top_k", "draft_total_tokens": "total_tokens"}


class Embedding(torch.nn.Module):
    """The target's input embedding called from a drafter on another device (a target split by device_map):
    the ids go to the embedding's device and the vectors come back to the ids' own."""

    def __init__(self, embed: torch.nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids.to(self.embed.weight.device)).to(ids.device)


def embedding_for(embed: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`embed` as a drafter on `device` calls it: itself where it sits there too, else wrapped
    (`Embedding`)."""
    weight = getattr(embed, "weight", None)
    return embed if weight is None or weight.device == device else Embedding(embed)


def default_medusa_choices(num_heads: int, num_nodes: int = 24) -> list[list[int]]:
    """A tree for untuned heads from a typical accuracy profile (falls with depth and rank)."""
    depth = torch.arange(num_heads, dtype=torch.float)[:, None]
    rank = torch.arange(10, dtype=torch.float)[None, :]
    accuracy = 0.6 * 0.75**depth / (rank + 1) ** 1.5
    return best_choices(accuracy, num_nodes)


class MedusaProposer(Drafter):
    """Medusa: all heads read the one hidden state the root came from; the tree picks their top-k ranks."""

    holds_state = False  # nothing kept between calls: streams may interleave on one SpeculativeModel

    @property
    def drafter(self) -> torch.nn.Module:
        """The trained module this proposer drafts with (what `selfspec tune` fits a tree for)."""
        return self.heads

    def __init__(
        self, heads: MedusaHeads, lm_head: torch.nn.Module, choices: list[list[int]] | None = None
    ) -> None:
        if choices is None:
            choices = (
                heads.config.tree
                if heads.config.tree is not None
                else default_medusa_choices(heads.config.num_heads)
            )
        tree = tree_from_choices(choices)
        if tree.max_depth > heads.config.num_heads:
            raise ValueError(
                f"the tree is {tree.max_depth} deep but there are only {heads.config.num_heads} Medusa "
                "heads; use a shallower tree (--tree) or more heads"
            )
        device = next(heads.parameters()).device
        self.max_nodes = tree.size
        self.name = (
            "medusa2" if heads.config.adapter or heads.config.merged_target else "medusa"
        )  # adapted target
        self.heads = heads.eval()
        heads.stacked()  # the heads as stacked weights from now on: every head in one matmul per layer
        self.lm_head = lm_head
        self.tree = tree.to(device)
        self.node_head = (self.tree.depths[1:] - 1).clone()  # (N-1,) which head drafts each node
        self.node_rank = self.tree.ranks[1:].clone()  # (N-1,) which of its top-k
        self.top_k = int(tree.ranks[1:].max()) + 1 if len(choices) else 1  # read on the host-side tree
        vocab = heads.config.vocab_size or lm_head.weight.shape[0]
        if self.top_k > vocab:
            raise ValueError(
                f"the tree takes rank {self.top_k - 1} of a head's guesses, but the heads guess among "
                f"{vocab} tokens: use ranks below {vocab} (--tree)"
            )
        self.dtype = next(heads.parameters()).dtype
        self.device = self.weights_device = device  # the heads' (by the lm_head); hidden states move here

    def start(
        self, rows: int, max_length: int, params: SamplingParams, generators: list[torch.Generator | None]
    ) -> None:
        pass  # stateless: every step reads only the newest hidden state

    @torch.no_grad()
    def propose(
        self, active: list[bool], contexts: list[torch.Tensor], hiddens: list[torch.Tensor]
    ) -> list[Draft | None]:
        """Every row's tree in one heads call; rows not `active` get None."""
        if not any(active):
            return [None] * len(contexts)
        if len(contexts) == 1:  # views, no copies
            last, roots = hiddens[0][-1:], contexts[0][-1:]
        else:
            last = torch.stack([h[-1] if on else h.new_zeros(h.shape[-1]) for h, on in zip(hiddens, active)])
            roots = torch.stack([c[-1] for c in contexts])
        rows = self.propose_batch(roots, last)
        return [Draft(row, self.tree) if on else None for row, on in zip(rows, active)]

    @torch.no_grad()
    def propose_batch(self, roots: torch.Tensor, hiddens: torch.Tensor) -> torch.Tensor:
        """Every row's tree tokens at once (Medusa reads nothing but the newest hidden state): roots (B,) and
        the hidden states that produced them (B, H) -> tokens (B, N) of `self.tree`, root first."""
        if self.max_nodes == 1:  # a fitted tree of the root alone (no draft paid off): the heads need not run
            return roots[:, None]
        logits = self.heads.draft_logits(hiddens.to(self.device, self.dtype), self.lm_head)  # (K, B, V)
        top = logits.topk(self.top_k, dim=-1).indices  # (K, B, k)
        return torch.cat([roots[:, None], top[self.node_head, :, self.node_rank].T], dim=1)


def medusa_proposer(
    heads: MedusaHeads,
    model: torch.nn.Module,
    tree: list[list[int]] | None = None,
    dynamic: bool = False,
    **tree_options: int | None,
) -> MedusaProposer:
    """The Medusa family's proposer (heads/families/medusa.py): a static tree, `tree` or the heads' own."""
    if dynamic or any(v is not None for v in tree_options.values()):
        raise ValueError(
            f"{', '.join(TREE_OPTIONS)} shape EAGLE's and DFlash's trees; medusa heads take `tree`"
        )
    return MedusaProposer(heads, model.get_output_embeddings(), tree)


class NoDraft(Drafter):
    """Drafts nothing: every row verifies its root alone, so the loop becomes plain one-token decoding."""

    name = "plain"
    holds_state = False
    max_nodes = 1

    def start(
        self, rows: int, max_length: int, params: SamplingParams, generators: list[torch.Generator | None]
    ) -> None:
        pass

    def propose(
        self, active: list[bool], contexts: list[torch.Tensor], hiddens: list[torch.Tensor]
    ) -> list[Draft | None]:
        return [None] * len(contexts)
