"""Acceptance over a verified tree: greedy matching and lossless tree rejection sampling.

Variable names follow the speculative-sampling papers: p is the target's distribution, q the
draft's. Children picked deterministically (by rank) are point proposals: child x of a node is
accepted with probability p(x); on rejection p(x) is zeroed and p renormalised before the next
sibling is tried. Children sampled from a draft distribution q (a draft model's chain) are
accepted with probability min(1, p(x) / q(x)); on rejection p becomes the normalised residual
(p - q)+. Either way, if every child is rejected the bonus token is drawn from what is left of p.
Everything is batched over nodes: no per-candidate host sync.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from selfspec.infer.core.tree import Tree, stack_trees

MIN_TEMPERATURE = 1e-6  # far above where float32 logits / temperature overflow; below it, use 0 (greedy)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean no truncation."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        # NaN, infinity or a temperature so small that logits / temperature overflows float32 would turn p
        # into NaN, and every draw into token 0
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, "
                f"got {self.temperature}"
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: no top-k), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: no nucleus), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (..., V) -> the distribution p that plain sampling would draw from, (..., V) float32."""
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(outside_nucleus(logits.softmax(-1), params.top_p), float("-inf"))
    return logits.softmax(-1)


NUCLEUS_FIRST_K = 64  # candidates the nucleus is first looked for among; 4x more each time it does not fit
GROWS_ON = (
    "cpu",
)  # devices where the search may read back whether it is done (free there; a sync elsewhere)


def outside_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(..., V) bool: the tokens outside the smallest most-probable set whose mass reaches top_p.

    On CPU sorting the whole vocabulary is not needed: the nucleus is found among the top k tokens
    (k = 64, grown 4x until every row's top k reach top_p), which are a full sort's first k with the same
    running sums. Whether they reach it is a value read back, which on an accelerator waits for the device:
    there the whole vocabulary is sorted instead (on the device, no read). Tokens tied at the boundary are cut
    by position in that order, as a sort would (not all kept)."""
    vocab = probs.shape[-1]
    if probs.device.type not in GROWS_ON:
        top = probs.sort(dim=-1, descending=True)
        k, cum = vocab, top.values.cumsum(-1)
    else:
        k = min(NUCLEUS_FIRST_K, vocab)
        while True:
            top = probs.topk(k, dim=-1)  # sorted, descending
            cum = top.values.cumsum(-1)
            if k == vocab or bool((cum[..., -1] >= top_p).all()):
                break
            k = min(4 * k, vocab)
    kept = ((cum - top.values) < top_p).sum(-1, keepdim=True)  # tokens before which the mass is below top_p
    inside = torch.arange(k, device=probs.device) < kept  # (..., k): the first `kept` of the sorted top k
    return ~torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, top.indices, inside)


def greedy_children(argmax: torch.Tensor, tokens: torch.Tensor, tree: Tree) -> torch.Tensor:
    """(..., N) bool, one tree or a batch of them (leading dims on every argument): node i is its parent's
    pick, i.e. its token is the target's argmax at the parent (`argmax`: the logits' at every node, (..., N)).
    Nodes without a parent (the root; padding, see tree.pad_tree) compare against the root's argmax, a
    meaningless value `accepted_end` never counts."""
    return tokens == argmax.gather(-1, tree.parents.clamp(min=0))


def sampled_children(p: torch.Tensor, tokens: torch.Tensor, trees: Tree, u: torch.Tensor) -> torch.Tensor:
    """(B, N) bool: the child each node's rejection walk over its children accepts (at most one per node), for
    p (B, N, V), tokens (B, N), batched trees and uniforms u (B, N, C) (one per child)."""
    kids = trees.children  # (B, N, C)
    valid = kids >= 0
    kid_tokens = tokens.gather(1, kids.clamp(min=0).flatten(1)).view_as(kids)
    p_kid = p.gather(2, kid_tokens) * valid  # (B, N, C) p(x_j) at the parent
    used = torch.cumsum(p_kid, dim=2) - p_kid  # mass of the siblings tried before x_j
    accept_prob = p_kid / (1.0 - used).clamp(min=1e-12)
    accepted = (u < accept_prob) & valid
    has = accepted.any(dim=2)  # the first accepted sibling, if any; the root if none
    chosen = torch.where(has, kids.gather(2, accepted.int().argmax(dim=2, keepdim=True))[..., 0], 0)
    picked = torch.zeros(tokens.shape, dtype=torch.bool, device=p.device).scatter(1, chosen, has)
    picked[:, 0] = True
    return picked


def sampled_children_from(
    p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, tree: Tree, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Children drawn from q: `q[i]` is the distribution node i's token was sampled from. Returns the
    picked mask (N,) and, per node, what is left of p after its rejected children (N, V)."""
    kids = tree.children  # (N, C)
    valid = kids >= 0
    u = torch.rand(kids.shape, generator=generator, device=p.device)
    left = p
    done = torch.zeros(kids.shape[0], dtype=torch.bool, device=p.device)
    chosen = torch.zeros(kids.shape[0], dtype=torch.long, device=p.device)
    for c in range(kids.shape[1]):  # siblings in order; a chain has one
        kid = kids[:, c].clamp(min=0)
        x, q_kid = tokens[kid][:, None], q[kid]  # (N, 1), (N, V)
        trying = valid[:, c] & ~done
        ok = trying & (u[:, c] * q_kid.gather(1, x)[:, 0] < left.gather(1, x)[:, 0])  # P = min(1, p(x)/q(x))
        chosen = torch.where(ok, kids[:, c], chosen)
        done |= ok
        residual = (left - q_kid).clamp(min=0)
        total = residual.sum(-1, keepdim=True)
        residual = torch.where(total > 0, residual / total.clamp(min=1e-30), left)
        left = torch.where((trying & ~ok)[:, None], residual, left)
    picked = torch.zeros(tokens.shape, dtype=torch.bool, device=p.device).scatter(0, chosen, done)
    picked[0] = True
    return picked, left


def accepted_end(picked: torch.Tensor, tree: Tree) -> torch.Tensor:
    """The deepest node whose whole root path was picked, as a (..., 1) tensor (index_select-ready, no sync);
    ties go to the first node (the root, when nothing deeper was picked). The root's entry of `picked` is not
    read: a node's path is picked when its picked non-root ancestors (itself included) are as many as its
    depth, which a padding node (depth 0, seeing itself) never is."""
    hits = (tree.ancestors[..., 1:] & picked[..., None, 1:]).sum(-1)  # (..., N)
    return torch.where(hits == tree.depths, tree.depths, -1).argmax(-1, keepdim=True)


def draw(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample from p (V,) as a 0-dim tensor: argmax of p / E with E ~ Exp(1), exact and without a host
    sync."""
    e = torch.empty_like(p).exponential_(1.0, generator=generator)
    return (p / e).argmax()


def accept(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tree: Tree,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify one tree: logits (N, V) at every node, tokens (N,) -> end node (1,) and bonus token (0-dim).

    `draft_probs` (N, V): the distribution each node's token was sampled from; None when the tokens
    were picked deterministically (point proposals).
    """
    if params.greedy:
        argmax = logits.argmax(-1)  # the bonus is the argmax at the end node: computed once
        end = accepted_end(greedy_children(argmax, tokens, tree), tree)
        return end, argmax.index_select(0, end)[0]
    if draft_probs is not None:
        picked, left = sampled_children_from(
            target_probs(logits, params), draft_probs, tokens, tree, generator
        )
        end = accepted_end(picked, tree)
        return end, draw(left.index_select(0, end)[0], generator)
    end, bonus = accept_sampled_rows(  # a batch of one
        logits[None], tokens[None], stack_trees([tree]), params, [generator], [tree.children.shape]
    )
    return end, bonus[0]


def accept_greedy_rows(
    logits: torch.Tensor, tokens: torch.Tensor, trees: Tree
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance over a batch of trees: logits (B, N, V), tokens (B, N), batched trees (B, ...)
    -> each row's end node (B,) and bonus token (B,)."""
    argmax = logits.argmax(-1)  # (B, N); the bonus is the argmax at the end node
    end = accepted_end(greedy_children(argmax, tokens, trees), trees)  # (B, 1)
    return end[:, 0], argmax.gather(1, end)[:, 0]


def accept_sampled_rows(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    trees: Tree,
    params: SamplingParams,
    generators: list[torch.Generator | None],
    shapes: list[tuple[int, int] | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled acceptance of point proposals over a batch of trees, in one set of launches: logits (B, N, V),
    tokens (B, N), batched trees (B, ...) -> each row's end node (B,) and bonus token (B,), as `accept` gives
    each row alone.

    `shapes[b]`: row b's own tree (nodes, children per node), None for a row that is done (it draws nothing,
    and what it gets is not used, as with greedy acceptance). A row with a generator draws from it exactly
    what it would alone (the same shapes, in the same order), so a seeded row's outcome does not depend on
    its batch; rows without one draw from the global generator, all together where none has one."""
    B, N, V = logits.shape
    p = target_probs(logits, params)  # (B, N, V)
    kids = trees.children  # (B, N, C)
    u = _uniforms(generators, shapes, kids.shape, p.device)
    end = accepted_end(sampled_children(p, tokens, trees, u), trees)  # (B, 1)
    # the bonus: p at the end node without its children's tokens (all rejected, since none was picked)
    p_end = p.gather(1, end[..., None].expand(B, 1, V))[:, 0]  # (B, V)
    end_kids = kids.gather(1, end[..., None].expand(B, 1, kids.shape[2]))[:, 0]  # (B, C)
    rejected = tokens.gather(1, end_kids.clamp(min=0))
    keep = torch.ones_like(p_end).scatter_reduce(1, rejected, (end_kids < 0).to(p_end.dtype), reduce="amin")
    residual = p_end * keep
    total = residual.sum(-1, keepdim=True)
    # all of p on rejected children has probability zero of happening; fall back to p itself
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_end)
    e = _exponentials(generators, [s is not None for s in shapes], residual)
    return end[:, 0], (residual / e).argmax(-1)  # the bonus drawn as `draw` does


def _uniforms(
    generators: list[torch.Generator | None],
    shapes: list[tuple[int, ...] | None],
    size: tuple[int, ...],
    device: torch.device,
) -> torch.Tensor:
    """Uniforms of `size` (B, N, C): row b's corner shapes[b] from its own generator (what it draws alone), or
    all from the global generator in one draw when no row has one; 1 elsewhere (never below a probability)."""
    if all(g is None for g in generators):
        return torch.rand(size, device=device)
    out = torch.ones(size, device=device)
    for b, (generator, shape) in enumerate(zip(generators, shapes)):
        if shape is not None:
            out[(b, *(slice(n) for n in shape))] = torch.rand(shape, generator=generator, device=device)
    return out


def _exponentials(
    generators: list[torch.Generator | None], drawing: list[bool], like: torch.Tensor
) -> torch.Tensor:
    """Exp(1) draws like `like` (B, V) for the rows `drawing`, each from its own generator, or all from the
    global one in one draw when no row has one; 1 elsewhere."""
    if all(g is None for g in generators):
        return torch.empty_like(like).exponential_(1.0)
    out = torch.ones_like(like)
    for b, (generator, on) in enumerate(zip(generators, drawing)):
        if on:
            out[b] = torch.empty_like(like[b]).exponential_(1.0, generator=generator)
    return out


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token from a single position's logits (V,), as plain decoding would choose it."""
    if params.greedy:
        return logits.argmax()
    return draw(target_probs(logits, params), generator)
