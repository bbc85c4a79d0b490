"""Kernel launches per decode step outside the target's forward (infer/measure/launches.py): keeping the
accepted path is one gather and one scatter over every layer's keys and values together, not four launches per
layer, so the count does not grow with the number of layers."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import dflash_drafts
from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.fused_draft import default_feature_layers
from selfspec.heads.medusa import MedusaHeads
from selfspec.infer.core.cache import PreallocatedCache, new_cache
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.core.loading import proposer_for
from selfspec.infer.drafters.prompt_lookup import PromptLookupProposer
from selfspec.infer.drafters.proposers import MedusaProposer, NoDraft, default_medusa_choices
from selfspec.infer.measure.launches import LaunchCounter


def llama(layers: int) -> LlamaForCausalLM:
    """Llama-3.1-8B's attention structure (32 query / 8 key-value heads), narrow."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=8,
        vocab_size=256,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


def outside_per_step(model, batch: int, drafter=None, **options) -> float:
    prompt = torch.randint(3, 256, (batch, 12), generator=torch.Generator().manual_seed(batch))
    spec = SpeculativeModel(model, drafter or PromptLookupProposer(num_tokens=4, max_ngram=2))
    with LaunchCounter(model).counting() as counter:
        spec.generate(prompt, max_new_tokens=24, eos_token_id=[], pad_token_id=0, **options)
    return counter.outside / spec.last_stats.target_forwards


def test_launches_outside_the_forward_do_not_grow_with_the_layers():
    per_step = {layers: outside_per_step(llama(layers), 1) for layers in (4, 32)}
    assert per_step[32] <= per_step[4] + 2, per_step  # was 4 launches a layer: +112 from 4 to 32 layers
    assert per_step[32] <= 60, per_step


def test_the_layers_share_one_storage_and_commit_together():
    model = llama(4)
    cache = new_cache(model, 32)
    ids = torch.randint(3, 256, (2, 9))
    model(ids, past_key_values=cache, use_cache=True)
    assert cache.storage.holds(cache.layers) and cache.storage.keys.shape[:2] == (4, 2)
    plain = PreallocatedCache(32)  # no layer count: each layer its own buffers, committed layer by layer
    model(ids, past_key_values=plain, use_cache=True)
    assert not plain.storage.holds(plain.layers)
    src, dst = torch.tensor([[2, 5, 7], [1, 4, 8]]), torch.tensor([[2, 3, 4], [1, 2, 3]])
    cache.keep_rows(src, dst, 5)
    plain.keep_rows(src, dst, 5)
    for a, b in zip(cache.layers, plain.layers):
        assert a.length == b.length == 5
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    index = torch.tensor([1])
    cache.select_rows([1], index)
    plain.select_rows([1], index)
    for a, b in zip(cache.layers, plain.layers):
        assert torch.equal(a.keys, b.keys) and a.keys.shape[0] == 1


def random_eagle3(model: LlamaForCausalLM) -> Eagle3Draft:
    """An EAGLE-3 drafter with weights drawn at random (norms near 1): its trees are as wide as trained
    ones'."""
    torch.manual_seed(1)
    config = model.config
    draft = Eagle3Draft(
        HeadsConfig(
            kind="eagle3",
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            layer=layer_fields(config),
            draft_vocab_size=128,
            feature_layers=default_feature_layers(config.num_hidden_layers),
        )
    )
    with torch.no_grad():
        for name, weight in draft.named_parameters():
            torch.nn.init.normal_(weight, mean=1.0 if "norm" in name else 0.0, std=0.05)
    draft.set_draft_vocab(torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(0))[:128])
    return draft.eval()


def test_eagle_tree_selection_launches_do_not_grow_with_the_batch():
    """EAGLE-2's selection runs for every row at once: batch 8 launches what batch 1 does (it was 94 launches
    a row: 1,316 against 652 per step at depth 6, top-k 10, 60 nodes)."""
    model = llama(4)
    draft = random_eagle3(model)
    per_step = {
        batch: outside_per_step(model, batch, proposer_for(draft, model, depth=6, top_k=10, total_tokens=60))
        for batch in (1, 8)
    }
    assert per_step[8] <= 1.1 * per_step[1], per_step


def test_eagle3_and_dflash_steps_on_a_32_layer_target():
    """The issue's trees on Llama-3.1-8B's structure, batch 1 and 8, within the issue's goals of launches a
    step outside the forward: DFlash (5 layers, a chain of 15) 300, measured 241; EAGLE-3 (depth 6, top-k 10,
    60 nodes) 400, measured 389 and 398 (was 559, then 475: q/k/v and gate/up as one matmul each, the two
    input norms as one, the tree built and accepted in fewer kernels; docs/results/launches.md). Batch 8
    launches what batch 1 does, plus the moves of rows that accepted different lengths (about 10)."""
    model = llama(32)
    eagle3 = proposer_for(random_eagle3(model), model, depth=6, top_k=10, total_tokens=60)
    dflash = proposer_for(dflash_drafts.random_draft(model, block=16, layers=5, qk_norm=False), model)
    for drafter, bound in ((eagle3, 400), (dflash, 250)):
        per_step = {batch: outside_per_step(model, batch, drafter) for batch in (1, 8)}
        assert max(per_step.values()) <= bound, (drafter.name, per_step)
        assert per_step[8] <= 1.05 * per_step[1], (drafter.name, per_step)


def random_medusa(model: LlamaForCausalLM) -> MedusaProposer:
    """Five random Medusa heads in a 64-node tree."""
    torch.manual_seed(2)
    heads = MedusaHeads(HeadsConfig(kind="medusa", hidden_size=64, vocab_size=256, num_heads=5))
    with torch.no_grad():
        for weight in heads.parameters():
            torch.nn.init.normal_(weight, std=0.05)
    return MedusaProposer(heads, model.get_output_embeddings(), default_medusa_choices(5, num_nodes=63))


def test_medusa_steps_launch_as_few_as_plain_decoding_plus_a_handful():
    """The five heads run as one batched matmul per layer and one for their projections (they were four
    launches a head): a 64-node tree on 32 layers stays within the 60 launches a step outside the forward."""
    model = llama(32)
    per_step = {batch: outside_per_step(model, batch, random_medusa(model)) for batch in (1, 8)}
    assert max(per_step.values()) <= 60, per_step  # was 72 at batch 1, 78 at batch 8


def test_sampled_acceptance_launches_do_not_grow_with_the_batch():
    """Point proposals are accepted by sampling for every row at once (it was one acceptance per row: 432
    launches a step at batch 8 against 91 at batch 1); a row with a generator of its own adds its two draws
    (four launches), not a whole acceptance (about 43)."""
    model = llama(4)
    sampled = dict(do_sample=True, temperature=1.0)
    per_step = {batch: outside_per_step(model, batch, random_medusa(model), **sampled) for batch in (1, 8)}
    assert per_step[8] <= 1.1 * per_step[1], per_step
    seeded = [torch.Generator().manual_seed(b) for b in range(8)]
    with_generators = outside_per_step(model, 8, random_medusa(model), generator=seeded, **sampled)
    assert with_generators <= per_step[1] + 4 * 8 + 8, (with_generators, per_step)


def test_plain_steps_move_nothing_in_the_cache(monkeypatch):
    """A tree of the root alone is written where every row ends: the commit counts it as filled instead of
    gathering and scattering every layer's keys and values (the plain loop's bookkeeping against
    `generate`'s); trees of several nodes still move their accepted path."""
    moves = []
    keep_rows = PreallocatedCache.keep_rows
    monkeypatch.setattr(
        PreallocatedCache, "keep_rows", lambda self, *a: moves.append(a[0].shape) or keep_rows(self, *a)
    )
    model = llama(2)
    prompt = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = SpeculativeModel(model, NoDraft()).generate(
        prompt, max_new_tokens=12, eos_token_id=[], pad_token_id=0
    )
    assert torch.equal(out, expected) and moves == []
    SpeculativeModel(model, PromptLookupProposer(num_tokens=4, max_ngram=2)).generate(
        prompt, max_new_tokens=12, eos_token_id=[], pad_token_id=0
    )
    assert moves
