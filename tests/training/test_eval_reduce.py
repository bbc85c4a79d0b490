"""Validation split across ranks: each method sums over its batches, sends its sums through `total` (a sum
across processes) once, and only then divides, so two ranks' halves reduced equal one rank's whole."""

import pytest
import torch

from conftest import VOCAB
from train_methods import KINDS, make_batch, make_method


@pytest.mark.parametrize("kind", KINDS)
def test_two_halves_reduced_equal_the_whole(kind):
    method = make_method(kind)
    method.trainable.eval()
    batches = [make_batch(VOCAB, 2, 16 + 2 * seed, seed=seed) for seed in range(4)]
    first, rest = batches[:1], batches[1:]  # uneven halves: a mean of the halves' means would differ
    sent = []

    def record(t: torch.Tensor) -> torch.Tensor:
        sent.append(t.clone())
        return t

    with torch.no_grad():
        whole = method.evaluate(batches)
        alone = method.evaluate(first)
        method.evaluate(rest, total=record)
        assert len(sent) == 1  # one reduction per evaluation
        reduced = method.evaluate(first, total=lambda t: t + sent[0])
    assert len(sent) == 1 and reduced.keys() == whole.keys()
    for name, value in whole.items():
        assert reduced[name] == pytest.approx(value, abs=1e-6), name
    assert any(alone[name] != pytest.approx(value, abs=1e-4) for name, value in whole.items())  # not vacuous


@pytest.mark.parametrize("kind", ["medusa", "medusa-own-heads"])
def test_medusa_path_frequencies_are_reduced_with_the_rest(kind):
    """The rank paths the tree is fitted to are counted per rank and summed like every other validation
    sum."""
    method = make_method(kind, vocab=16)  # labels often among the top 10: paths of every depth occur
    method.trainable.eval()
    batches = [make_batch(16, 2, 20 + seed, seed=seed) for seed in range(3)]
    with torch.no_grad():
        whole = method.evaluate(batches)
        sent = []
        method.evaluate(batches[1:], total=lambda t: sent.append(t) or t)
        reduced = method.evaluate(batches[:1], total=lambda t: t + sent[0])
    paths = {name: value for name, value in whole.items() if name.startswith("path/")}
    assert len(paths) > 20 and any(name.count(".") == 2 for name in paths)
    assert {name: reduced[name] for name in reduced if name.startswith("path/")} == pytest.approx(
        paths, abs=1e-12
    )


@pytest.mark.parametrize("kind", KINDS)
def test_no_batches_is_zeros_not_an_error(kind):
    """A rank with no validation batch of its own still takes part in the reduction."""
    method = make_method(kind)
    sent = []
    with torch.no_grad():
        metrics = method.evaluate([], total=lambda t: sent.append(t) or t)
    assert len(sent) == 1 and not sent[0].any()
    assert metrics and all(value == 0 for value in metrics.values())
