import pytest
import torch

from infer.cache import keep_accepted, new_cache
from infer.mask import PrefixMask
from infer.target import Target
from infer.tree import best_choices, chain_choices, fit_tree, tree_from_choices

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
    target.prefill(prompt, cache)
    logits, hidden = target.verify(tokens, tree, PrefixMask(tree.size, 7 + tree.size, target.dtype, target.device), 7, cache)
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
    target.prefill(prompt, cache)
    target.verify(tokens, tree, PrefixMask(tree.size, 6 + tree.size, target.dtype, target.device), 6, cache)
    end = 9  # choice [0, 1, 0]: root -> 1 -> 5 -> 9
    path = tree.paths[end]
    keep_accepted(cache, 6, path, 4)
    plain = new_cache(model, 64)
    target.prefill(torch.cat([prompt[0], tokens[path]])[None], plain)
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
