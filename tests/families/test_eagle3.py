"""EAGLE-3 drafter: the training-time test equals inference, the draft vocabulary maps back, RoPE stays
fp32."""

import copy

import pytest
import torch

from conftest import fit_on_own_continuations, prefill_one, propose_one, tiny_model
from eagle3_drafts import eagle3_config, random_draft, reduced_draft
from sampling_checks import RUNS, V, chi_square, critical, exact_joint, run_sampling
from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import DraftCache, layer_fields
from selfspec.heads.eagle import EagleDraft
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.fused_draft import default_feature_layers
from selfspec.heads.registry import load_heads
from selfspec.infer.core.cache import new_cache
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.core.target import Target
from selfspec.infer.drafters.eagle import EagleProposer
from selfspec.train.loop.config import ConfigError
from selfspec.train.methods.eagle import Eagle3Method
from selfspec.train.recipes.eagle import EagleConfig, build_drafter


def test_default_feature_layers_are_low_middle_high_and_never_the_normed_last():
    assert default_feature_layers(32) == [2, 16, 29]
    assert default_feature_layers(8) == [2, 4, 5]
    assert all(0 < i < 4 for i in default_feature_layers(4))


VARIANTS = [
    {},
    {"norm_before_residual": True},
    {"norm_before_fc": True},
    {"norm_before_residual": True, "norm_before_fc": True},
]
VARIANT_IDS = ["+".join(v) or "default" for v in VARIANTS]


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("steps", [1, 3, 5])
def test_training_time_test_sees_what_inference_sees_after_i_own_steps(steps, variant):
    model = tiny_model("llama")
    draft = random_draft(model, **variant)
    embed = model.get_input_embeddings()
    T, H = 9, model.config.hidden_size
    torch.manual_seed(1)
    features = torch.randn(1, T, len(draft.config.feature_layers) * H)
    ids = torch.randint(0, model.config.vocab_size, (1, T))
    with torch.no_grad():
        unrolled = draft.unrolled(features, ids, embed, torch.ones(1, T), steps)
        for t in range(T - steps):
            cache = DraftCache.for_drafter(draft, T + steps)
            out = draft(draft.fuse(features[:, : t + 1]), ids[:, : t + 1], embed, cache=cache)[:, -1:]
            torch.testing.assert_close(unrolled[0][:, t], out[:, 0], atol=1e-5, rtol=1e-5)
            for i in range(1, steps):  # step i reads its own step-(i-1) output and the true token x_{t+1+i}
                out = draft(out, ids[:, t + i : t + i + 1], embed, cache=cache)
                torch.testing.assert_close(unrolled[i][:, t], out[:, 0], atol=1e-5, rtol=1e-5)


def without(draft: Eagle3Draft, flag: str) -> Eagle3Draft:
    """The same weights computing the drafter without `flag` (norm_before_fc: no input_norm)."""
    other = copy.deepcopy(draft)
    if flag == "norm_before_fc":
        other.input_norm = None
    else:
        other.midlayer.norm_before_residual = False
    return other


@pytest.mark.parametrize("flag", ["norm_before_residual", "norm_before_fc"])
def test_each_variant_flag_changes_training_and_inference_alike(flag):
    """What the flags parametrizing the test above change: both the unrolled steps and the plain forward."""
    model = tiny_model("llama")
    draft = random_draft(model, **{flag: True})
    assert ("input_norm.weight" in draft.state_dict()) == (flag == "norm_before_fc")
    assert getattr(draft.config, flag) and draft.midlayer.norm_before_residual == (
        flag == "norm_before_residual"
    )
    plain, embed, T = without(draft, flag), model.get_input_embeddings(), 7
    torch.manual_seed(1)
    features = torch.randn(1, T, len(draft.config.feature_layers) * model.config.hidden_size)
    ids = torch.randint(0, model.config.vocab_size, (1, T))
    with torch.no_grad():
        for a, b in zip(
            draft.unrolled(features, ids, embed, torch.ones(1, T), 2),
            plain.unrolled(features, ids, embed, torch.ones(1, T), 2),
            strict=True,
        ):
            assert not torch.allclose(a, b, atol=1e-3)
        assert not torch.allclose(
            draft(draft.fuse(features), ids, embed), plain(plain.fuse(features), ids, embed), atol=1e-3
        )


def test_training_builds_the_variant_and_trains_its_norm():
    model = tiny_model("llama")
    flags = {"norm_before_residual": True, "norm_before_fc": True}
    cfg = EagleConfig(version=3, ttt_steps=2, draft_vocab_size=model.config.vocab_size, **flags)
    draft = build_drafter(cfg, model, {})
    assert {f: getattr(draft.config, f) for f in flags} == flags
    assert draft.input_norm.weight.shape == (len(draft.config.feature_layers) * model.config.hidden_size,)
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids).bool(),
    }
    loss, _ = Eagle3Method(cfg, model, draft, []).loss(batch)
    loss.backward()
    assert draft.input_norm.weight.grad is not None and draft.input_norm.weight.grad.abs().sum() > 0
    for flag in flags:
        with pytest.raises(ConfigError, match=f"--{flag} is an EAGLE-3 variant: add --version 3"):
            build_drafter(EagleConfig(version=1, **{flag: True}), model, {})


def test_variant_flags_are_eagle3_only_and_typed():
    with pytest.raises(
        ValueError, match=r"norm_before_fc is for EAGLE-3 and P-EAGLE drafters \(medusa drafters"
    ):
        HeadsConfig(kind="medusa", norm_before_fc=True)
    with pytest.raises(ValueError, match=r"norm_before_residual must be bool, got 'true'"):
        HeadsConfig(kind="eagle3", layer={"x": 1}, feature_layers=[1], norm_before_residual="true")
    assert HeadsConfig.from_dict(
        eagle3_config(tiny_model("llama"), norm_before_fc=True).to_dict()
    ).norm_before_fc


def test_padding_never_reaches_a_valid_position():
    model = tiny_model("llama")
    draft = random_draft(model)
    embed = model.get_input_embeddings()
    torch.manual_seed(2)
    features = torch.randn(2, 8, len(draft.config.feature_layers) * model.config.hidden_size)
    ids = torch.randint(0, 96, (2, 8))
    mask = torch.ones(2, 8)
    mask[1, 5:] = 0
    changed_ids, changed_features = ids.clone(), features.clone()
    changed_ids[1, 5:] = 7
    changed_features[1, 5:] = 3.0
    with torch.no_grad():
        a = draft.unrolled(features, ids, embed, mask, 3)
        b = draft.unrolled(changed_features, changed_ids, embed, mask, 3)
    for i in range(3):  # step i at t reads tokens up to t + i: only t + i < 5 is independent of the padding
        torch.testing.assert_close(a[i][1, : 5 - i], b[i][1, : 5 - i])


def test_draft_vocabulary_maps_every_draft_id_to_its_target_id():
    model = tiny_model("llama")
    draft = random_draft(model, draft_vocab_size=17)
    chosen = torch.randperm(96, generator=torch.Generator().manual_seed(3))[:17]
    draft.set_draft_vocab(chosen)
    assert draft.d2t.dtype == torch.long and draft.d2t.shape == (17,)
    assert draft.t2d.dtype == torch.bool and draft.t2d.shape == (96,)
    assert draft.to_target(torch.arange(17)).tolist() == sorted(chosen.tolist())
    assert draft.t2d.nonzero().flatten().tolist() == sorted(chosen.tolist())
    with pytest.raises(ValueError, match="need 17 distinct target ids"):
        draft.set_draft_vocab(torch.tensor([1, 1, 2]))


def test_draft_vocabulary_counted_a_batch_at_a_time_equals_counting_the_whole_corpus():
    from selfspec.train.data.examples import examples_from_lists
    from selfspec.train.data.vocabulary import draft_vocabulary

    gen = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 40, (n,), generator=gen) for n in (5, 9, 3, 12, 7)]
    masks = [torch.rand(len(r), generator=gen) > 0.3 for r in rows]
    counts = torch.bincount(torch.cat(rows)[torch.cat(masks)], minlength=96)  # the whole corpus at once
    want = torch.sort(counts, descending=True, stable=True).indices[:50]
    assert counts[want[-1]] == 0  # unseen tokens fill the rest, lowest ids first
    examples = examples_from_lists([r.tolist() for r in rows], [m.int().tolist() for m in masks])
    assert torch.equal(draft_vocabulary(examples.token_batches(batch_size=2), 96, 50), want)
    assert torch.equal(draft_vocabulary(zip(rows, masks), 96, 50), want)


def test_full_draft_vocabulary_is_the_identity():
    draft = Eagle3Draft(eagle3_config(tiny_model("llama")))
    assert draft.lm_head.out_features == 96
    assert torch.equal(draft.to_target(torch.arange(96)), torch.arange(96)) and bool(draft.t2d.all())


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_rope_inverse_frequencies_stay_float32_when_cast(kind):
    model = tiny_model("llama")
    if kind == "eagle3":
        draft = Eagle3Draft(eagle3_config(model))
    else:
        c = model.config
        draft = EagleDraft(
            HeadsConfig(
                kind="eagle", hidden_size=c.hidden_size, vocab_size=c.vocab_size, layer=layer_fields(c)
            )
        )
    before = draft.rotary_emb.inv_freq.clone()
    assert before.dtype == torch.float32
    draft = draft.to(torch.bfloat16)
    assert next(draft.parameters()).dtype == torch.bfloat16
    assert draft.rotary_emb.inv_freq.dtype == torch.float32 and torch.equal(draft.rotary_emb.inv_freq, before)
    # positions far out keep their angles: cos/sin at position 2000 equal the float32 module's, to bf16 output
    x = torch.zeros(1, 1, 4, dtype=torch.bfloat16)
    cos, _ = draft.rotary_emb(x, torch.tensor([[2000]]))
    reference = torch.cos(2000 * before)
    torch.testing.assert_close(cos[0, 0, : before.numel()].float(), reference, atol=8e-3, rtol=0)


def test_eagle3_save_and_load_round_trip(tmp_path):
    model = tiny_model("llama")
    draft = random_draft(model, draft_vocab_size=33)
    draft.set_draft_vocab(torch.arange(0, 96, 3)[:33] if len(range(0, 96, 3)) >= 33 else torch.arange(33))
    draft.save_pretrained(tmp_path)
    loaded = load_heads(tmp_path)
    assert isinstance(loaded, Eagle3Draft)
    before, after = draft.state_dict(), loaded.state_dict()
    assert set(before) == set(after)
    assert not any("embed" in k for k in after)
    for k in before:
        assert torch.equal(before[k], after[k]), k


# ---------------------------------------------------------------- decoding with it


STATIC = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def eagle3_proposer(model, draft, **kwargs):
    return EagleProposer(draft, model.get_input_embeddings(), model.get_output_embeddings(), **kwargs)


def plain_greedy(model, prompt, n):
    return model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)[
        0, prompt.shape[1] :
    ].tolist()


@pytest.mark.parametrize("choices", [None, STATIC], ids=["dynamic", "static"])
def test_greedy_identical_to_generate_with_a_random_eagle3_drafter(model, choices):

    spec = SpeculativeModel(model, eagle3_proposer(model, reduced_draft(model), choices=choices))
    gen = torch.Generator().manual_seed(5)
    for length in (1, 6):
        prompt = torch.randint(3, 96, (1, length), generator=gen)
        for n in (1, 3, 30):
            assert spec.generate(prompt, max_new_tokens=n)[0, length:].tolist() == plain_greedy(
                model, prompt, n
            )


@pytest.mark.parametrize("choices", [None, STATIC], ids=["dynamic", "static"])
def test_drafted_tokens_are_target_ids_of_plain_drafter_runs_along_each_path(choices):
    """Every node's token is what the drafter, run plainly over the fused confirmed features and the node's
    drafted ancestors, ranks at the node's rank in its own vocabulary, mapped to a target id through d2t."""

    model = tiny_model("llama")
    draft = reduced_draft(model, seed=3)
    prop = eagle3_proposer(model, draft, choices=choices)
    prompt = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    target = Target(model, draft.config.feature_layers)
    logits, features = prefill_one(target, prompt, new_cache(model, 64))
    assert features.shape == (6, len(draft.config.feature_layers) * 48)
    context = torch.cat([prompt[0], logits.argmax().view(1)])
    drafted = propose_one(prop, context, features)
    tokens, tree = drafted.tokens, drafted.tree
    assert bool(draft.t2d[tokens[1:]].all())  # every drafted token is in the draft vocabulary
    embed = model.get_input_embeddings()
    with torch.no_grad():
        for node in range(1, tree.size):
            path = tree.paths[node][: int(tree.depths[node]) + 1].tolist()
            hidden, ids = draft.fuse(features), context[1:]
            for child in path[1:]:
                out = draft(hidden[None], ids[None], embed)[0]
                ranked = draft.to_target(draft.logits(out[-1]).topk(int(tree.ranks[child]) + 1).indices)
                assert int(tokens[child]) in ranked.tolist()
                hidden = torch.cat([hidden, out[-1:]])
                ids = torch.cat([ids, tokens[child].view(1)])
            assert int(tokens[node]) == int(ranked[-1]), (node, path)


def trained_draft(model, prompts, steps=150) -> Eagle3Draft:
    """An EAGLE-3 drafter trained with the recipe's own loss on the model's greedy continuations."""

    draft = random_draft(model)
    for p in draft.parameters():  # a fresh start, as the recipe's
        torch.nn.init.normal_(p, std=0.02)
    for norm in (
        draft.norm,
        draft.midlayer.input_layernorm,
        draft.midlayer.hidden_norm,
        draft.midlayer.post_attention_layernorm,
    ):
        torch.nn.init.ones_(norm.weight)
    draft.config.depth, draft.config.top_k, draft.config.total_tokens = 4, 3, 12
    cfg = EagleConfig(version=3, ttt_steps=3)
    return fit_on_own_continuations(model, prompts, Eagle3Method(cfg, model, draft, []), steps, 3e-3)


def test_greedy_identical_with_a_trained_eagle3_drafter(model):
    prompts = torch.randint(3, 96, (4, 6), generator=torch.Generator().manual_seed(7))
    draft = trained_draft(model, prompts)
    spec = SpeculativeModel(model, eagle3_proposer(model, draft))
    taus = []
    for i, length in enumerate((6, 3)):
        prompt = prompts[i : i + 1, :length]
        assert spec.generate(prompt, max_new_tokens=48)[0, length:].tolist() == plain_greedy(
            model, prompt, 48
        )
        taus.append(spec.last_stats.tau)
    assert max(taus) > 1.5, taus  # trained: multi-token paths are accepted


def test_drafter_cache_holds_exactly_the_fused_confirmed_pairs():
    model = tiny_model("qwen2")
    prompts = torch.randint(3, 96, (4, 5), generator=torch.Generator().manual_seed(2))
    draft = trained_draft(model, prompts, steps=100)
    prop = eagle3_proposer(model, draft)
    spec = SpeculativeModel(model, prop)
    out = spec.generate(prompts[:1], max_new_tokens=30)
    assert spec.last_stats.decode_steps > 1 and max(spec.last_stats.accepted_drafts) > 1
    n = prop.lengths[0]
    confirmed = out[:, : n + 1]
    with torch.no_grad():
        hs = model(confirmed, output_hidden_states=True).hidden_states
        fused = torch.cat([hs[i] for i in draft.config.feature_layers], dim=-1)
        plain = DraftCache.for_drafter(draft, n)  # one call over every confirmed pair
        draft(draft.fuse(fused[:, :-1]), confirmed[:, 1:], model.get_input_embeddings(), cache=plain)
    assert plain.length == n
    torch.testing.assert_close(prop.cache.keys[:, :, :, :n], plain.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prop.cache.values[:, :, :, :n], plain.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("params", [(1.0, 0, 1.0), (0.7, 6, 0.9)])
def test_eagle3_sampling_matches_the_target_distribution(params):

    model = tiny_model("llama", vocab=V, seed=5, scale=0.08)
    draft = random_draft(model, draft_vocab_size=5, seed=5)
    draft.set_draft_vocab(torch.tensor([0, 2, 3, 5, 6]))
    draft.config.depth, draft.config.top_k, draft.config.total_tokens = 3, 3, 8
    spec = SpeculativeModel(model, eagle3_proposer(model, draft))
    prompt = torch.tensor([[3, 1, 4, 1, 5, 3, 1, 4, 1]])
    accepted = []
    counts = run_sampling(spec, prompt, params, accepted)
    stat, dof = chi_square(counts, exact_joint(model, prompt, params), RUNS)
    assert stat < critical(dof), (
        f"chi2 {stat:.1f} with {dof} dof: the sampled distribution is not the target's"
    )
    assert sum(a > 0 for a in accepted) > RUNS // 100


def reference_loss_and_agreement(draft, outputs, target_logits, batch):
    """The training-time-test loss and metrics written out position by position, straight from the recipe."""
    ids, loss_mask, attn = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    B, T = ids.shape
    draft_ids = draft.draft_ids.tolist()
    total, hits, counts = 0.0, [0] * len(outputs), [0] * len(outputs)
    accepted = positions = 0
    for i, out in enumerate(outputs):
        ces = []
        for b in range(B):
            for t in range(T - 2 - i):
                label = t + 2 + i  # step i at t predicts x_{t+2+i}, from the target's logits at t + 1 + i
                if not (loss_mask[b, label] and attn[b, label]):
                    continue
                logits = target_logits[b, t + 1 + i]
                choice = int(logits.argmax())
                guess = draft_ids[int(draft.logits(out[b, t]).argmax())]
                hits[i] += guess == choice
                counts[i] += 1
                if choice not in draft_ids:
                    continue
                p = torch.softmax(logits[draft_ids].float(), -1)
                ces.append(-(p * torch.log_softmax(draft.logits(out[b, t]).float(), -1)).sum())
        total += 0.8**i * (torch.stack(ces).mean() if ces else 0.0)
    for b in range(B):
        for t in range(T - 2):
            if not (loss_mask[b, t + 2] and attn[b, t + 2]):
                continue
            positions += 1
            accepted += 1
            for i, out in enumerate(outputs):
                if t + 2 + i >= T or not (loss_mask[b, t + 2 + i] and attn[b, t + 2 + i]):
                    break
                if draft_ids[int(draft.logits(out[b, t]).argmax())] != int(
                    target_logits[b, t + 1 + i].argmax()
                ):
                    break
                accepted += 1
    return float(total), hits, counts, accepted, positions


def test_training_loss_and_agreement_equal_the_position_by_position_formula():
    from selfspec.train.data.vocabulary import draft_vocabulary
    from selfspec.train.methods.step_loss import StepLoss as Eagle3Loss

    model = tiny_model("llama")
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, V, (3, 14), generator=gen)
    attn = torch.ones_like(ids)
    attn[1, 10:] = 0  # a padded row
    loss_mask = torch.rand(ids.shape, generator=gen) > 0.3
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}
    draft = random_draft(model, draft_vocab_size=V // 3)
    draft.set_draft_vocab(draft_vocabulary([(ids, loss_mask)], V, V // 3))
    target_logits = torch.randn(3, 14, V, generator=gen) * 3
    target_logits[0, 5, 2] = 50.0  # a target choice the draft vocabulary lacks, if 2 is not in it
    ttt = Eagle3Loss(draft, 3)
    with torch.no_grad():
        outputs = [torch.randn(3, 13, model.config.hidden_size, generator=gen) for _ in range(3)]
        for i, out in enumerate(outputs):  # row 2 agrees with the target along paths of different lengths
            for t in range(0, 11 - i, 2 + i):
                target_logits[2, t + 1 + i, draft.to_target(draft.logits(out[2, t]).argmax())] = 60.0
        loss, logs = ttt.loss(outputs, target_logits, batch)
        hits, counts, accepted, positions = ttt.agreement(outputs, target_logits, batch)
    ref_loss, ref_hits, ref_counts, ref_accepted, ref_positions = reference_loss_and_agreement(
        draft, outputs, target_logits, batch
    )
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    assert hits.tolist() == ref_hits and counts.tolist() == ref_counts
    assert min(ref_hits) > 0 and ref_accepted > ref_positions + 2  # agreement and streaks were exercised
    assert (accepted, positions) == (ref_accepted, ref_positions)
