"""Draft trees as one frozen value: parents, depths, ancestor mask, children and root-to-node paths.

Node 0 is the root: the token the target already chose (not yet in the KV cache). Nodes are in
breadth-first order, so a parent always comes before its children. A static Medusa tree is given
as "choices": one path of per-depth top-k ranks per node, e.g. [[0], [1], [0, 0]] is

    root ── r0 ── r0
        └── r1
"""

from __future__ import annotations

import dataclasses
import heapq
import statistics
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Tree:
    parents: torch.Tensor  # (N,) parent node index; -1 for the root
    depths: torch.Tensor  # (N,) 0 for the root
    ranks: torch.Tensor  # (N,) rank of the node's token among its depth's draft candidates
    ancestors: torch.Tensor  # (N, N) bool: [i, j] is True when j is i or an ancestor of i
    children: torch.Tensor  # (N, C) child node indices in sibling order (best first), -1 padded
    paths: torch.Tensor  # (N, D+1) root-to-node node indices, padded with the node itself

    @property
    def size(self) -> int:
        return self.parents.shape[0]

    @property
    def max_depth(self) -> int:
        return self.paths.shape[1] - 1

    def row(self, b: int) -> Tree:
        """Row b of a Tree of batched (B, ...) fields, as views (which remember it: `stack_trees` of rows
        0 .. B - 1 in order gives the batched Tree back without a copy)."""
        row = Tree(**{f.name: getattr(self, f.name)[b] for f in dataclasses.fields(self)})
        object.__setattr__(row, "batched", (self, b))
        return row

    def to(self, device: torch.device | str) -> Tree:
        return Tree(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})


def tree_from_parents(parents: list[int], ranks: list[int]) -> Tree:
    """Build a Tree from parent indices (breadth-first order, root first with parent -1)."""
    n = len(parents)
    if n == 0 or parents[0] != -1:
        raise ValueError("a tree starts with its root, whose parent is -1")
    if len(ranks) != n:
        raise ValueError(f"a tree needs one rank per node: {n} parents but {len(ranks)} ranks")
    depths = [0] * n
    for i in range(1, n):
        if not 0 <= parents[i] < i:
            raise ValueError(f"node {i} has parent {parents[i]}: parents must come before their children")
        depths[i] = depths[parents[i]] + 1
    if any(depths[i] < depths[i - 1] for i in range(1, n)):
        raise ValueError("tree nodes must be in breadth-first order (non-decreasing depth)")
    width = max([parents.count(i) for i in range(n)] + [1])
    return build_tree(torch.tensor(parents), torch.tensor(ranks), max(depths), width)


def pad_tree(tree: Tree, size: int, width: int, depth: int) -> Tree:
    """`tree` grown to `size` nodes, `width` children columns and paths `depth` deep, for stacking with other
    rows' trees. The extra nodes are padding: no parent (-1) and depth 0, seeing only themselves, nobody's
    children, so no acceptance rule ever picks them."""
    n, device = tree.size, tree.parents.device
    extra = size - n
    if extra == 0 and tree.children.shape[1] == width and tree.max_depth == depth:
        return tree
    idx = torch.arange(size, device=device)
    ancestors = torch.zeros(size, size, dtype=torch.bool, device=device)
    ancestors[:n, :n] = tree.ancestors
    ancestors[n:, n:] = torch.eye(extra, dtype=torch.bool, device=device)
    children = torch.full((size, width), -1, dtype=torch.long, device=device)
    children[:n, : tree.children.shape[1]] = tree.children
    paths = idx[:, None].expand(size, depth + 1).clone()
    paths[:n, : tree.max_depth + 1] = tree.paths
    paths[:n, tree.max_depth + 1 :] = tree.paths[:, -1:]
    fill = torch.full((extra,), -1, dtype=torch.long, device=device)
    return Tree(
        parents=torch.cat([tree.parents, fill]),
        depths=torch.cat([tree.depths, fill.new_zeros(extra)]),
        ranks=torch.cat([tree.ranks, fill.new_zeros(extra)]),
        ancestors=ancestors,
        children=children,
        paths=paths,
    )


def stack_trees(trees: Sequence[Tree], size: int = 0) -> Tree:
    """One Tree of batched fields (B, ...) from each row's tree, the smaller ones padded (`pad_tree`) to the
    largest, or to `size` nodes when that is more; the same tree for every row is expanded, not copied."""
    first = trees[0]
    whole = getattr(first, "batched", (None, 0))[0]
    rows = [getattr(t, "batched", (None, -1)) for t in trees]
    in_order = whole is not None and len(trees) == whole.parents.shape[0]
    if in_order and all(w is whole and i == b for b, (w, i) in enumerate(rows)) and first.size >= size:
        return whole  # every row of one batched Tree, in order (a drafter's rows): no copy
    if all(t is first for t in trees) and first.size >= size:
        return Tree(
            **{
                f.name: getattr(first, f.name).expand(len(trees), *getattr(first, f.name).shape)
                for f in dataclasses.fields(first)
            }
        )
    size = max(size, *(t.size for t in trees))
    width = max(t.children.shape[1] for t in trees)
    depth = max(t.max_depth for t in trees)
    padded = [pad_tree(t, size, width, depth) for t in trees]
    return Tree(
        **{f.name: torch.stack([getattr(t, f.name) for t in padded]) for f in dataclasses.fields(first)}
    )


def build_tree(parents: torch.Tensor, ranks: torch.Tensor, max_depth: int, width: int) -> Tree:
    """Tree fields from valid parent vectors, with tensor ops only (no host sync), so a drafter can build its
    trees on the device every step: parents and ranks (N,) give one Tree, (B, N) a Tree of (B, ...) fields in
    the same launches. `max_depth` bounds the depth (paths are that wide) and `width` the children per node;
    siblings are ordered by rank, ties by index."""
    if parents.dim() == 1:
        tree = build_tree(parents[None], ranks[None], max_depth, width)
        return tree.row(0)
    B, n = parents.shape
    idx = torch.arange(n, device=parents.device)
    # above the root is node n, its own parent: each level up is one gather (-1 mod n + 1 is n)
    above = parents.remainder(n + 1)  # (B, N)
    up_of = nn.functional.pad(above, (0, 1), value=n)  # (B, N + 1)
    chain = [idx.expand(B, n)]  # chain[j][b, i]: the j-th ancestor of node i (0: itself), n above the root
    for _ in range(max_depth):
        chain.append(up_of.gather(1, chain[-1]))
    chain_t = torch.stack(chain, dim=2)  # (B, N, D+1)
    depths = (chain_t[..., 1:] < n).sum(2)
    ancestors = (chain_t[..., None] == idx).any(2)  # one_hot would check its range: a host sync
    back = depths[..., None] - torch.arange(max_depth + 1, device=parents.device)  # depth t is chain[d - t]
    paths = torch.where(back >= 0, chain_t.gather(2, back.clamp(min=0)), idx[:, None])
    before = (ranks[:, None, :] < ranks[..., None]) | (
        (ranks[:, None, :] == ranks[..., None]) & (idx < idx[:, None])
    )
    slot = ((parents[:, None, :] == parents[..., None]) & before).sum(2)  # (B, N) place among its siblings
    target = above * width + slot  # the root (the one node above which is n) goes to the extra slot n·width
    children = parents.new_full((B, n * width + 1), -1).scatter(1, target, idx.expand(B, n))[:, :-1]
    return Tree(
        parents=parents,
        depths=depths,
        ranks=ranks,
        ancestors=ancestors,
        children=children.view(B, n, width),
        paths=paths,
    )


def select_tree(
    scores: torch.Tensor,
    parents: torch.Tensor,
    ranks: torch.Tensor,
    total_tokens: int,
    max_depth: int,
    width: int,
) -> tuple[torch.Tensor, Tree]:
    """EAGLE-2's dynamic tree from drafted candidates: keep the `total_tokens` with the best cumulative
    draft log-probability and return their candidate indices (ascending) and the Tree they form under the
    root.

    Candidates are in depth order; `parents[c]` is the candidate c extends (-1: the root) and
    `ranks[c]` its rank among its siblings. Scores must fall strictly along every path (see
    `descend`), so any top-n set contains its ancestors: the result is always a tree. Inputs (C,) give one
    row's; (B, C) every row's at once (chosen (B, n), a Tree of (B, ...) fields), in launches that do not
    grow with B.
    """
    if scores.dim() == 1:
        chosen, tree = select_tree(scores[None], parents[None], ranks[None], total_tokens, max_depth, width)
        return chosen[0], tree.row(0)
    chosen = scores.topk(min(total_tokens, scores.shape[1])).indices.sort().values  # depth order kept
    up = parents.gather(1, chosen)
    # a chosen candidate's parent is chosen too: its tree index is its place in `chosen`, plus the root
    tree_parents = torch.where(up >= 0, torch.searchsorted(chosen, up.clamp(min=0)) + 1, 0)
    tree = build_tree(  # the root in front: parent -1, rank 0
        nn.functional.pad(tree_parents, (1, 0), value=-1),
        nn.functional.pad(ranks.gather(1, chosen), (1, 0), value=0),
        max_depth,
        width,
    )
    return chosen, tree


def row_trees(
    roots: torch.Tensor, drafted: torch.Tensor, chosen: torch.Tensor, tree: Tree
) -> list[tuple[torch.Tensor, Tree]]:
    """Each row's tree tokens (root first) and Tree from `select_tree` over rows: roots (B,), drafted
    candidates (B, C), chosen (B, n); one gather for all rows, then views."""
    tokens = torch.cat([roots[:, None], drafted.gather(1, chosen)], dim=1)
    return [(tokens[b], tree.row(b)) for b in range(tokens.shape[0])]


def descend(
    parent_scores: torch.Tensor, logprobs: torch.Tensor, neg_inf: torch.Tensor | None = None
) -> torch.Tensor:
    """Children's cumulative scores: parent (...,) + log-prob (..., k), forced strictly below the parent even
    where the log-prob rounds to 0, so that top-n selection stays ancestor-closed. `neg_inf`: a 0-dim -inf
    on the device, made once by a caller that descends every step (one launch fewer)."""
    if neg_inf is None:
        neg_inf = torch.full_like(parent_scores, -torch.inf)
    below = torch.nextafter(parent_scores, neg_inf)[..., None]
    return torch.minimum(parent_scores[..., None] + logprobs, below)


def tree_from_choices(choices: list[list[int]]) -> Tree:
    """Static tree from Medusa-style choices; every prefix of a choice must be a choice too.

    No choices at all is the root alone: plain one-token decoding.
    """
    paths = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    if any(len(p) == 0 or min(p) < 0 for p in paths):
        raise ValueError(
            "tree choices must be non-empty lists of non-negative top-k ranks, e.g. [[0], [1], [0, 0]]"
        )
    index = {(): 0}
    parents, ranks = [-1], [0]
    for p in paths:
        if p[:-1] not in index:
            raise ValueError(f"tree choice {list(p)} has no parent {list(p[:-1])}: add it to the choices")
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
    return tree_from_parents(parents, ranks)


def choices_width(choices: list[list[int]] | None) -> int:
    """The top-k a static tree takes per node: its highest rank + 1 (1 for no choices, the root alone)."""
    return max((rank for path in choices for rank in path), default=-1) + 1 if choices else 1


def chain_choices(depth: int) -> list[list[int]]:
    """A single top-1 chain of `depth` drafted tokens: [[0], [0, 0], ...]."""
    return [[0] * d for d in range(1, depth + 1)]


def label_ranks(logits: torch.Tensor, labels: torch.Tensor, width: int) -> torch.Tensor:
    """(N,) the rank of each label among its row's `width` highest logits (N, V); `width` where it is not
    among them."""
    hit = logits.topk(width, dim=-1).indices == labels[:, None]
    return torch.where(hit.any(1), hit.int().argmax(1), width)


PathFrequencies = Mapping[tuple[int, ...], float]  # rank path -> how often every node along it is accepted
Acceptance = torch.Tensor | PathFrequencies  # per-depth accuracy (D, R), or measured path frequencies


def best_choices(accuracy: Acceptance, num_nodes: int) -> list[list[int]]:
    """The `num_nodes` choices with the highest estimated acceptance probability.

    `accuracy[d, r]` estimates how often rank r of depth d's candidates is the target's token. A
    path's value is the product along it, so a child never beats its parent and the greedy pick is
    ancestor-closed; this maximises the expected number of accepted tokens for that node budget.
    From measured `path_frequencies` the paths seen are taken most frequent first (fewer than
    `num_nodes` when fewer were seen); a child is never more frequent than its parent, so the pick is
    ancestor-closed too.
    """
    if isinstance(accuracy, Mapping):
        ranked = sorted(accuracy, key=lambda path: (-accuracy[path], len(path), path))
        return [list(path) for path in ranked[:num_nodes]]
    depth, width = accuracy.shape
    acc = accuracy.tolist()
    frontier = [(-acc[0][r], (r,)) for r in range(width)]
    heapq.heapify(frontier)
    chosen: list[list[int]] = []
    while frontier and len(chosen) < num_nodes:
        neg_value, path = heapq.heappop(frontier)
        chosen.append(list(path))
        if len(path) < depth:
            for r in range(width):
                heapq.heappush(frontier, (neg_value * acc[len(path)][r], (*path, r)))
    return chosen


def fill_choices(choices: list[list[int]], accuracy: torch.Tensor, num_nodes: int) -> list[list[int]]:
    """`choices` (ancestor-closed) topped up to `num_nodes` with the best further paths by the per-depth
    accuracy estimate: where measured paths ran out before a node budget asked for."""
    chosen = {tuple(path) for path in choices}
    extra = [path for path in best_choices(accuracy, num_nodes + len(choices)) if tuple(path) not in chosen]
    return (choices + extra)[: max(num_nodes, 0)]


def expected_accepted(accuracy: Acceptance, choices: list[list[int]]) -> float:
    """Expected drafted tokens accepted per step: the sum over nodes of their path's acceptance estimate."""
    if isinstance(accuracy, Mapping):
        return sum(accuracy.get(tuple(path), 0.0) for path in choices)
    total = 0.0
    for path in choices:
        value = 1.0
        for depth, rank in enumerate(path):
            value *= float(accuracy[depth, rank])
        total += value
    return total


def path_frequencies(
    ranks: torch.Tensor, width: int, counts: torch.Tensor | None = None
) -> dict[tuple[int, ...], float]:
    """How often each rank path would be accepted, measured: `ranks` (N, D) holds, at N positions, the rank of
    the target's token among depth d's candidates (`width` or more: not among the first `width`),
    `counts` (N,) how many positions each row stands for (default 1). A path is accepted where every depth
    along it ranks the target's token exactly so.

    Unlike the product of per-depth accuracies this keeps how the depths' hits go together: on repetitive text
    all heads are right at once, and the product undervalues deep chains many times over."""
    counts = torch.ones(ranks.shape[0], dtype=torch.float64) if counts is None else counts.double()
    total = float(counts.sum())
    if total <= 0:
        return {}
    freq: dict[tuple[int, ...], float] = {}
    for depth in range(1, ranks.shape[1] + 1):
        head = ranks[:, :depth]
        seen = (head < width).all(1)
        paths, index = torch.unique(head[seen], dim=0, return_inverse=True)
        sums = torch.zeros(paths.shape[0], dtype=torch.float64).index_add_(0, index, counts[seen])
        freq.update({tuple(path): float(c) / total for path, c in zip(paths.tolist(), sums.tolist())})
    return freq


LOW_QUANTILE = 0.2  # the timing kept from repeats: stalls only add time; steadier than the minimum
NOISE_LIMIT = 0.25  # a median this far above the low quantile: too disturbed to trust the fit


def low_and_spread(seconds: Sequence[float]) -> tuple[float, float]:
    """Repeated timings of one thing -> (their 20th percentile, median / that - 1).

    A busy machine only ever adds time, so a low quantile estimates the undisturbed cost; the spread
    says how disturbed the repeats were (0 on a quiet machine)."""
    ordered = sorted(seconds)
    low = ordered[int(LOW_QUANTILE * (len(ordered) - 1))]
    return low, statistics.median(ordered) / low - 1


def monotone_below(seconds: Mapping[int, float]) -> dict[int, float]:
    """The highest curve that never falls as nodes are added and stays at or below every measurement.

    Each size keeps its time unless a bigger size measured faster, then it takes that time (a running
    minimum from the big end). Noise only adds time, so a stalled size is lowered to its bigger
    neighbour and lifts nothing else; a running maximum from the small end, or least-squares isotonic
    regression, would carry one stalled size's time into the sizes above it.
    """
    out, lowest = {}, float("inf")
    for n in sorted(seconds, reverse=True):
        lowest = min(lowest, seconds[n])
        out[n] = lowest
    return dict(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class LatencyCurve(Mapping[int, float]):
    """Target forward seconds against tree nodes, from repeated timings; reads as {nodes: seconds} of the
    fitted curve (what fit_tree uses), which never falls as nodes are added."""

    measured: dict[int, float]  # 20th percentile of each size's timings
    spread: dict[int, float]  # median / 20th percentile - 1 per size
    fitted: dict[int, float]  # monotone_below(measured)

    @classmethod
    def from_samples(cls, samples: Mapping[int, Sequence[float]]) -> LatencyCurve:
        stats = {n: low_and_spread(s) for n, s in sorted(samples.items())}
        measured = {n: low for n, (low, _) in stats.items()}
        return cls(measured, {n: spread for n, (_, spread) in stats.items()}, monotone_below(measured))

    def __getitem__(self, n: int) -> float:
        return self.fitted[n]

    def __iter__(self) -> Iterator[int]:
        return iter(self.fitted)

    def __len__(self) -> int:
        return len(self.fitted)


def fit_tree(accuracy: Acceptance, latency: Mapping[int, float]) -> tuple[list[list[int]], list[dict]]:
    """Choose the tree size that maximises expected tokens per second.

    `accuracy` is a per-depth accuracy table or measured `path_frequencies`. `latency[n]` is the target's
    forward time with n tree nodes (root included); a step with n nodes yields 1 + expected_accepted tokens.
    Returns the best choices and a row per size (for printing); from a LatencyCurve a row also holds the
    size's measured time before the monotone fit and its spread (see `low_and_spread`), a plain mapping counts
    as measured exactly.
    """
    curve = latency if isinstance(latency, LatencyCurve) else None
    rows = []
    for n in sorted(latency):
        choices = best_choices(accuracy, n - 1) if n > 1 else []
        if rows and len(choices) < n - 1:  # measured paths run out: bigger trees would only repeat this one
            break
        tokens = 1.0 + expected_accepted(accuracy, choices)
        rows.append(
            {
                "nodes": n,
                "ms": 1e3 * latency[n],
                "tokens_per_step": tokens,
                "tokens_per_s": tokens / latency[n],
                "choices": choices,
                "measured_ms": 1e3 * (curve.measured[n] if curve else latency[n]),
                "spread": curve.spread[n] if curve else 0.0,
            }
        )
    best = max(rows, key=lambda r: r["tokens_per_s"])
    return best["choices"], rows
