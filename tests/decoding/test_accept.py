"""`accept` on synthetic trees, no model: the emitted tokens must follow the target exactly.

The synthetic target is a table of next-token logits for every prefix of at most D tokens over a
V-token vocabulary (the root is the empty prefix); prefix ids are heap-ordered, so the prefix
s + [x] of prefix id i has id V * i + 1 + x:

    0 ── 1 (x=0) ── 7 (x=0, 0)
     ├── 2 (x=1)  └ ...
     └── ...

One call of `accept` emits the accepted path's drafted tokens and a bonus token: 1 to D + 1 tokens.
Plain decoding would continue from there with the target, so every emitted sequence is extended to
exactly D + 1 tokens by sampling the target's own table. The rule is lossless iff those sequences
are distributed as p(x1) p(x2 | x1) ... p(x_{D+1} | x1..x_D), which is known exactly; a chi-square
test against it sees every accepted node, the bonus drawn at every depth (even after a leaf), and
which node the bonus came from. Mutants of `infer.verify` (a residual from the wrong node, no
renormalisation after a rejected sibling) must fail the same test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import textwrap

import pytest
import torch

import selfspec.infer.core.verify as verify
from selfspec.infer.core.tree import Tree, best_choices, chain_choices, tree_from_choices, tree_from_parents
from selfspec.infer.core.verify import SamplingParams

V = 6
Z = 4.753  # standard normal quantile at 1 - 1e-6: a correct rule fails a check once in a million seeds

# Point proposals: trees from the project's builders, depths 2 to 4, several siblings below depth 1.
MEDUSA = [
    [0],
    [1],
    [2],
    [0, 0],
    [0, 1],
    [0, 2],
    [1, 0],
    [1, 1],
    [2, 0],
    [0, 0, 0],
    [0, 0, 1],
    [0, 1, 0],
    [1, 0, 0],
    [0, 0, 0, 0],
    [0, 0, 0, 1],
    [0, 0, 1, 0],
]
WIDE = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0]]
PROFILE = best_choices(torch.tensor([[0.7, 0.2, 0.08], [0.6, 0.2, 0.1], [0.5, 0.2, 0.1]]), 12)
# Sampled proposals: a draft model's chain, and a tree whose siblings are independent draws from q.
SIBLINGS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]


# ---- the synthetic target ----------------------------------------------------------------------


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Plain sampling's distribution per row (..., V), in float64, written independently of infer.verify."""
    probs = torch.softmax(logits.double() / params.temperature, -1)
    sorted_probs, order = probs.sort(-1, descending=True)
    rank = torch.arange(probs.shape[-1])
    keep = rank < params.top_k if params.top_k else torch.ones_like(rank, dtype=torch.bool)
    kept = sorted_probs * keep
    kept = kept / kept.sum(-1, keepdim=True)
    keep = keep & (kept.cumsum(-1) - kept < params.top_p)  # the nucleus: tokens until the mass reaches top_p
    out = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    return out / out.sum(-1, keepdim=True)


class Synthetic:
    """Target logits for every prefix of at most `depth` tokens, and a draft's logits for sampled
    proposals."""

    def __init__(
        self, depth: int, seed: int, scale: float = 1.5, sharpness: float = 2.0, noise: float = 0.5
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.depth = depth
        self.size = (V ** (depth + 1) - 1) // (V - 1)  # prefixes of length 0..depth
        self.logits = torch.randn(self.size, V, generator=g) * scale  # (P, V)
        # an overconfident draft, as small drafters are: (p - q)+ is large where q sharpens p
        self.draft_logits = sharpness * self.logits + noise * torch.randn(self.size, V, generator=g)  # (P, V)

    def joint(self, params: SamplingParams) -> torch.Tensor:
        """(V ** (depth + 1),) exact probability of each (depth + 1)-token sequence, in heap order."""
        p = reference_probs(self.logits, params)  # (P, V)
        joint = torch.ones(1, dtype=torch.float64)
        start = 0
        for _ in range(self.depth + 1):  # the prefixes of one length are contiguous, children in order
            joint = (joint[:, None] * p[start : start + joint.shape[0]]).reshape(-1)
            start = V * start + 1
        return joint


def child_ids(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return V * ids + 1 + x


# ---- drafting, accepting and reading off the emitted tokens ----------------------------------------


def draft_point(model: Synthetic, tree: Tree, trials: int, g: torch.Generator, noise: float = 1.0):
    """Point proposals, one tree per trial: node of rank r holds the r-th best token of a noisy copy of
    the target at its parent (distinct siblings, often the target's favourites, so deep nodes are
    reached). Drawn independently of the acceptance randomness, so mixing trees keeps the check exact."""
    n = tree.size
    ids = torch.zeros(trials, n, dtype=torch.long)  # (B, N) prefix id of every node's path
    tokens = torch.zeros(trials, n, dtype=torch.long)  # (B, N); the root's token is never read
    gumbel = -torch.log(-torch.log(torch.rand(trials, n, V, generator=g)))
    ranked = {}  # parent -> (B, V) its candidates, best first
    for i in range(1, n):  # breadth-first: the parent is done
        parent, rank = int(tree.parents[i]), int(tree.ranks[i])
        if parent not in ranked:
            scores = model.logits[ids[:, parent]] + noise * gumbel[:, parent]  # (B, V)
            ranked[parent] = scores.argsort(-1, descending=True)
        tokens[:, i] = ranked[parent][:, rank]
        ids[:, i] = child_ids(ids[:, parent], tokens[:, i])
    return tokens, model.logits[ids], None  # (B, N), (B, N, V)


def draft_sampled(model: Synthetic, tree: Tree, trials: int, g: torch.Generator, params: SamplingParams):
    """Sampled proposals: every node's token drawn from the draft's warped q at its parent; siblings are
    independent draws (repeats allowed). Returns tokens, target logits and q per node (row 0 unused)."""
    q_table = reference_probs(model.draft_logits, params).float()  # (P, V)
    n = tree.size
    ids = torch.zeros(trials, n, dtype=torch.long)
    tokens = torch.zeros(trials, n, dtype=torch.long)
    q = torch.zeros(trials, n, V)  # (B, N, V)
    for i in range(1, n):
        parent = int(tree.parents[i])
        q[:, i] = q_table[ids[:, parent]]
        tokens[:, i] = torch.multinomial(q[:, i], 1, generator=g)[:, 0]
        ids[:, i] = child_ids(ids[:, parent], tokens[:, i])
    return tokens, model.logits[ids], q


def run_accept(tree: Tree, params: SamplingParams, tokens, logits, q, seed: int):
    """`verify.accept` (looked up now, so a monkeypatched mutant is what runs) once per trial ->
    end nodes (B,), bonus tokens (B,). Point proposals are vmapped with the global RNG (seeded and
    restored); sampled ones loop with a seeded generator, since `done |= ok` in
    `sampled_children_from` is an in-place write that vmap refuses."""
    accept = verify.accept
    if q is None:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            end, bonus = torch.func.vmap(
                lambda lg, tk: tuple(accept(lg, tk, tree, params)), randomness="different"
            )(logits, tokens)
        return end[:, 0], bonus
    g = torch.Generator().manual_seed(seed)
    out = [accept(logits[b], tokens[b], tree, params, g, q[b]) for b in range(tokens.shape[0])]
    return torch.cat([e for e, _ in out]), torch.stack([b for _, b in out])


def emitted_then_continued(
    model: Synthetic, params: SamplingParams, tree: Tree, tokens, end, bonus, seed: int
):
    """Heap ids (B,) of the first depth + 1 tokens: accepted drafted tokens, the bonus, then the target's
    own continuation sampled from the exact table (depth + 1 - emitted tokens of it)."""
    p = reference_probs(model.logits, params)  # (P, V)
    g = torch.Generator().manual_seed(seed)
    depth = tree.depths[end]  # (B,) drafted tokens accepted
    path_tokens = tokens.gather(1, tree.paths[end])  # (B, D_tree + 1), position k = the k-th accepted token
    ids = torch.zeros_like(end)
    for k in range(1, model.depth + 2):
        drafted = path_tokens[:, min(k, tree.max_depth)]
        continued = torch.multinomial(p[ids], 1, generator=g)[:, 0]
        x = torch.where(k <= depth, drafted, torch.where(k == depth + 1, bonus, continued))
        ids = child_ids(ids, x)
    return ids - (V ** (model.depth + 1) - 1) // (V - 1)  # index into Synthetic.joint


def chi_square(cells: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int, float, int]:
    """Pearson chi-square of the observed cells against exact probabilities, cells expected < 5 times
    pooled into one. Returns the statistic, its degrees of freedom, the critical value at p = 1e-6
    (Wilson-Hilferty), and how many trials landed in cells of probability exactly 0."""
    trials = cells.shape[0]
    observed = torch.bincount(cells, minlength=expected_probs.shape[0]).double()
    expected = expected_probs * trials
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    assert obs.sum() == trials and abs(float(exp.sum()) - trials) < 1e-6 * trials  # every trial in one cell
    stat = float(((obs - exp) ** 2 / exp.clamp(min=1e-12)).sum())
    dof = int(big.sum()) + int(exp[-1] > 0) - 1  # cells - 1, the pooled one counted where it is not empty
    assert dof >= 10, f"only {dof} degrees of freedom: too few trials to test the joint distribution"
    h = 2 / (9 * dof)
    return stat, dof, dof * (1 - h + Z * math.sqrt(h)) ** 3, int(observed[expected_probs == 0].sum())


# ---- scenarios ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Check:
    stat: float  # Pearson chi-square of the (D + 1)-token sequences against the target's joint
    dof: int
    critical: float  # exceeded with probability 1e-6 when the rule is lossless
    impossible: int  # trials that emitted a sequence of target probability 0: none when lossless
    depth: torch.Tensor  # (B,) depth of each trial's end node: where its bonus token was drawn
    later_sibling: torch.Tensor  # (B,) bool: a non-first sibling was accepted on the way

    @property
    def lossless(self) -> bool:
        return self.impossible == 0 and self.stat < self.critical

    def __str__(self) -> str:
        return (
            f"chi2 {self.stat:.1f}, critical {self.critical:.1f} at {self.dof} dof, "
            f"{self.impossible} impossible"
        )


@contextlib.contextmanager
def one_thread():
    """Every op here is small (tens of thousands of elements at most, or one (N, V) tree per call):
    waking a second thread costs more than it saves, much more on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@one_thread()
def check(tree: Tree, params: SamplingParams, sampled: bool, trials: int, seed: int = 0):
    """Draft `trials` trees, accept each, and test the emitted-then-continued tokens against the target.
    Returns the chi-square test, and per trial the end node's depth and whether a later sibling was
    accepted on the way, so callers can assert what the test reached."""
    model = Synthetic(tree.max_depth, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    if sampled:
        tokens, logits, q = draft_sampled(model, tree, trials, g, params)
    else:
        tokens, logits, q = draft_point(model, tree, trials, g)
    end, bonus = run_accept(tree, params, tokens, logits, q, seed + 2)
    cells = emitted_then_continued(model, params, tree, tokens, end, bonus, seed + 3)
    stat, dof, critical, impossible = chi_square(cells, model.joint(params))
    later_sibling = (tree.ranks[tree.paths[end]] > 0).any(1)  # (B,) a non-first child was accepted somewhere
    return Check(stat, dof, critical, impossible, tree.depths[end], later_sibling)


def assert_reaches_deep_nodes(result: Check, tree: Tree) -> None:
    """The check only means something if bonus tokens were drawn at every depth, leaves included, and
    (exactly where the tree has siblings) after accepting a later sibling."""
    counts = torch.bincount(result.depth, minlength=tree.max_depth + 1)
    assert (counts > 0.02 * result.depth.shape[0]).all(), f"trials ending at each depth: {counts.tolist()}"
    has_siblings = tree.children.shape[1] > 1
    assert (result.later_sibling.float().mean() > 0.03) == has_siblings, "later siblings: accepted too rarely"


POINT_TRIALS = 40_000  # vmapped: about a second
SAMPLED_TRIALS = 4_000  # one call each: about two seconds
POINT_CASES = {
    "medusa-T1": (MEDUSA, SamplingParams(temperature=1.0)),
    "wide-T0.7-topk4": (WIDE, SamplingParams(temperature=0.7, top_k=4)),
    "profile-T1.3-topp0.8": (PROFILE, SamplingParams(temperature=1.3, top_p=0.8)),
}
SAMPLED_CASES = {
    "chain-T1.5-topp0.9": (chain_choices(3), SamplingParams(temperature=1.5, top_p=0.9)),
    "siblings-T0.8-topk5": (
        SIBLINGS,
        SamplingParams(temperature=0.8, top_k=5),
    ),  # no nucleus: p, q keep 5 tokens
}


@pytest.mark.parametrize("case", list(POINT_CASES))
def test_point_proposals_are_lossless(case):
    choices, params = POINT_CASES[case]
    tree = tree_from_choices(choices)
    result = check(tree, params, sampled=False, trials=POINT_TRIALS)
    assert_reaches_deep_nodes(result, tree)
    assert result.lossless, f"{result}: point-proposal acceptance is not lossless"


@pytest.mark.parametrize("case", list(SAMPLED_CASES))
def test_sampled_proposals_are_lossless(case):
    choices, params = SAMPLED_CASES[case]
    tree = tree_from_choices(choices)
    result = check(tree, params, sampled=True, trials=SAMPLED_TRIALS)
    assert_reaches_deep_nodes(result, tree)
    assert result.lossless, f"{result}: sampled-proposal acceptance is not lossless"


# ---- the check must catch a broken rule ----------------------------------------------------------


def mutant(fn, old: str, new: str):
    """A copy of `fn` with one edit of its source, compiled in infer.verify's namespace: a deliberate bug."""
    source = textwrap.dedent(inspect.getsource(fn))
    assert source.count(old) == 1, f"{fn.__name__} no longer contains {old!r}: update this mutation"
    namespace = dict(vars(verify))
    exec(source.replace(old, new), namespace)
    return namespace[fn.__name__]


# name -> (function of infer.verify, an exact line of its source, that line broken, case the check runs)
MUTATIONS = {
    # point proposals: the bonus leaves out the root's children's tokens instead of the end node's
    "point_residual_from_root_children": (
        "accept_sampled_rows",
        "end_kids = kids.gather(1, end[..., None].expand(B, 1, kids.shape[2]))[:, 0]",
        "end_kids = kids[:, 0]",
        "medusa-T1",
    ),
    # sampled proposals: the bonus is drawn from what is left of p at the root, not at the end node
    "sampled_residual_from_root": (
        "accept",
        "draw(left.index_select(0, end)[0], generator)",
        "draw(left[0], generator)",
        "chain-T1.5-topp0.9",
    ),
    # point proposals: sibling j accepted with p(x_j), not p(x_j) / (1 - p(earlier siblings))
    "point_sibling_not_renormalised": (
        "sampled_children",
        "p_kid / (1.0 - used).clamp(min=1e-12)",
        "p_kid",
        "medusa-T1",
    ),
    # sampled proposals: after a rejected sibling the next is tested against (p - q)+ unnormalised
    "sampled_sibling_not_renormalised": (
        "sampled_children_from",
        "residual / total.clamp(min=1e-30)",
        "residual",
        "siblings-T0.8-topk5",
    ),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_the_check_catches_a_broken_rule(monkeypatch, name):
    attr, old, new, case = MUTATIONS[name]
    monkeypatch.setattr(verify, attr, mutant(getattr(verify, attr), old, new))
    sampled = case in SAMPLED_CASES
    choices, params = SAMPLED_CASES[case] if sampled else POINT_CASES[case]
    result = check(tree_from_choices(choices), params, sampled, SAMPLED_TRIALS if sampled else POINT_TRIALS)
    assert not result.lossless, f"{result}: the check passed the mutant {name}"


# ---- greedy -------------------------------------------------------------------------------------


def random_tree(g: torch.Generator) -> Tree:
    """A random breadth-first tree of depth 2 to 4 with 1 to 3 children per inner node."""
    parents, frontier = [-1], [0]
    for _ in range(int(torch.randint(2, 5, (1,), generator=g))):
        nxt = []
        for node in frontier:
            for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
                nxt.append(len(parents))
                parents.append(node)
        frontier = nxt
    return tree_from_parents(parents, [0] * len(parents))


def greedy_reference(logits: torch.Tensor, tokens: torch.Tensor, tree: Tree) -> int:
    """Walk down while some child's token is the target's argmax at its parent (siblings are distinct)."""
    node = 0
    while True:
        kids = [int(c) for c in tree.children[node] if c >= 0 and tokens[c] == logits[node].argmax()]
        if not kids:
            return node
        (node,) = kids


def test_greedy_accepts_the_longest_argmax_path():
    g = torch.Generator().manual_seed(0)
    depths = []
    for case in range(200):
        tree = tree_from_choices(MEDUSA) if case % 4 == 0 else random_tree(g)
        logits = torch.randn(tree.size, V, generator=g)
        tokens = torch.zeros(tree.size, dtype=torch.long)
        for node in range(tree.size):  # distinct sibling tokens; the argmax among them 3 times in 4
            kids = [int(c) for c in tree.children[node] if c >= 0]
            choice = torch.randperm(V, generator=g)[: len(kids)]
            best = logits[node].argmax()
            if kids and best not in choice and torch.rand(1, generator=g) < 0.75:
                choice[int(torch.randint(len(kids), (1,), generator=g))] = best
            tokens[kids] = choice
        end, bonus = verify.accept(logits, tokens, tree, SamplingParams(temperature=0.0))
        expected = greedy_reference(logits, tokens, tree)
        assert int(end) == expected, (
            f"case {case}: ended at node {int(end)}, the argmax path ends at {expected}"
        )
        assert int(bonus) == int(logits[expected].argmax())
        depths.append(int(tree.depths[expected]))
    reached = torch.bincount(torch.tensor(depths), minlength=4)
    assert (reached[:4] >= 10).all(), f"cases ending at depth 0..3: {reached[:4].tolist()}"
