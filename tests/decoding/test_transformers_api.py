"""generate and from_pretrained take what transformers' take, by the same rules: streamers, generation
configs, do_sample, max_length, return_dict_in_generate, device_map / dtype / torch_dtype; a user's model is
never changed."""

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TextIteratorStreamer

from selfspec import GenerateOutput, SpeculativeModel


@pytest.fixture
def spec(medusa_dir):
    return SpeculativeModel.from_pretrained(medusa_dir, device_map="cpu", dtype=torch.float32)


@pytest.fixture
def prompt(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return tok, tok("def add(a, b):", return_tensors="pt")


def streamed(generate, tok, inputs, **kwargs) -> str:
    """The text a TextIteratorStreamer yields in the main thread while `generate` runs in another, as in
    transformers' documentation."""
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    thread = threading.Thread(target=generate, kwargs={**inputs, **kwargs, "streamer": streamer})
    thread.start()
    text = "".join(streamer)
    thread.join()
    return text


def test_a_text_iterator_streamer_streams_what_it_streams_with_model_generate(spec, prompt):
    tok, inputs = prompt
    ours = streamed(spec.generate, tok, inputs, max_new_tokens=24, do_sample=False)
    theirs = streamed(spec.model.generate, tok, inputs, max_new_tokens=24, do_sample=False)
    assert ours == theirs and len(ours) > 0
    with pytest.raises(ValueError, match="a streamer takes one prompt"):
        spec.generate(torch.tensor([[5, 6], [7, 8]]), max_new_tokens=3, streamer=TextIteratorStreamer(tok))


def test_a_temperature_without_do_sample_is_greedy_as_in_transformers(spec, prompt):
    _, inputs = prompt
    spec.model.generation_config.do_sample = False
    ours = spec.generate(**inputs, max_new_tokens=16, temperature=0.7)
    theirs = spec.model.generate(**inputs, max_new_tokens=16, temperature=0.7)
    assert ours.tolist() == theirs.tolist()
    seeded = [
        spec.generate(
            **inputs,
            max_new_tokens=16,
            do_sample=True,
            temperature=0.7,
            generator=torch.Generator().manual_seed(seed),
        ).tolist()
        for seed in range(4)
    ]
    assert any(s != ours.tolist() for s in seeded)  # do_sample=True does sample


def test_a_generation_config_is_honoured_and_left_as_it_was(spec, prompt):
    _, inputs = prompt
    config = GenerationConfig(max_new_tokens=7, do_sample=False)
    before, model_before = config.to_dict(), spec.model.generation_config.to_dict()
    out = spec.generate(**inputs, generation_config=config)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 7
    assert out.tolist() == spec.model.generate(**inputs, generation_config=config).tolist()
    assert config.to_dict() == before and spec.model.generation_config.to_dict() == model_before


def test_without_max_new_tokens_the_length_comes_from_max_length(spec, prompt):
    _, inputs = prompt
    spec.model.generation_config.max_length = inputs["input_ids"].shape[1] + 9
    ours = spec.generate(**inputs, do_sample=False, eos_token_id=None)
    theirs = spec.model.generate(**inputs, do_sample=False, eos_token_id=None)
    assert ours.tolist() == theirs.tolist() and ours.shape[1] == inputs["input_ids"].shape[1] + 9
    with pytest.raises(ValueError, match="max_length is 3, so no new token fits: set max_new_tokens"):
        spec.generate(**inputs, max_length=3)


def test_with_no_length_at_all_it_makes_20_new_tokens_with_transformers_warning(spec):
    """transformers 5: no max_length anywhere means 20 *new* tokens, whatever the prompt's length (this loop
    made 20 in total, and refused a 40-token prompt)."""
    prompt = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    spec.model.generation_config.max_length = None
    with pytest.warns(UserWarning, match="model-agnostic default `max_length`") as ours_warned:
        ours = spec.generate(prompt, do_sample=False, eos_token_id=None)
    with pytest.warns(UserWarning, match="model-agnostic default `max_length`"):
        theirs = spec.model.generate(prompt, do_sample=False, eos_token_id=None)
    assert ours.tolist() == theirs.tolist() and ours.shape[1] == 40 + 20
    assert ours_warned[0].filename == __file__  # pointed at the caller's line, as a warning should be


def test_return_dict_in_generate_gives_the_sequences_and_the_statistics(spec, prompt):
    tok, inputs = prompt
    out = spec.generate(**inputs, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out, GenerateOutput)
    assert torch.equal(out.sequences, out["sequences"]) and torch.equal(out[0], out.sequences)
    assert "sequences" in out and len(out) == 2 and list(out.keys()) == ["sequences", "stats"]
    sequences, stats = out.to_tuple()
    assert sequences is out.sequences and stats is out.stats
    assert out.sequences.tolist() == spec.generate(**inputs, max_new_tokens=10, do_sample=False).tolist()
    assert (
        out.sequences.tolist()
        == spec.generate(**inputs, max_new_tokens=10, do_sample=False, tokenizer=tok).tolist()
    )  # taken, as model.generate takes it
    assert out.stats.new_tokens == 10 and out.stats.tau >= 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"foo": 1}, "generate got an argument it does not support: foo=1"),
        (
            {"num_beams": 2},
            "the generation config sets num_beams=2, which speculative decoding here does not apply",
        ),
        (
            {"output_scores": True},
            "sets output_scores=True, which speculative decoding here does not support",
        ),
        ({"num_return_sequences": 2}, "num_return_sequences"),
        (
            {"generation_config": {"max_new_tokens": 3}},
            "generation_config must be a transformers.GenerationConfig",
        ),
        (
            {"stop_strings": ["\n\n"], "tokenizer": "a tokenizer"},
            r"^stop_strings=\['\\n\\n'\] is not supported by speculative decoding here: stop on token ids",
        ),
        (
            {"foo": "x" * 5000},
            r"^generate got an argument it does not support: foo='x{10,40}\.\.\.x*' \(it takes",
        ),
    ],
)
def test_what_generate_does_not_support_is_refused_in_one_line_naming_it(spec, kwargs, message):
    with pytest.raises(ValueError, match=message):
        spec.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize(
    "device_map", ["cuda", {"": "cuda:1"}, "mps" if not torch.backends.mps.is_available() else "cuda"]
)
def test_a_device_this_machine_lacks_is_one_line_before_loading(medusa_dir, device_map):
    """Was a raw AssertionError ('Torch not compiled with CUDA enabled') from deep inside the loading."""
    with pytest.raises(ValueError, match=r"no (CUDA|MPS) device is available here; use cpu$"):
        SpeculativeModel.from_pretrained(medusa_dir, device_map=device_map)


def test_from_pretrained_takes_transformers_loading_options(medusa_dir):
    spec = SpeculativeModel.from_pretrained(
        medusa_dir, torch_dtype=torch.bfloat16, attn_implementation="eager"
    )
    assert spec.model.dtype == torch.bfloat16 and spec.model.config._attn_implementation == "eager"
    assert next(spec.proposer.heads.parameters()).dtype == torch.bfloat16  # the drafter follows the target
    with pytest.raises(ValueError, match="dtype=torch.float32 and torch_dtype=torch.bfloat16 disagree"):
        SpeculativeModel.from_pretrained(medusa_dir, dtype=torch.float32, torch_dtype=torch.bfloat16)
    with pytest.raises(
        ValueError,
        match="EAGLE's tree options are draft_depth, draft_top_k, draft_total_tokens "
        r"\(use draft_top_k=\); sampling's top_k goes to generate",
    ):
        SpeculativeModel.from_pretrained(medusa_dir, top_k=4)
    with pytest.raises(ValueError, match="from_pretrained got an argument it does not take: low_cpu= "):
        SpeculativeModel.from_pretrained(medusa_dir, low_cpu=True)


def test_the_users_model_is_never_changed(medusa_dir, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    weight = model.get_output_embeddings().weight.detach().clone()
    with pytest.raises(ValueError, match="the model you passed is float32, not bfloat16, and it is not cast"):
        SpeculativeModel.from_pretrained(medusa_dir, model=model, dtype="bfloat16")
    with pytest.raises(ValueError, match="device_map places a target that from_pretrained loads"):
        SpeculativeModel.from_pretrained(medusa_dir, model=model, device_map="auto")
    spec = SpeculativeModel.from_pretrained(medusa_dir, model=model, device_map="cpu")
    out = spec.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, do_sample=False)
    model.eval()
    assert (
        out.tolist() == model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, do_sample=False).tolist()
    )
    model.train()
    spec.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    assert model.training and all(
        m.training for m in model.modules()
    )  # decoded in eval mode, its mode restored
    assert model.dtype == torch.float32 and torch.equal(model.get_output_embeddings().weight, weight)
