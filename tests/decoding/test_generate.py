import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import VOCAB, fit_on_own_continuations, randomized, tiny_config, tiny_model
from medusa_heads import CHOICES, random_heads
from selfspec.heads.medusa import MedusaHeads
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.core.verify import MIN_TEMPERATURE, SamplingParams, target_probs
from selfspec.infer.drafters.proposers import MedusaProposer


def oracle_heads_model(model):
    """Heads that copy the target's lm_head: head k guesses the next token again (often right on loops)."""
    heads = random_heads(model, scale=0.0)
    return SpeculativeModel(model, MedusaProposer(heads, model.get_output_embeddings(), CHOICES))


def plain_greedy(model, prompt, n, eos=None):
    kwargs = {} if eos is None else {"eos_token_id": eos}  # an explicit None would switch EOS off
    out = model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs)
    return out[0, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_identical_to_generate(model, seed):
    spec = SpeculativeModel(
        model, MedusaProposer(random_heads(model, seed), model.get_output_embeddings(), CHOICES)
    )
    gen = torch.Generator().manual_seed(seed)
    for length in (1, 5, 17):
        prompt = torch.randint(3, VOCAB, (1, length), generator=gen)
        for n in (1, 2, 13, 40):
            ref = plain_greedy(model, prompt, n)
            out = spec.generate(prompt, max_new_tokens=n)
            assert out[0, length:].tolist() == ref, (length, n)


def test_a_root_only_tree_skips_the_heads_and_decodes_as_plain(model, monkeypatch):
    heads = random_heads(model)  # a tree fit that found no draft worth verifying keeps the root alone
    monkeypatch.setattr(heads, "forward", lambda *a, **k: pytest.fail("the heads ran for a root-only tree"))
    spec = SpeculativeModel(model, MedusaProposer(heads, model.get_output_embeddings(), []))
    prompt = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    assert spec.generate(prompt[:1], max_new_tokens=12, eos_token_id=[])[0, 6:].tolist() == plain_greedy(
        model, prompt[:1], 12, eos=[]
    )
    out = spec.generate(prompt, max_new_tokens=12, eos_token_id=[])  # the batched path
    assert [row[6:].tolist() for row in out] == [plain_greedy(model, p[None], 12, eos=[]) for p in prompt]


def test_greedy_stops_at_eos_like_generate(model):
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, VOCAB, (1, 9), generator=gen)
    free = model.generate(
        prompt, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0
    )  # no EOS
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


def test_rejects_empty_prompts_and_decode_of_a_batch(model):
    spec = oracle_heads_model(model)
    with pytest.raises(ValueError, match="decode_batch"):
        spec.decode(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        spec.generate(torch.ones(1, 0, dtype=torch.long))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"max_new_tokens": -5}, "max_new_tokens must be >= 1, got -5"),
        (
            {"temperature": float("nan")},
            r"temperature must be 0 \(greedy\) or a finite number >= 1e-06, got nan",
        ),
        ({"temperature": 1e-39}, "temperature must be .* got 1e-39"),
        ({"temperature": -1.0}, "temperature must be .* got -1.0"),
        ({"temperature": float("inf")}, "temperature must be .* got inf"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": float("nan")}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_decode_rejects_bad_arguments_when_called(kwargs, message):
    spec = oracle_heads_model(tiny_model("llama"))
    with pytest.raises(ValueError, match=message):
        spec.decode(torch.tensor([[5, 6, 7]]), **kwargs)  # at the call, not at the first step


def test_no_new_tokens_is_an_error_as_in_model_generate():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=0, do_sample=False, pad_token_id=0)


def test_smallest_temperature_is_safe_and_the_one_below_is_not():
    model = tiny_model("llama")
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    out = oracle_heads_model(model).generate(
        prompt,
        max_new_tokens=20,
        do_sample=True,
        temperature=MIN_TEMPERATURE,
        generator=torch.Generator().manual_seed(0),
    )
    assert out[0, 5:].tolist() == plain_greedy(model, prompt, 20)  # so cold that it samples the argmax
    # what the check keeps out: logits / temperature overflows, p is NaN, and every draw is token 0
    unchecked = object.__new__(SamplingParams)
    for name, value in (("temperature", 1e-39), ("top_k", 0), ("top_p", 1.0)):
        object.__setattr__(unchecked, name, value)
    with torch.no_grad():
        logits = model(prompt).logits[0, -1]
    assert torch.isnan(target_probs(logits, unchecked)).all()


def short_context_model(arch: str, positions: int) -> torch.nn.Module:
    """A tiny model that embeds `positions` positions (for GPT-2, a position table of that many rows)."""
    config = tiny_config(arch)
    setattr(config, "n_positions" if arch == "gpt2" else "max_position_embeddings", positions)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return randomized(model)


def record_positions(model) -> list[tuple[int, int]]:
    """(largest position id, keys attended) of every forward of `model` from now on."""
    seen = []

    def hook(module, args, kwargs):
        ids, positions, mask = kwargs["input_ids"], kwargs.get("position_ids"), kwargs.get("attention_mask")
        if positions is None:  # prefill: the prompt from position 0
            seen.append((ids.shape[1] - 1, ids.shape[1]))
        else:
            seen.append((int(positions.max()), mask.shape[-1]))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_budget_is_clipped_to_the_models_positions_and_trees_stay_inside(arch):
    limit = 40
    model = short_context_model(arch, limit)
    spec = SpeculativeModel(
        model, MedusaProposer(random_heads(model, scale=0.0), model.get_output_embeddings(), CHOICES)
    )
    prompt = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    ref = model.generate(
        prompt, max_new_tokens=limit - 10, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    seen = record_positions(model)
    with pytest.warns(
        UserWarning, match="exceed the model's 40 positions: generating at most 30 new tokens"
    ) as w:
        out = spec.generate(prompt, max_new_tokens=100, eos_token_id=[])
    assert len(w) == 1
    assert out.tolist() == ref.tolist() and out.shape[1] == limit
    assert max(p for p, _ in seen) <= limit - 1 and max(k for _, k in seen) <= limit
    drafted = spec.last_stats.drafted
    assert drafted[0] == len(CHOICES) and drafted[-1] == 0  # full trees first, the root alone at the limit
    seen.clear()
    with pytest.warns(UserWarning):
        out = spec.generate(
            prompt,
            max_new_tokens=100,
            eos_token_id=[],
            do_sample=True,
            temperature=1.0,
            generator=torch.Generator().manual_seed(0),
        )
    assert out.shape[1] == limit and max(p for p, _ in seen) <= limit - 1


def test_a_prompt_that_fills_the_positions_is_an_error():
    model = short_context_model("llama", 16)
    spec = oracle_heads_model(model)
    prompt = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="the prompt is 16 tokens but the model takes at most 16 positions"):
        spec.generate(prompt, max_new_tokens=4)
    with pytest.warns(UserWarning, match="generating at most 1 new tokens"):
        out = spec.generate(prompt[:, :15], max_new_tokens=4)
    assert out.shape[1] == 16


def self_distilled_heads(model, prompts, steps=150) -> MedusaHeads:
    """Heads trained (with the recipe's own loss) on the model's greedy continuations of `prompts`."""
    from selfspec.train.methods.medusa import MedusaMethod
    from selfspec.train.recipes.medusa import MedusaConfig

    heads = random_heads(model, scale=0.0, num_heads=4)
    return fit_on_own_continuations(
        model, prompts, MedusaMethod(MedusaConfig(num_heads=4), model, heads), steps, 3e-2
    )


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
