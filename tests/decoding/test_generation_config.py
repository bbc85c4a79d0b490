"""The loop reads the target's generation_config as model.generate does: sampling settings and EOS ids the
call leaves out come from it, and what it cannot apply exactly is refused in one line."""

import pytest
import torch

from conftest import VOCAB, tiny_model
from medusa_heads import CHOICES, random_heads
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.core.generation_config import resolve
from selfspec.infer.core.verify import SamplingParams
from selfspec.infer.drafters.proposers import MedusaProposer


def spec_for(model) -> SpeculativeModel:
    return SpeculativeModel(
        model, MedusaProposer(random_heads(model, scale=0.0), model.get_output_embeddings(), CHOICES)
    )


def test_a_sampling_config_is_followed_like_model_generate():
    model = tiny_model("llama")
    config = model.generation_config
    config.do_sample, config.temperature, config.top_k, config.top_p = True, 0.7, 5, 0.9
    assert params(config) == SamplingParams(0.7, 5, 0.9)
    assert params(config, top_k=0) == SamplingParams(0.7, 0, 0.9)  # the call's values win
    assert params(config, do_sample=False) == SamplingParams()
    config.top_k = config.top_p = None
    assert params(config) == SamplingParams(0.7, 50, 1.0)  # transformers' defaults fill the rest
    config.do_sample = None
    assert params(config) == SamplingParams()  # nothing says sample: greedy, as model.generate
    assert (
        params(config, temperature=0.7) == SamplingParams()
    )  # a temperature alone stays greedy, as in transformers
    assert params(config, do_sample=True, temperature=0.5) == SamplingParams(0.5, 50, 1.0)
    with pytest.raises(ValueError, match="do_sample=True needs a temperature above 0"):
        params(config, do_sample=True, temperature=0.0)


def params(config, **kwargs) -> SamplingParams:
    return resolve(config, **kwargs).params


def test_with_a_sampling_config_the_same_seed_gives_the_same_draws_as_the_explicit_settings():
    """Decoding with settings taken from the config is decoding with those settings (same draws, same
    seed)."""
    model = tiny_model("llama")
    spec = spec_for(model)
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    explicit = spec.generate(
        prompt,
        max_new_tokens=12,
        do_sample=True,
        temperature=0.8,
        top_k=7,
        top_p=0.95,
        generator=torch.Generator().manual_seed(5),
    )
    config = model.generation_config
    config.do_sample, config.temperature, config.top_k, config.top_p = True, 0.8, 7, 0.95
    from_config = spec.generate(prompt, max_new_tokens=12, generator=torch.Generator().manual_seed(5))
    assert from_config.tolist() == explicit.tolist()
    greedy = spec.generate(prompt, max_new_tokens=12, do_sample=False)
    want = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert greedy.tolist() == want.tolist()


def test_eos_ids_come_from_the_config():
    model = tiny_model("llama")
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    free = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)[
        0, 6:
    ]
    model.generation_config.eos_token_id = [
        int(free[7]),
        10_000,
    ]  # a token met mid-generation, and one never met
    want = model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    got = spec_for(model).generate(prompt, max_new_tokens=20, do_sample=False)
    assert got.tolist() == want.tolist() and got.shape[1] < 6 + 20


@pytest.mark.parametrize(
    "name,value",
    [
        ("repetition_penalty", 1.3),
        ("suppress_tokens", [5]),
        ("min_new_tokens", 4),
        ("no_repeat_ngram_size", 2),
    ],
)
def test_what_the_loop_cannot_apply_is_refused_in_one_line(name, value):
    model = tiny_model("llama")
    setattr(model.generation_config, name, value)
    spec = spec_for(model)
    with pytest.raises(
        ValueError, match=f"the generation config sets {name}=.*set generation_config.{name} = "
    ):
        spec.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4)
