"""`compile=True`: tree verification through torch.compile with fixed shapes gives the same tokens, and does
not recompile step by step."""

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from batch_rows import drafter, left_padded
from conftest import VOCAB, tiny_model
from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.infer.core import target as target_module
from selfspec.infer.core.decode_step import FixedShapes
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.core.mask import RowMask
from selfspec.infer.drafters.eagle import EagleProposer


def plain(model, prompt, n):
    return model.generate(prompt[None], max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)[
        0, prompt.numel() :
    ].tolist()


def test_compiled_verification_equals_generate_and_compiles_once_per_shape():
    model = tiny_model("llama")
    spec = SpeculativeModel(model, drafter(model, "medusa"), compile=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (7, 3)]
    out = spec.generate(prompts[0][None], max_new_tokens=40, eos_token_id=[])
    assert out[0, 7:].tolist() == plain(model, prompts[0], 40)
    assert spec.last_stats.decode_steps > 5
    graphs = counters["stats"]["unique_graphs"]
    out = spec.generate(
        prompts[1][None], max_new_tokens=30, eos_token_id=[]
    )  # fits the same cache: no recompile
    assert out[0, 3:].tolist() == plain(model, prompts[1], 30)
    assert counters["stats"]["unique_graphs"] == graphs
    assert (id(model), 1, spec.proposer.max_nodes, 256) in target_module.COMPILED_SHAPES
    ids, mask = left_padded(prompts)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[])
    for b, p in enumerate(prompts):
        assert out[b, ids.shape[1] :].tolist() == plain(model, p, 20)


def test_compiled_verification_reads_eagle3_features():
    """The drafter gets the same fused layers from the compiled forward as from the eager one."""
    model = tiny_model("qwen2")
    prompt = torch.randint(3, VOCAB, (5,), generator=torch.Generator().manual_seed(1))
    seen = {}
    for compiled in (True, False):
        torch.manual_seed(0)
        config = HeadsConfig(
            kind="eagle3",
            hidden_size=48,
            vocab_size=VOCAB,
            layer=layer_fields(model.config),
            feature_layers=[0, 1],
        )  # both layers' inputs: the embeddings and layer 0's output
        embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        spec = SpeculativeModel(
            model, EagleProposer(Eagle3Draft(config).eval(), embed, lm_head), compile=compiled
        )
        propose, seen[compiled] = spec.proposer.propose, []

        def recording(active, contexts, hiddens, propose=propose, record=seen[compiled]):
            record.append(hiddens[0].clone())
            return propose(active, contexts, hiddens)

        spec.proposer.propose = recording
        out = spec.generate(prompt[None], max_new_tokens=12, eos_token_id=[])
        assert out[0, 5:].tolist() == plain(model, prompt, 12)
    assert len(seen[True]) == len(seen[False]) > 5
    assert seen[True][1].shape[-1] == 2 * 48  # two layers, fused by the drafter
    for a, b in zip(seen[True], seen[False]):
        assert torch.allclose(a, b, atol=1e-5)


def test_reduce_overhead_mode_decodes_greedily_as_generate_over_static_buffers():
    """The mode CUDA graphs come with (`Target.compile("reduce-overhead")`): on the CPU the same compiled code
    without graphs. Its inputs stay graph-ready: the cache's and the mask's buffers are static addresses (CUDA
    graphs read them in place instead of copying them in per replay), and a cache width is a multiple of
    16."""
    model = tiny_model("llama")
    spec = SpeculativeModel(
        model, drafter(model, "medusa"), compile="reduce-overhead"
    )  # --compile reduce-overhead
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(4)) for n in (6, 2)]
    ids, mask = left_padded(prompts)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[])
    for b, p in enumerate(prompts):
        assert out[b, ids.shape[1] :].tolist() == plain(model, p, 24)
    assert max(spec.last_stats.accept_lengths) > 1
    cache = spec._cache
    assert cache.max_length % 16 == 0
    static = [
        getattr(t, "_dynamo_static_input_type", None)
        for layer in cache.layers
        for t in (layer.key_storage, layer.value_storage)
    ]
    assert len(static) == 2 * len(cache.layers) and None not in static
    assert (
        getattr(RowMask(2, 4, 32, torch.float32, "cpu").storage, "_dynamo_static_input_type", None)
        is not None
    )


def test_the_compile_option_takes_a_mode():
    from selfspec.infer.cli.commands import COMMANDS
    from selfspec.infer.cli.options import build_parser

    parse = build_parser(COMMANDS).parse_args
    assert parse(["bench", "--compile", "reduce-overhead"]).compile == "reduce-overhead"
    assert parse(["bench", "--compile", "--json", "x.json"]).compile == "default"
    assert parse(["bench"]).compile is None
    with pytest.raises(SystemExit):
        parse(["bench", "--compile", "fastest"])


def test_compiled_cache_lengths_double_so_a_session_compiles_a_few_times():
    lengths = [FixedShapes().cache_length(n) for n in (1, 256, 257, 600, 1500, 4000)]
    assert lengths == [256, 256, 512, 1024, 2048, 4096]


def test_the_last_shape_torch_compile_compiles_is_announced_once(monkeypatch):
    """Past torch._dynamo's recompile limit the verify would run eagerly without a word: the shape that
    reaches the limit warns, naming the shapes and the fix; shapes seen before and the later ones stay
    quiet."""
    monkeypatch.setattr(target_module, "COMPILED_SHAPES", set())
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for shape in [(0, 1, 8, 256), (0, 1, 8, 256), (0, 2, 8, 256), (0, 1, 8, 512), (0, 4, 8, 512)]:
            target_module.note_compiled_shape(shape)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "3 shapes" in message and "(2, 256)" in message and "recompile_limit" in message
