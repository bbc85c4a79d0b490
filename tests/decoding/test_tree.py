import pytest
import torch

from conftest import prefill_one, verify_one
from selfspec.infer.core.cache import new_cache
from selfspec.infer.core.target import Target
from selfspec.infer.core.tree import (
    LatencyCurve,
    best_choices,
    chain_choices,
    expected_accepted,
    fill_choices,
    fit_tree,
    label_ranks,
    low_and_spread,
    monotone_below,
    path_frequencies,
    tree_from_choices,
)

CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [2, 0]]


def test_tree_from_choices_structure():
    tree = tree_from_choices(CHOICES)
    assert tree.size == 10
    assert tree.depths.tolist() == [0, 1, 1, 1, 2, 2, 2, 2, 3, 3]
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2, 3, 4, 5]
    assert tree.children[0].tolist()[:3] == [1, 2, 3]
    assert tree.paths[8].tolist() == [0, 1, 4, 8]
    assert tree.paths[2].tolist() == [0, 2, 2, 2]
    assert tree.ancestors[8].nonzero().flatten().tolist() == [0, 1, 4, 8]
    assert not tree.ancestors[4, 2]


def test_tree_rejects_missing_parent():
    with pytest.raises(ValueError, match=r"no parent \[0\]"):
        tree_from_choices([[1], [0, 0]])


def test_best_choices_is_ancestor_closed_and_prefers_likely_paths():
    acc = torch.tensor([[0.8, 0.1, 0.05], [0.6, 0.2, 0.1], [0.5, 0.1, 0.1]])
    choices = best_choices(acc, 6)
    assert choices[:3] == [[0], [0, 0], [0, 0, 0]]
    tree_from_choices(choices)  # raises if not ancestor-closed
    assert len(best_choices(acc, 100)) == 3 + 9 + 27


def accepted_per_position(ranks: torch.Tensor, choices: list[list[int]]) -> torch.Tensor:
    """Drafted tokens a static tree gets accepted at each position, walked the way verification does: from the
    root, follow the child whose rank is that depth's rank of the target's token, until there is none."""
    children = {}
    for path in choices:
        children.setdefault(tuple(path[:-1]), set()).add(path[-1])
    out = []
    for row in ranks.tolist():
        node = ()
        while len(node) < len(row) and row[len(node)] in children.get(node, ()):
            node = (*node, row[len(node)])
        out.append(len(node))
    return torch.tensor(out, dtype=torch.float64)


def correlated_ranks(n: int = 4000, depth: int = 4, seed: int = 0) -> torch.Tensor:
    """Ranks (n, depth) where a third of the positions are easy (every depth right at rank 0, as on repeated
    text) and the rest are hard (each depth rank 0 a quarter of the time, else rank 1-3 or a miss)."""
    gen = torch.Generator().manual_seed(seed)
    easy = torch.rand(n, generator=gen) < 1 / 3
    hard = torch.randint(1, 6, (n, depth), generator=gen).clamp(max=4)  # 4: not among the first 4
    hard[torch.rand(n, depth, generator=gen) < 0.25] = 0
    return torch.where(easy[:, None], torch.zeros_like(hard), hard)


def test_path_frequencies_count_a_path_where_every_depth_along_it_ranks_the_token_so():
    ranks = torch.tensor([[0, 0, 1], [0, 1, 9], [0, 0, 0], [1, 0, 0], [9, 0, 0]])
    freq = path_frequencies(ranks, width=4)
    assert freq == pytest.approx(
        {
            (0,): 3 / 5,
            (1,): 1 / 5,
            (0, 0): 2 / 5,
            (0, 1): 1 / 5,
            (1, 0): 1 / 5,
            (0, 0, 1): 1 / 5,
            (0, 0, 0): 1 / 5,
            (1, 0, 0): 1 / 5,
        }
    )
    weighted = path_frequencies(ranks[:2], width=4, counts=torch.tensor([3, 1]))
    assert weighted == pytest.approx({(0,): 1.0, (0, 0): 0.75, (0, 1): 0.25, (0, 0, 1): 0.75})
    assert path_frequencies(ranks[:0], width=4) == {}


def test_label_ranks_is_the_labels_place_among_the_top_logits_or_the_width():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [5.0, 0.0, 1.0, 2.0]])
    assert label_ranks(logits, torch.tensor([2, 3]), 3).tolist() == [1, 1]
    assert label_ranks(logits, torch.tensor([3, 1]), 3).tolist() == [3, 3]  # not among the first 3


def test_a_tree_from_measured_paths_gets_what_it_expects_and_beats_the_product_of_accuracies():
    """On correlated hits the per-depth product undervalues deep chains; the tree picked from measured path
    frequencies expects exactly what walking it over the positions accepts, and that is more."""
    ranks = correlated_ranks()
    freq = path_frequencies(ranks, width=4)
    accuracy = torch.stack(
        [torch.stack([(ranks[:, d] == r).double().mean() for r in range(4)]) for d in range(ranks.shape[1])]
    )
    gains = []
    for nodes in (4, 8, 15):
        measured, product = best_choices(freq, nodes), best_choices(accuracy, nodes)
        tree_from_choices(measured)  # raises if not ancestor-closed
        walked = float(accepted_per_position(ranks, measured).mean())
        assert expected_accepted(freq, measured) == pytest.approx(walked)
        gains.append(walked - float(accepted_per_position(ranks, product).mean()))
    assert min(gains) >= -1e-12 and max(gains) > 0.1, gains  # the most frequent paths are the best tree here
    assert [0, 0, 0, 0] in best_choices(freq, 4) and [0, 0, 0, 0] not in best_choices(accuracy, 4)


def test_fill_choices_tops_up_measured_paths_to_the_asked_size_ancestor_closed():
    freq = path_frequencies(torch.tensor([[0, 0], [0, 1], [0, 0]]), width=3)
    choices = best_choices(freq, 6)
    assert choices == [[0], [0, 0], [0, 1]]  # all that was seen
    accuracy = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.3, 0.2]])
    filled = fill_choices(choices, accuracy, 6)
    assert filled[:3] == choices and len(filled) == 6 and len({tuple(c) for c in filled}) == 6
    tree_from_choices(filled)
    assert fill_choices(choices, accuracy, 2) == choices[:2]


def test_fit_tree_on_measured_paths_stops_where_the_paths_run_out():
    freq = path_frequencies(torch.tensor([[0, 0], [0, 1], [1, 0]]), width=3)  # 5 paths seen
    choices, rows = fit_tree(freq, {n: 0.01 for n in (1, 4, 6, 8, 16)})
    assert [r["nodes"] for r in rows] == [1, 4, 6]  # 8 nodes would need 7 paths
    assert len(choices) == 5 and rows[-1]["tokens_per_step"] == pytest.approx(1 + 2)


def test_chain():
    assert chain_choices(3) == [[0], [0, 0], [0, 0, 0]]


def _tree_tokens(tree, gen):
    return torch.randint(3, 90, (tree.size,), generator=gen)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_logits_equal_each_path_run_plainly(arch, attn):
    from conftest import tiny_model

    model = tiny_model(arch, attn=attn)
    target = Target(model)
    tree = tree_from_choices(CHOICES)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 90, (1, 7), generator=gen)
    tokens = _tree_tokens(tree, gen)
    cache = new_cache(model, 64)
    prefill_one(target, prompt, cache)
    logits, hidden = verify_one(target, tokens, tree, 7, cache)
    for node in range(tree.size):
        path = tree.paths[node][: int(tree.depths[node]) + 1]
        seq = torch.cat([prompt[0], tokens[path]])[None]
        with torch.no_grad():
            out = model(seq, output_hidden_states=True)
        torch.testing.assert_close(logits[node], out.logits[0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden[node], out.hidden_states[-1][0, -1], atol=1e-4, rtol=1e-4)


def test_cache_after_acceptance_equals_plain_cache(arch):
    from conftest import tiny_model

    model = tiny_model(arch)
    target = Target(model)
    tree = tree_from_choices(CHOICES)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 90, (1, 6), generator=gen)
    tokens = _tree_tokens(tree, gen)
    cache = new_cache(model, 64)
    prefill_one(target, prompt, cache)
    verify_one(target, tokens, tree, 6, cache)
    end = 9  # choice [0, 1, 0]: root -> 1 -> 5 -> 9
    path = tree.paths[end][:4]
    cache.keep_rows(6 + path[None], torch.arange(6, 10)[None], 10)
    plain = new_cache(model, 64)
    prefill_one(target, torch.cat([prompt[0], tokens[path]])[None], plain)
    assert cache.get_seq_length() == plain.get_seq_length() == 10
    assert len(cache.layers) == len(plain.layers) > 0
    for mine, ref in zip(cache.layers, plain.layers, strict=True):
        torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-5)


def test_fit_tree_picks_a_smaller_tree_when_latency_grows_faster():
    acc = torch.tensor([[0.7, 0.15, 0.05, 0.02], [0.5, 0.15, 0.05, 0.02], [0.4, 0.1, 0.05, 0.02]])
    sizes = [1, 4, 8, 16, 32, 64]
    flat = {n: 0.010 * (1 + 0.01 * n) for n in sizes}  # a GPU-like curve: nodes are almost free
    steep = {n: 0.010 * (1 + 0.08 * n) for n in sizes}  # a CPU-like curve: every node costs
    flat_choices, _ = fit_tree(acc, flat)
    steep_choices, rows = fit_tree(acc, steep)
    assert len(steep_choices) < len(flat_choices)
    best = max(rows, key=lambda r: r["tokens_per_s"])
    assert best["choices"] == steep_choices and best["tokens_per_step"] > 1


def test_low_and_spread_take_the_20th_percentile_and_the_medians_distance_from_it():
    assert low_and_spread([3.0, 1.0, 1.0, 1.0, 1.0]) == (1.0, 0.0)
    assert low_and_spread([1.0, 1.0, 2.0, 2.0, 2.0, 9.0]) == (1.0, 1.0)  # index int(0.2 * 5) = 1; median 2


@pytest.mark.parametrize("seed", range(5))
def test_the_fitted_latency_never_falls_and_stays_under_every_measurement(seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 4, 8, 12, 16, 24, 32, 48, 64]
    samples = {
        n: (0.01 * (1 + 0.02 * n) * (1 + 3 * torch.rand(7, generator=gen) ** 4)).tolist() for n in sizes
    }
    curve = LatencyCurve.from_samples(samples)
    fitted = [curve[n] for n in sizes]
    assert list(curve) == sizes and fitted == sorted(fitted)
    assert all(curve[n] <= curve.measured[n] for n in sizes)
    # the fit is the highest such curve: each size keeps its time or the next bigger size's fitted time
    assert all(curve[a] in (curve.measured[a], curve[b]) for a, b in zip(sizes, sizes[1:]))
    assert curve[64] == curve.measured[64]


def test_monotone_below_lowers_each_size_to_the_fastest_bigger_one():
    assert monotone_below({1: 1.0, 2: 5.0, 3: 1.2, 4: 1.1, 5: 1.5}) == {
        1: 1.0,
        2: 1.1,
        3: 1.1,
        4: 1.1,
        5: 1.5,
    }


def test_fit_tree_rows_show_the_measured_time_and_spread_of_a_plain_mapping_as_exact():
    acc = torch.tensor([[0.7, 0.15], [0.5, 0.15]])
    _, rows = fit_tree(acc, {1: 0.010, 4: 0.012})
    assert [(r["ms"], r["measured_ms"], r["spread"]) for r in rows] == [(10.0, 10.0, 0.0), (12.0, 12.0, 0.0)]
