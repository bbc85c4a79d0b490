"""Speculative sampling must reproduce the target's exact distribution (computed by enumeration)."""

import pytest
import torch

import selfspec.infer.core.verify as verify
from sampling_checks import RUNS, chi_square, critical, exact_joint, make_spec, run_sampling


@pytest.mark.parametrize("kind", ["medusa", "eagle", "draft_model", "prompt_lookup"])
@pytest.mark.parametrize("params", [(1.0, 0, 1.0), (0.7, 6, 0.9)])
def test_speculative_sampling_matches_target_distribution(params, kind):
    model, spec = make_spec(seed=5, kind=kind)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 3, 1, 4, 1]])  # repeats, so prompt lookup has something to propose
    expected = exact_joint(model, prompt, params)
    accepted = []
    counts = run_sampling(spec, prompt, params, accepted)
    stat, dof = chi_square(counts, expected, RUNS)
    assert stat < critical(dof), (
        f"chi2 {stat:.1f} with {dof} dof: the sampled distribution is not the target's"
    )
    # the drafts were really tried: drafted tokens (the first one decides the 2nd token) were accepted
    assert sum(a > 0 for a in accepted) > RUNS // 100


def test_the_distribution_check_catches_lossy_acceptance(monkeypatch):
    """Accepting any drafted child whose p(x) >= 0.05 (a 'typical'-style rule) must fail the same check."""

    def lossy(p, tokens, trees, u):
        kids = trees.children  # (B, N, C)
        valid = kids >= 0
        p_kid = p.gather(2, tokens.gather(1, kids.clamp(min=0).flatten(1)).view_as(kids)) * valid
        ok = (p_kid >= 0.05) & valid
        has = ok.any(2)
        chosen = torch.where(has, kids.gather(2, ok.int().argmax(2, keepdim=True))[..., 0], 0)
        picked = torch.zeros(tokens.shape, dtype=torch.bool).scatter(1, chosen, has)
        picked[:, 0] = True
        return picked

    monkeypatch.setattr(verify, "sampled_children", lossy)
    params = (1.0, 0, 1.0)
    model, spec = make_spec(seed=5)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    stat, dof = chi_square(run_sampling(spec, prompt, params), exact_joint(model, prompt, params), RUNS)
    assert stat > critical(dof)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 0.9), (0.7, 0, 0.5), (5.0, 0, 0.95), (1.0, 40, 0.8), (30.0, 0, 0.99), (1.0, 0, 1e-4)],
)
def test_nucleus_without_a_full_sort_equals_transformers_warpers(temperature, top_k, top_p, monkeypatch):
    """The warped distribution is model.generate's (transformers' own warpers), also where the nucleus holds
    thousands of tokens (a flat distribution: the top-k search must grow), and no full sort is taken."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(5, 32000, generator=torch.Generator().manual_seed(3)) * 4
    warpers = LogitsProcessorList(
        [TemperatureLogitsWarper(temperature)]
        + ([TopKLogitsWarper(top_k)] if top_k else [])
        + [TopPLogitsWarper(top_p)]
    )
    expected = warpers(None, logits.clone()).softmax(-1)
    before_top_p = LogitsProcessorList(warpers[:-1])(None, logits.clone()).softmax(-1).double()
    monkeypatch.setattr(torch, "sort", lambda *a, **k: pytest.fail("a full-vocabulary sort"))
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: pytest.fail("a full-vocabulary sort"))
    got = verify.target_probs(logits, verify.SamplingParams(temperature, top_k, top_p))
    # the same tokens kept, except a token at the nucleus' edge whose preceding mass equals top_p to float32
    # rounding (both sides sum in float32, in another order: which side of top_p it lands on is the CPU's)
    for row, token in ((got > 0) != (expected > 0)).nonzero().tolist():
        probs = before_top_p[row]
        assert abs(float(probs[probs > probs[token]].sum()) - top_p) < 1e-6
    same = ((got > 0) == (expected > 0)).all(-1)
    assert same.sum() >= len(same) - 1
    torch.testing.assert_close(got[same], expected[same], rtol=1e-5, atol=1e-7)


def test_a_nucleus_of_thousands_of_tokens_grows_the_search():
    logits = torch.randn(3, 32000, generator=torch.Generator().manual_seed(4)) * 4
    got = verify.target_probs(logits, verify.SamplingParams(30.0, 0, 0.99))  # nearly flat: a huge nucleus
    assert int((got > 0).sum(-1).min()) > 16 * verify.NUCLEUS_FIRST_K


def test_nucleus_cuts_tied_tokens_by_position_like_a_sort():
    """bf16 logits repeat exact values: the boundary cuts a run of ties, keeping as many tokens and as much
    mass as the sort-based warper (which tokens of a tie is the sort's arbitrary order either way)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = (torch.randn(4, 4096, generator=torch.Generator().manual_seed(5)) * 2).bfloat16().float()
    for top_p in (0.3, 0.7, 0.9):
        expected = TopPLogitsWarper(top_p)(None, logits.clone()).softmax(-1)
        got = verify.target_probs(logits, verify.SamplingParams(1.0, 0, top_p))
        assert torch.equal((got > 0).sum(-1), (expected > 0).sum(-1))
        torch.testing.assert_close(got.sort(-1).values, expected.sort(-1).values, rtol=1e-5, atol=1e-7)
