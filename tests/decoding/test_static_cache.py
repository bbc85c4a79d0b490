"""The target's KV cache is allocated once and written in place: a long generation never reallocates or
copies it (the storage stays where it was), a second generation reuses it, and what it holds after each
acceptance equals a plain run's cache."""

from types import SimpleNamespace

import pytest
import torch

from conftest import VOCAB, tiny_model
from medusa_heads import CHOICES, random_heads
from selfspec.infer.core.cache import PreallocatedCache, PreallocatedLayer, new_cache
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.core.mask import RowMask
from selfspec.infer.drafters.prompt_lookup import PromptLookupProposer
from selfspec.infer.drafters.proposers import MedusaProposer


def spec_model(model) -> SpeculativeModel:
    return SpeculativeModel(
        model, MedusaProposer(random_heads(model, scale=0.0), model.get_output_embeddings(), CHOICES)
    )


def watch_cache(monkeypatch) -> list[list[tuple[int, int, int]]]:
    """Record, after every acceptance, each layer's (key storage, value storage, filled length)."""
    seen = []
    keep = PreallocatedCache.keep_rows

    def recording(cache, src, dst, length):
        keep(cache, src, dst, length)
        seen.append(
            [
                (layer.key_buffer.data_ptr(), layer.value_buffer.data_ptr(), layer.length)
                for layer in cache.layers
            ]
        )

    monkeypatch.setattr(PreallocatedCache, "keep_rows", recording)
    return seen


def test_a_long_generation_never_reallocates_the_cache(monkeypatch):
    model = tiny_model("llama")
    spec = spec_model(model)
    seen = watch_cache(monkeypatch)
    prompt = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    out = spec.generate(prompt, max_new_tokens=300, eos_token_id=[])  # no EOS: all 300 tokens
    want = model.generate(prompt, max_new_tokens=300, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.tolist() == want.tolist()
    assert len(seen) > 50 and len(seen[0]) == model.config.num_hidden_layers
    assert {tuple(p[:2] for p in step) for step in seen} == {
        tuple(p[:2] for p in seen[0])
    }  # one storage throughout
    lengths = [step[0][2] for step in seen]
    assert lengths == sorted(lengths) and lengths[-1] >= 7 + 299  # the filled part grows, in the same buffers

    seen.clear()  # the next generation (no longer than the first) reuses the buffers
    spec.generate(prompt, max_new_tokens=40, eos_token_id=[])
    assert seen[0][0][:2] == (
        spec._cache.layers[0].key_buffer.data_ptr(),
        spec._cache.layers[0].value_buffer.data_ptr(),
    )
    assert spec._cache.layers[0].key_buffer.shape[2] >= 7 + 300


def test_an_emptied_layer_takes_states_of_another_shape_or_dtype():
    layer = PreallocatedLayer(8)
    layer.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    layer.reset()
    keys, values = layer.update(
        torch.full((3, 2, 2, 4), 2.0, dtype=torch.bfloat16), torch.zeros(3, 2, 2, 4, dtype=torch.bfloat16)
    )
    assert keys.shape == (3, 2, 2, 4) and keys.dtype == torch.bfloat16 and bool((keys == 2).all())
    assert layer.key_buffer.shape == (3, 2, 8, 4)


def test_writing_past_the_allocation_is_a_clear_error():
    layer = PreallocatedLayer(4)
    layer.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    try:
        layer.update(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8))
    except ValueError as err:
        assert "holds 4 positions but 5 were written" in str(err)
    else:
        raise AssertionError("writing past the buffers must fail")


def test_selected_rows_move_down_in_place_and_reset_brings_every_row_back():
    layer = PreallocatedLayer(8)
    states = torch.arange(4.0)[:, None, None, None].expand(4, 2, 3, 4).clone()  # row b holds b everywhere
    layer.update(states, -states)
    ptr = layer.key_storage.data_ptr()
    layer.select_rows([1, 3], torch.tensor([1, 3]))  # rows 0 and 2 stopped
    assert layer.keys.shape == (2, 2, 3, 4) and layer.get_seq_length() == 3
    assert layer.keys[:, 0, 0, 0].tolist() == [1.0, 3.0] and layer.values[:, 0, 0, 0].tolist() == [-1.0, -3.0]
    keys, _ = layer.update(torch.full((2, 2, 1, 4), 7.0), torch.zeros(2, 2, 1, 4))  # the next forward: 2 rows
    assert keys.shape == (2, 2, 4, 4) and keys[:, 0, :, 0].tolist() == [
        [1.0, 1.0, 1.0, 7.0],
        [3.0, 3.0, 3.0, 7.0],
    ]
    layer.select_rows([1], torch.tensor([1]))  # slot 1 (row 3) moves to slot 0
    assert layer.keys[:, 0, :, 0].tolist() == [[3.0, 3.0, 3.0, 7.0]]
    layer.select_rows([0], torch.tensor([0]))  # already in place: it stays as it is
    layer.key_storage[1] = -1.0  # a slot that left the batch
    assert layer.keys.shape[0] == 1 and layer.keys[:, 0, :, 0].tolist() == [[3.0, 3.0, 3.0, 7.0]]
    layer.reset()
    assert (
        layer.key_buffer.shape[0] == 4 and layer.key_buffer.data_ptr() == ptr == layer.key_storage.data_ptr()
    )


def test_a_row_mask_keeps_the_selected_rows():
    mask = RowMask(3, 2, 6, torch.float32, "cpu")
    mask.open(torch.tensor([0, 2, 4]), 5)  # row b sees columns start[b] .. 4
    mask.select_rows([2, 0], torch.tensor([2, 0]), 5)
    visible = (mask.at(5, torch.ones(2, 1, 1, dtype=torch.bool))[:, 0, 0] == 0).tolist()
    assert visible == [[False] * 4 + [True] * 2, [True] * 6]


def test_crop_and_reset_keep_the_buffers():
    model = tiny_model("llama")
    cache = new_cache(model, 32)
    with torch.no_grad():
        model(torch.randint(3, VOCAB, (1, 10)), cache=cache, use_cache=True)
    layer = cache.layers[0]
    ptr = layer.key_buffer.data_ptr()
    layer.crop(-4)
    assert layer.get_seq_length() == 6 and layer.keys.shape[2] == 6
    cache.reset()
    assert layer.get_seq_length() == 0 and layer.key_buffer.data_ptr() == ptr


# ------------------------------------------------------------------ devices


def test_a_drafter_on_another_device_is_a_clear_error():
    model = tiny_model("llama")
    heads = random_heads(model, scale=0.0).to("meta")
    with pytest.raises(
        ValueError, match="drafter's weights are on meta but the target's last layer is on cpu"
    ):
        SpeculativeModel(model, MedusaProposer(heads, model.get_output_embeddings(), CHOICES))


def test_a_generator_for_another_device_is_a_clear_error():
    """A CUDA generator with a CPU target (this machine has no GPU: a stand-in carries the device)."""
    spec = spec_model(tiny_model("llama"))
    cuda_generator = SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match="random generator is on cuda:0 but the target runs on cpu"):
        spec.generate(
            torch.tensor([[5, 6, 7]]),
            max_new_tokens=4,
            do_sample=True,
            temperature=1.0,
            generator=cuda_generator,
        )


def test_prompt_lookup_follows_the_context_device():
    """Prompt lookup makes its tensors where the context is (the target's device), whatever device it was
    built for."""
    lookup = PromptLookupProposer(num_tokens=3, device="meta")
    context = torch.tensor([4, 5, 6, 4, 5])
    draft = lookup.propose(context, torch.zeros(5, 8))
    assert draft.tokens.device == context.device and draft.tree.depths.device == context.device
    assert draft.tokens.tolist() == [5, 6, 4, 5]


def test_two_streams_decoding_at_once_do_not_share_a_cache():
    """A decode left open while another runs (two interleaved streams) keeps its own cache: both give the
    target's own greedy output."""
    model = tiny_model("llama")
    spec = spec_model(model)
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randint(3, VOCAB, (1, 6), generator=gen), torch.randint(3, VOCAB, (1, 9), generator=gen)
    spec.generate(a, max_new_tokens=40, eos_token_id=[])  # leaves a finished cache to be reused
    first, second = spec.decode(a, 40, eos_token_id=[]), spec.decode(b, 40, eos_token_id=[])
    got_a, got_b = [], []
    for step_a, step_b in zip(first, second):
        got_a += step_a
        got_b += step_b
    got_a += [t for step in first for t in step]
    got_b += [t for step in second for t in step]
    for prompt, got in ((a, got_a), (b, got_b)):
        want = model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got == want[0, prompt.shape[1] :].tolist()
