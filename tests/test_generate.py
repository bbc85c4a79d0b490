import pytest
import torch

from conftest import VOCAB, fit_on_own_continuations
from heads.config import HeadsConfig
from heads.medusa import MedusaHeads
from infer.generate import SpeculativeModel
from infer.proposers import MedusaProposer

CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def random_heads(model, seed=0, scale=0.5, num_heads=4) -> MedusaHeads:
    torch.manual_seed(seed)
    cfg = HeadsConfig(hidden_size=model.config.hidden_size, vocab_size=VOCAB, num_heads=num_heads)
    heads = MedusaHeads(cfg)
    heads.init_from_lm_head(model.get_output_embeddings())
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * scale)
    return heads


def oracle_heads_model(model):
    """Heads that copy the target's lm_head: head k guesses the next token again (often right on loops)."""
    heads = random_heads(model, scale=0.0)
    return SpeculativeModel(model, MedusaProposer(heads, model.get_output_embeddings(), CHOICES))


def plain_greedy(model, prompt, n, eos=None):
    kwargs = {} if eos is None else {"eos_token_id": eos}  # an explicit None would switch EOS off
    out = model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs)
    return out[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_identical_to_generate(model, seed):
    spec = SpeculativeModel(model, MedusaProposer(random_heads(model, seed), model.get_output_embeddings(), CHOICES))
    gen = torch.Generator().manual_seed(seed)
    for length in (1, 5, 17):
        prompt = torch.randint(3, VOCAB, (1, length), generator=gen)
        for n in (1, 2, 13, 40):
            ref = plain_greedy(model, prompt, n)
            out = spec.generate(prompt, max_new_tokens=n)
            assert out[0, length:].tolist() == ref, (length, n)


def test_greedy_stops_at_eos_like_generate(model):
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, VOCAB, (1, 9), generator=gen)
    free = model.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)  # no EOS
    eos = free[0, 9 + 11].item()  # a token that will appear mid-generation: both must stop right after it
    ref_eos = plain_greedy(model, prompt, 30, eos=eos)
    spec = oracle_heads_model(model)
    out = spec.generate(prompt, max_new_tokens=30, eos_token_id=eos)[0, 9:].tolist()
    assert out == ref_eos
    assert out[-1] == eos


def test_stats_count_forwards_and_tokens(model):
    spec = oracle_heads_model(model)
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    out = spec.generate(prompt, max_new_tokens=25, eos_token_id=[])
    stats = spec.last_stats
    assert out.shape[1] == 30 and stats.new_tokens == 25
    assert stats.target_forwards == stats.decode_steps + 1
    assert stats.decode_tokens >= 24 and 1.0 <= stats.tau <= 5.0
    assert sum(stats.accept_lengths) == stats.decode_tokens


def test_rejects_batches_and_empty_prompts(model):
    spec = oracle_heads_model(model)
    with pytest.raises(ValueError, match="batch size 1"):
        spec.generate(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        spec.generate(torch.ones(1, 0, dtype=torch.long))


def self_distilled_heads(model, prompts, steps=150) -> MedusaHeads:
    """Heads trained (with the recipe's own loss) on the model's greedy continuations of `prompts`."""
    from train.medusa import MedusaConfig, MedusaMethod

    heads = random_heads(model, scale=0.0, num_heads=4)
    return fit_on_own_continuations(model, prompts, MedusaMethod(MedusaConfig(num_heads=4), model, heads), steps, 3e-2)


def test_greedy_identical_with_trained_heads(model):
    prompts = torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(7))
    heads = self_distilled_heads(model, prompts)
    spec = SpeculativeModel(model, MedusaProposer(heads, model.get_output_embeddings(), CHOICES))
    taus = []
    for i, length in enumerate((6, 4, 2)):
        prompt = prompts[i : i + 1, :length]  # seen in training (6), or shorter cuts of seen prompts
        ref = plain_greedy(model, prompt, 48)
        out = spec.generate(prompt, max_new_tokens=48)[0, length:].tolist()
        assert out == ref
        taus.append(spec.last_stats.tau)
    assert max(taus) > 1.5  # trained heads get drafts accepted, so multi-token paths are exercised
