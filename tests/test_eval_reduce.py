"""Validation split across ranks: each method sums over its batches, sends its sums through `total` (a sum
across processes) once, and only then divides, so two ranks' halves reduced equal one rank's whole."""

import pytest
import torch
from test_chunked_loss import KINDS, make_batch, make_method

from conftest import VOCAB


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
    if kind.startswith("medusa"):  # the path frequencies the tree is fitted to are reduced too (compared below)
        assert any(name.startswith("path/") for name in whole)
    for name, value in whole.items():
        assert reduced[name] == pytest.approx(value, abs=1e-6), name
    assert any(alone[name] != pytest.approx(value, abs=1e-4) for name, value in whole.items())  # not vacuous


@pytest.mark.parametrize("kind", KINDS)
def test_no_batches_is_zeros_not_an_error(kind):
    """A rank with no validation batch of its own still takes part in the reduction."""
    method = make_method(kind)
    sent = []
    with torch.no_grad():
        metrics = method.evaluate([], total=lambda t: sent.append(t) or t)
    assert len(sent) == 1 and not sent[0].any()
    assert metrics and all(value == 0 for value in metrics.values())
