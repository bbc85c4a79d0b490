"""Medusa heads: K small residual MLPs on the target's last hidden state, each with a vocab projection.

Head k (0-based) reads the hidden state at position t and predicts the token at t + 2 + k: the
target's own lm_head already predicts t + 1.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from selfspec.heads.config import HeadsConfig
from selfspec.heads.io import PretrainedHeads
from selfspec.heads.joined import rehome
from selfspec.heads.projection import apply_head


class ResBlock(nn.Module):
    """x + SiLU(W x + b), with W zero-initialised so a fresh block only adds the constant SiLU(b)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


def _head(config: HeadsConfig) -> nn.Sequential:
    # A fresh block per layer: `[ResBlock(h)] * n` would share one module's weights.
    layers: list[nn.Module] = [ResBlock(config.hidden_size) for _ in range(config.num_layers)]
    if not config.share_lm_head:
        layers.append(nn.Linear(config.hidden_size, config.vocab_size, bias=False))
    return nn.Sequential(*layers)


@dataclasses.dataclass
class StackedHeads:
    """The K heads' weights stacked along a first dimension of K, so that drafting runs every head at once:
    per residual layer (weights (K, H, H), biases (K, 1, H)), and the own projections (K, V, H) or None."""

    blocks: list[tuple[torch.Tensor, torch.Tensor]]
    projection: torch.Tensor | None
    pointers: list[
        int
    ]  # the parameters' data pointers when stacked: a moved or cast module no longer matches


class MedusaHeads(PretrainedHeads):
    """K heads; parameter names `heads.{k}.{layer}.linear.*` and `heads.{k}.{num_layers}.weight`."""

    kind = "medusa"  # the family (heads/families) whose configs this class builds

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.check_kind(config)
        self.config = config
        self.heads = nn.ModuleList(_head(config) for _ in range(config.num_heads))

    def init_from_lm_head(self, lm_head: nn.Module) -> None:
        """Copy the target's lm_head into every head's projection (Medusa's initialisation)."""
        if self.config.share_lm_head:
            return
        weight = lm_head.weight
        for head in self.heads:
            head[-1].weight.data.copy_(weight.data.to(head[-1].weight.dtype))

    def forward(
        self, hidden: torch.Tensor, lm_head: nn.Module | None = None, project: bool = True
    ) -> tuple[torch.Tensor, ...]:
        """hidden (..., H) -> K logits tensors (..., V), one per head. `lm_head` is the target's, needed when
        shared. With project=False: the K heads' features before any vocabulary projection (..., H), for a
        loss that projects them a chunk of positions at a time (`project_head`).

        Training calls this (not the heads one by one) so that a DDP wrapper syncs gradients.
        """
        if hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"hidden states have size {hidden.shape[-1]} but the heads expect {self.config.hidden_size}"
            )
        if not project:
            return tuple(
                head(hidden) if self.config.share_lm_head else head[:-1](hidden) for head in self.heads
            )
        if self.config.share_lm_head:
            if lm_head is None:
                raise ValueError(
                    "these heads share the target's lm_head: pass lm_head=model.get_output_embeddings()"
                )
            # One lm_head call for all heads: the projection is read from memory once, not K times.
            return tuple(apply_head(lm_head, torch.stack([head(hidden) for head in self.heads])).unbind(0))
        return tuple(apply_head(head[-1], head[:-1](hidden)) for head in self.heads)

    def stacked(self) -> StackedHeads:
        """The heads' weights stacked (`StackedHeads`) for drafting: the parameters are re-homed as views of
        the stacked tensors (same names, values and objects), once; a later move or cast stacks them again."""
        parameters = list(self.parameters())
        pointers = [p.data_ptr() for p in parameters]
        if self._stacked is None or self._stacked.pointers != pointers:
            self._stacked = self._stack_parameters()
        return self._stacked

    _stacked: StackedHeads | None = None

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        """A move or cast drops the stacked tensors with the old storage (else `.cpu()` or `.half()` would
        keep them alive until the next draft)."""
        self._stacked = None
        return super()._apply(fn, recurse)

    def _stack_parameters(self) -> StackedHeads:
        # outside inference mode: parameters that became inference tensors could not be trained again
        with torch.inference_mode(False), torch.no_grad():
            layers = self.config.num_layers
            blocks = []
            for i in range(layers):
                weight = rehome([head[i].linear.weight for head in self.heads], stack=True)
                bias = rehome([head[i].linear.bias for head in self.heads], stack=True)
                blocks.append((weight, bias[:, None, :]))
            projection = (
                None
                if self.config.share_lm_head
                else rehome([head[layers].weight for head in self.heads], stack=True)
            )
            return StackedHeads(blocks, projection, [p.data_ptr() for p in self.parameters()])

    @torch.no_grad()
    def draft_logits(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """hidden (B, H) -> every head's logits (K, B, V) in a few launches whatever K is: one batched matmul
        per residual layer and one for the K projections (what `forward` computes, K heads at a time)."""
        stacked = self.stacked()
        x = hidden.expand(len(self.heads), *hidden.shape)  # (K, B, H)
        for weight, bias in stacked.blocks:
            x = x + nn.functional.silu(torch.baddbmm(bias, x, weight.transpose(1, 2)))
        if stacked.projection is None:
            if lm_head is None:
                raise ValueError(
                    "these heads share the target's lm_head: pass lm_head=model.get_output_embeddings()"
                )
            return apply_head(lm_head, x)
        # (K, V, H) @ (K, H, B): the vocabulary on the long side, as `vocab_logits` lays out one head's
        return torch.bmm(stacked.projection, x.transpose(1, 2)).transpose(1, 2)

    def project_head(self, k: int, features: torch.Tensor) -> torch.Tensor:
        """Head k's own vocabulary projection of its features (..., H) -> logits (..., V)."""
        if self.config.share_lm_head:
            raise ValueError("these heads share the target's lm_head: project their features with it")
        return self.heads[k][-1](features)
