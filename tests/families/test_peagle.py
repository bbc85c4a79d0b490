"""P-EAGLE: one drafter forward drafts every depth; training computes what decoding computes; decoding is
lossless."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from peagle_drafts import peagle_config, random_draft
from recipe_args import argv, short_run
from sampling_checks import RUNS, V, chi_square, critical, exact_joint, run_sampling
from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import DraftCache, layer_fields
from selfspec.heads.peagle import PEagleDraft
from selfspec.heads.registry import load_heads
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.drafters.peagle import PEagleProposer, peagle_proposer


def plain_greedy(model, prompt, n):
    return model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)[
        0, prompt.shape[1] :
    ].tolist()


def fused_features(model, ids, layers):
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in layers], dim=-1)


@pytest.mark.parametrize(
    "variant", [{}, {"norm_before_residual": True, "norm_before_fc": True}], ids=["default", "norms"]
)
def test_training_depths_equal_the_decoding_forward_at_every_anchor(variant):
    """Depth j of the whole-sequence training forward at anchor t is what one decoding call computes for slot
    j after the pairs 0..t: same context, same position, same slots before it."""
    model = tiny_model("llama")
    draft = random_draft(model, size=0, **variant).double()
    embed = model.get_input_embeddings().double()
    ids = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    feats = fused_features(model.double(), ids, draft.config.feature_layers)[:, :-1]
    T, depths = 9, 4
    context = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        outs = draft(feats, ids[:, 1:], embed, context, None, depths=depths)
        for t in range(T):
            cache = DraftCache.for_drafter(draft, T + depths)
            positions = torch.arange(t + depths)[None]
            one = draft(
                draft.fuse(feats[:, : t + 1]),
                ids[:, 1 : t + 2],
                embed,
                None,
                positions,
                cache,
                slots=depths - 1,
            )
            for j in range(depths):
                torch.testing.assert_close(outs[j][0, t], one[0, t + j], atol=1e-6, rtol=1e-5)


def test_anchors_limit_a_depth_to_its_positions_with_the_same_values():
    model = tiny_model("llama")
    draft = random_draft(model, size=0)
    ids = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(2))
    feats = fused_features(model, ids, draft.config.feature_layers)[:, :-1]
    context = torch.ones(7, 7, dtype=torch.bool).tril()[None, None].expand(2, 1, 7, 7)
    keep = torch.rand(2, 7, generator=torch.Generator().manual_seed(3)) < 0.5
    with torch.no_grad():
        dense = draft(feats, ids[:, 1:], model.get_input_embeddings(), context, None, depths=3)
        sparse = draft(
            feats,
            ids[:, 1:],
            model.get_input_embeddings(),
            context,
            None,
            depths=3,
            anchors=[None, keep, keep],
        )
    torch.testing.assert_close(sparse[0], dense[0])
    for j in (1, 2):
        torch.testing.assert_close(sparse[j][keep], dense[j][keep], atol=1e-6, rtol=1e-6)
        assert not sparse[j][~keep].any()


@pytest.mark.parametrize("shape", [dict(), dict(top_k=3, total_tokens=10, depth=4)], ids=["chain", "tree"])
def test_greedy_identical_to_generate_with_a_random_peagle_drafter(model, shape):
    spec = SpeculativeModel(model, peagle_proposer(random_draft(model), model, **shape))
    gen = torch.Generator().manual_seed(5)
    for length in (1, 6):
        prompt = torch.randint(4, 96, (1, length), generator=gen)
        for n in (1, 3, 30):
            assert spec.generate(prompt, max_new_tokens=n)[0, length:].tolist() == plain_greedy(
                model, prompt, n
            )


def trained_draft(model, prompts, steps=200) -> PEagleDraft:
    """A P-EAGLE drafter of 4 depths trained with the recipe's own loss on the model's greedy
    continuations."""
    from conftest import fit_on_own_continuations
    from selfspec.train.methods.peagle import PEagleMethod
    from selfspec.train.recipes.peagle import PEagleConfig

    draft = random_draft(model, size=0, seed=2)
    for name, p in draft.named_parameters():
        torch.nn.init.ones_(p) if name.endswith("norm.weight") else torch.nn.init.normal_(p, std=0.02)
    method = PEagleMethod(PEagleConfig(depths=4), model, draft.train(), [])
    return fit_on_own_continuations(model, prompts, method, steps=steps, lr=3e-3)


@pytest.mark.parametrize("shape", [dict(), dict(top_k=2, total_tokens=8, depth=5)], ids=["chain", "tree"])
def test_batched_rows_with_left_padding_equal_generate(shape):
    model = tiny_model("qwen2")
    prompts = torch.randint(4, 96, (3, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0
    mask[2, :5] = 0
    prompts = prompts.masked_fill(mask == 0, 0)
    spec = SpeculativeModel(model, peagle_proposer(random_draft(model), model, **shape))
    out = spec.generate(prompts, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    ref = model.generate(prompts, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert out.tolist() == ref.tolist()


def test_drafter_cache_holds_exactly_the_confirmed_context():
    """After decoding, the drafter's cache equals one plain call over every confirmed pair: no slot column
    stays, none is missing."""
    model = tiny_model("llama")
    prompts = torch.randint(4, 96, (4, 6), generator=torch.Generator().manual_seed(7))
    draft = trained_draft(model, prompts)
    prop = peagle_proposer(draft, model)
    spec = SpeculativeModel(model, prop)
    prompt = prompts[:1]  # what it was trained on: some drafts pass
    out = spec.generate(prompt, max_new_tokens=30, eos_token_id=[])
    assert spec.last_stats.decode_steps > 1 and max(spec.last_stats.accepted_drafts) > 1
    n = prop.lengths[0]
    confirmed = out[:, : n + 1]
    with torch.no_grad():
        fused = fused_features(model, confirmed, draft.config.feature_layers)[:, :-1]
        plain = DraftCache.for_drafter(draft, n)
        draft(draft.fuse(fused), confirmed[:, 1:], model.get_input_embeddings(), None, None, plain)
    torch.testing.assert_close(prop.cache.keys[:, :, :, :n], plain.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prop.cache.values[:, :, :, :n], plain.values, atol=1e-5, rtol=1e-5)


def test_many_confirmed_pairs_at_once_fill_the_cache_as_one_plain_call():
    """Fed more confirmed pairs in one call than its mask has query rows (lookup-first feeds every token
    confirmed while prompt lookup drafted), the drafter's cache still equals one plain call over all of
    them."""
    from selfspec.infer.core.verify import SamplingParams

    model = tiny_model("llama")
    draft = random_draft(model)
    prop = peagle_proposer(draft, model)
    ids = torch.randint(4, 96, (1, 31), generator=torch.Generator().manual_seed(3))
    fused = fused_features(model, ids, draft.config.feature_layers)[0]  # (31, nH)
    prop.start(1, 64, SamplingParams(), [None])
    prop.propose([True], [ids[0, :6]], [fused[:5]])  # the prompt's 5 pairs
    assert prop.mask.buffer.shape[-2] < 25
    prop.propose([True], [ids[0]], [fused[5:30]])  # 25 pairs at once
    with torch.no_grad():
        plain = DraftCache.for_drafter(draft, 30)
        draft(draft.fuse(fused[None, :30]), ids[:, 1:], model.get_input_embeddings(), None, None, plain)
    assert prop.lengths == [30]
    torch.testing.assert_close(prop.cache.keys[:, :, :, :30], plain.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prop.cache.values[:, :, :, :30], plain.values, atol=1e-5, rtol=1e-5)


def test_slot_inputs_follow_edited_weights_while_decoding():
    """Decoding reuses fc(mask_hidden) between steps, but never after the weights change in place."""
    draft = random_draft(tiny_model("llama"))
    with torch.no_grad():
        first, _ = draft.slot_inputs(torch.float32)
        assert draft.slot_inputs(torch.float32)[0] is first  # reused
        draft.mask_hidden.add_(1.0)
        again, _ = draft.slot_inputs(torch.float32)
        torch.testing.assert_close(again, draft.fc(draft.mask_hidden))
        draft.fc.weight.mul_(2.0)
        torch.testing.assert_close(draft.slot_inputs(torch.float32)[0], draft.fc(draft.mask_hidden))
    assert draft.slot_inputs(torch.float32)[
        0
    ].requires_grad  # training: through autograd, never the cached one


@pytest.mark.parametrize("shape", [dict(), dict(top_k=3, total_tokens=6, depth=3)], ids=["chain", "tree"])
def test_peagle_sampling_matches_the_target_distribution(shape):
    model = tiny_model("llama", vocab=V, seed=5, scale=0.08)
    c = model.config
    cfg = HeadsConfig(
        kind="peagle",
        hidden_size=c.hidden_size,
        vocab_size=V,
        layer=layer_fields(c),
        feature_layers=[1],
        mask_token_id=7,
        depth=3,
        top_k=1,
        total_tokens=3,
    )
    torch.manual_seed(5)
    spec = SpeculativeModel(model, peagle_proposer(PEagleDraft(cfg).eval(), model, **shape))
    prompt = torch.tensor([[3, 1, 4, 1, 5, 3, 1, 4, 1]])
    accepted = []
    counts = run_sampling(spec, prompt, (1.0, 0, 1.0), accepted)
    stat, dof = chi_square(counts, exact_joint(model, prompt, (1.0, 0, 1.0)), RUNS)
    assert stat < critical(dof), (
        f"chi2 {stat:.1f} with {dof} dof: the sampled distribution is not the target's"
    )
    assert sum(a > 0 for a in accepted) > RUNS // 100


def test_save_and_load_round_trip_through_the_registry(tmp_path):
    model = tiny_model("llama")
    draft = random_draft(model)
    draft.save_pretrained(tmp_path / "d")
    loaded = load_heads(tmp_path / "d")
    assert type(loaded) is PEagleDraft
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    prompt = torch.randint(4, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    a = SpeculativeModel(model, peagle_proposer(draft, model)).generate(prompt, max_new_tokens=12)
    b = SpeculativeModel(model, peagle_proposer(loaded, model)).generate(prompt, max_new_tokens=12)
    assert a.tolist() == b.tolist()


def test_bad_peagle_configs_and_trees_are_refused_in_one_line():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="mask_token_id"):
        peagle_config(model, mask_token_id=None)
    with pytest.raises(ValueError, match="feature_layers"):
        HeadsConfig(
            kind="peagle", hidden_size=8, vocab_size=96, layer={"num_attention_heads": 2}, mask_token_id=3
        )
    draft = random_draft(model, size=5)
    with pytest.raises(ValueError, match="fewer than its top_k 8"):
        PEagleProposer(draft, model.get_input_embeddings(), top_k=8)
    with pytest.raises(ValueError, match="not `tree`"):
        peagle_proposer(draft, model, tree=[[0]])


def test_depth_subsampling_keeps_a_shrinking_nested_share_of_positions():
    from selfspec.train.methods.peagle import subsampled

    valid = torch.ones(64, 256, dtype=torch.bool)
    valid[:, 200:] = False
    anchors = subsampled(valid, 6, 0.7, 0.2, torch.Generator().manual_seed(0))
    assert anchors[0] is None
    previous, share = valid, 1.0
    for d in range(1, 6):
        assert not (anchors[d] & ~previous).any()  # nested: a depth trains where the one before it did
        share *= max(0.7**d, 0.2)
        assert abs(anchors[d].sum() / valid.sum() - share) < 0.02, d
        previous = anchors[d]


def test_training_teaches_every_depth_and_decoding_stays_exact(arch):
    model = tiny_model(arch)
    prompts = torch.randint(4, 96, (4, 6), generator=torch.Generator().manual_seed(7))
    draft = trained_draft(model, prompts)
    taus = {}
    for name, shape in (
        ("chain", dict(depth=4, top_k=1, total_tokens=4)),
        ("tree", dict(depth=4, top_k=3, total_tokens=12)),
    ):
        spec = SpeculativeModel(model, peagle_proposer(draft, model, **shape))
        for i, length in enumerate((6, 3)):
            prompt = prompts[i : i + 1, :length]
            out = spec.generate(prompt, max_new_tokens=40, eos_token_id=[])
            ref = model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=[])
            assert out.tolist() == ref.tolist()
            taus[name, i] = spec.last_stats.tau
    # trained: drafts pass (an untrained drafter stays at 1.0 here). The margin is for the threads: gpt2
    # reaches 1.30 or 1.34 depending on the thread pool an earlier test left behind
    assert max(taus.values()) > 1.25, taus


def _args(model_dir, data, out, **extra):
    chain = {"depths": 3, "depth": 3, "top_k": 1, "total_tokens": 3}
    return argv(short_run(model_dir, data, out, **(chain | extra)))


def test_the_recipe_trains_saves_and_resumes_like_an_uninterrupted_run(
    tiny_model_dir, text_data, tmp_path, monkeypatch
):
    from conftest import check_resume
    from selfspec.train.loop.config import load_config
    from selfspec.train.methods.peagle import PEagleMethod
    from selfspec.train.peagle import run
    from selfspec.train.recipes.peagle import PEagleConfig

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    result = run(load_config(PEagleConfig, _args(tiny_model_dir, text_data, tmp_path / "p", max_steps=10)))
    history = result["history"]
    assert history[-1][1]["loss"] < history[0][1]["loss"]
    loaded = load_heads(tmp_path / "p")
    assert type(loaded) is PEagleDraft and loaded.config.mask_token_id is not None
    assert (loaded.config.depth, loaded.config.top_k, loaded.config.total_tokens) == (3, 1, 3)
    assert "per depth" in (tmp_path / "p" / "README.md").read_text()

    torch.manual_seed(0)  # the subsampling draws from the global generator, seeded by the run alike each time

    def run_to(out, **extra):
        return run(load_config(PEagleConfig, _args(tiny_model_dir, text_data, out, **extra)))

    check_resume(monkeypatch, PEagleMethod, run_to, tmp_path / "resume", "draft")


def test_the_recipe_refuses_bad_options_in_one_line():
    from selfspec.train.loop.config import ConfigError, load_config
    from selfspec.train.recipes.peagle import PEagleConfig

    with pytest.raises(ConfigError, match="--cod_ratio"):
        load_config(PEagleConfig, ["--cod_ratio", "1.5"])
    with pytest.raises(ConfigError, match="all of depth, top_k and total_tokens"):
        load_config(PEagleConfig, ["--depth", "4"])


@pytest.mark.parametrize("fmt", ["peagle", "speculators-peagle"])
def test_export_detect_and_import_round_trip(fmt, tmp_path):
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from conftest import randomized, tiny_config
    from selfspec.heads.formats import detect_format, export_heads, import_heads

    config = tiny_config("llama")
    config.num_hidden_layers = (
        8  # three distinct fused layers [2, 4, 5]: what vLLM builds a speculators fc for
    )
    torch.manual_seed(0)
    model = randomized(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"))
    draft = random_draft(model, size=40)
    export_heads(
        draft, fmt, tmp_path / fmt, model, base_model="org/target" if fmt.startswith("speculators") else None
    )
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    weights = load_file(str(tmp_path / fmt / "model.safetensors"))
    assert config["mask_token_id"] == draft.config.mask_token_id
    assert weights["mask_hidden"].shape == (1, draft.fc.in_features)
    embed = model.get_input_embeddings().weight.detach()
    rows = torch.arange(embed.shape[0]) != draft.config.mask_token_id
    assert torch.equal(
        weights["embed_tokens.weight"][rows], embed[rows]
    )  # the target's, but for the mask row
    assert torch.equal(
        weights["embed_tokens.weight"][draft.config.mask_token_id], draft.mask_embedding.detach()
    )
    if fmt == "speculators-peagle":
        assert (
            config["speculators_model_type"] == "peagle"
            and config["speculators_config"]["algorithm"] == "peagle"
        )
    assert detect_format(tmp_path / fmt) == fmt
    loaded = import_heads(tmp_path / fmt)
    assert type(loaded) is PEagleDraft
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    prompt = torch.randint(4, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    a = SpeculativeModel(model, peagle_proposer(draft, model)).generate(prompt, max_new_tokens=12)
    b = SpeculativeModel(model, peagle_proposer(loaded, model)).generate(prompt, max_new_tokens=12)
    assert a.tolist() == b.tolist()


def test_export_needs_the_target_for_its_embedding(tmp_path):
    from selfspec.heads.formats import export_heads

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="give the target"):
        export_heads(random_draft(model), "peagle", tmp_path / "x", None)


def test_the_cli_exports_and_imports_a_peagle_drafter(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from selfspec.infer.cli.commands import main as cli

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    draft = random_draft(model, size=40)
    draft.config.base_model = str(tiny_model_dir)
    draft.save_pretrained(tmp_path / "d")
    cli(["export", "--heads", str(tmp_path / "d"), "--format", "peagle", "--out", str(tmp_path / "e")])
    cli(
        [
            "import",
            "--src",
            str(tmp_path / "e"),
            "--out",
            str(tmp_path / "back"),
            "--base-model",
            str(tiny_model_dir),
        ]
    )
    back = load_heads(tmp_path / "back")
    assert type(back) is PEagleDraft
    for name, tensor in draft.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
