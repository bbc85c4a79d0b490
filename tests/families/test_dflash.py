"""DFlash drafter: packed training equals inference, greedy identity (chain and tree, batched), the cache
holds the confirmed context, sampling keeps the target's distribution, the loss is the formula."""

import math

import pytest
import torch

from conftest import tiny_model
from dflash_drafts import dflash_config, plain_greedy, proposer, random_draft
from sampling_checks import RUNS, V, chi_square, critical, exact_joint, run_sampling
from selfspec.heads.config import HeadsConfig
from selfspec.heads.dflash import DFlashDraft, default_target_layer_ids
from selfspec.heads.draft_layers import DraftCache, layer_fields
from selfspec.heads.registry import load_heads
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.train.methods.dflash import DFlashMethod
from selfspec.train.methods.dflash_loss import DFlashLoss, block_labels, decode_walk, dpace_weights, walk
from selfspec.train.recipes.dflash import DFlashConfig


def test_default_target_layer_ids_follow_the_published_spacing():
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]  # Qwen3-8B's published drafter
    assert default_target_layer_ids(32) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(8) == [1, 2, 3, 4, 5]
    assert default_target_layer_ids(2) == [0] and default_target_layer_ids(3) == [0, 1]
    for layers in range(2, 40):  # never the last layer's output (already normed), always distinct and rising
        ids = default_target_layer_ids(layers)
        assert ids == sorted(set(ids)) and ids[0] >= 0 and ids[-1] <= layers - 2


@pytest.mark.parametrize("qk_norm,kv_heads", [(False, 4), (True, 2)])
def test_packed_training_forward_equals_the_inference_forward_of_each_block(qk_norm, kv_heads):
    """Block n of the packed pass at anchor a equals one inference call of that block after the context
    0..a-1, itself fed to the drafter's cache in two calls (as decoding does)."""
    layer = dict(
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=16,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=512,
        hidden_act="silu",
    )
    cfg = HeadsConfig(
        kind="dflash",
        hidden_size=64,
        vocab_size=100,
        num_layers=2,
        layer=layer,
        feature_layers=[1, 2, 3],
        mask_token_id=99,
        block_size=8,
        depth=7,
        top_k=1,
        total_tokens=7,
        qk_norm=qk_norm,
    )
    torch.manual_seed(0)
    draft = DFlashDraft(cfg).double()
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.2)
    embed = torch.nn.Embedding(100, 64).double()
    T = 20
    feats, ids = torch.randn(2, T, 192, dtype=torch.double), torch.randint(0, 99, (2, T))
    anchors = torch.tensor([[1, 5, 12], [3, 9, 19]])
    blocks = draft.block_embeds(ids.gather(1, anchors), embed, torch.double)
    assert (blocks[:, :, 1:] == embed.weight[99]).all() and (
        blocks[:, :, 0] == embed(ids.gather(1, anchors))
    ).all()
    packed = draft(feats, blocks.flatten(1, 2), anchors=anchors)
    for b in range(2):
        for n, a in enumerate(anchors[b].tolist()):
            cache, cut = DraftCache.for_drafter(draft, 64), a // 2
            positions = torch.arange(a + 8)[None]
            if cut:
                draft(
                    feats[b : b + 1, :cut],
                    draft.block_embeds(ids[b, cut - 1 : cut], embed, torch.double),
                    positions[:, :cut],
                    torch.arange(cut, cut + 8)[None],
                    cache,
                )
                cache.length = cut  # the block's columns are dropped
            one = draft(
                feats[b : b + 1, cut:a],
                draft.block_embeds(ids[b, a : a + 1], embed, torch.double),
                positions[:, cut:a],
                positions[:, a:],
                cache,
            )
            torch.testing.assert_close(packed[b, n], one[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape", [dict(), dict(top_k=3, total_tokens=10, depth=4)], ids=["chain", "tree"])
def test_greedy_identical_to_generate_with_a_random_dflash_drafter(model, shape):
    spec = SpeculativeModel(model, proposer(model, random_draft(model), **shape))
    gen = torch.Generator().manual_seed(5)
    for length in (1, 6):
        prompt = torch.randint(4, 96, (1, length), generator=gen)
        for n in (1, 3, 30):
            assert spec.generate(prompt, max_new_tokens=n)[0, length:].tolist() == plain_greedy(
                model, prompt, n
            )


@pytest.mark.parametrize("shape", [dict(), dict(top_k=2, total_tokens=8, depth=5)], ids=["chain", "tree"])
def test_batched_rows_equal_generate_and_their_own_runs(shape):
    model = tiny_model("qwen2")
    draft = trained_draft(
        model, torch.randint(4, 96, (4, 6), generator=torch.Generator().manual_seed(8)), steps=60
    )
    prompts = torch.randint(4, 96, (3, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0  # left padding
    mask[2, :5] = 0
    prompts = prompts.masked_fill(mask == 0, 0)
    prop = proposer(model, draft, **shape)
    spec = SpeculativeModel(model, prop)
    out = spec.generate(prompts, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    ref = model.generate(prompts, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert out.tolist() == ref.tolist()


def trained_draft(model, prompts, steps=150, **shape) -> DFlashDraft:
    """A DFlash drafter trained with the recipe's own loss on the model's greedy continuations."""
    draft = random_draft(model, block=6, **shape)
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.02)
    for name, p in draft.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
    method = DFlashMethod(DFlashConfig(block_size=6, anchors=16), model, draft.train(), [])
    # the continuations as decoding with eos_token_id=[] makes them (EOS included, not suppressed)
    seqs = model.generate(prompts, max_new_tokens=48, do_sample=False, pad_token_id=0, eos_token_id=[])
    batch = {
        "input_ids": seqs,
        "attention_mask": torch.ones_like(seqs),
        "loss_mask": torch.ones_like(seqs).bool(),
    }
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    for _ in range(steps):
        method.loss(batch)[0].backward()
        opt.step()
        opt.zero_grad()
    return draft.eval()


def test_greedy_identical_with_a_trained_dflash_drafter(model, arch):
    prompts = torch.randint(4, 96, (4, 6), generator=torch.Generator().manual_seed(7))
    draft = trained_draft(model, prompts)
    taus = {}
    for name, shape in (("chain", {}), ("tree", dict(top_k=3, total_tokens=12, depth=5))):
        spec = SpeculativeModel(model, proposer(model, draft, **shape))
        for i, length in enumerate((6, 3)):
            prompt = prompts[i : i + 1, :length]
            out = spec.generate(
                prompt, max_new_tokens=40, eos_token_id=[]
            )  # no early stop: tau over 40 tokens
            ref = model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=[])
            assert out.tolist() == ref.tolist()
            taus[name, i] = spec.last_stats.tau
    assert max(taus.values()) > 1.5, taus  # trained: several tokens accepted per step


def test_drafter_cache_holds_exactly_the_confirmed_context():
    """After decoding, the drafter's cache equals one plain call over the fused features of every confirmed
    position: no block column stays, none is missing."""
    model = tiny_model("llama")
    prompts = torch.randint(4, 96, (4, 5), generator=torch.Generator().manual_seed(2))
    draft = trained_draft(model, prompts, steps=150)
    prop = proposer(model, draft)
    spec = SpeculativeModel(model, prop)
    out = spec.generate(prompts[:1], max_new_tokens=30, eos_token_id=[])
    assert spec.last_stats.decode_steps > 1 and max(spec.last_stats.accepted_drafts) > 1
    n = prop.lengths[0]
    confirmed = out[:, : n + 1]
    with torch.no_grad():
        hs = model(confirmed, output_hidden_states=True).hidden_states
        fused = torch.cat([hs[i] for i in draft.config.feature_layers], dim=-1)[:, :-1]
        plain = DraftCache.for_drafter(draft, n + 6)
        positions = torch.arange(n + 6)[None]
        draft(
            fused,
            draft.block_embeds(confirmed[:, -1], model.get_input_embeddings(), torch.float32),
            positions[:, :n],
            positions[:, n:],
            plain,
        )
    torch.testing.assert_close(prop.cache.keys[:, :, :, :n], plain.keys[:, :, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        prop.cache.values[:, :, :, :n], plain.values[:, :, :, :n], atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("shape", [dict(), dict(top_k=3, total_tokens=6, depth=3)], ids=["chain", "tree"])
def test_dflash_sampling_matches_the_target_distribution(shape):
    model = tiny_model("llama", vocab=V, seed=5, scale=0.08)
    c = model.config
    cfg = HeadsConfig(
        kind="dflash",
        hidden_size=c.hidden_size,
        vocab_size=V,
        num_layers=1,
        layer=layer_fields(c),
        block_size=4,
        mask_token_id=7,
        feature_layers=[1],
        depth=3,
        top_k=1,
        total_tokens=3,
    )
    torch.manual_seed(5)
    draft = DFlashDraft(cfg).eval()
    spec = SpeculativeModel(model, proposer(model, draft, **shape))
    prompt = torch.tensor([[3, 1, 4, 1, 5, 3, 1, 4, 1]])
    accepted = []
    counts = run_sampling(spec, prompt, (1.0, 0, 1.0), accepted)
    stat, dof = chi_square(counts, exact_joint(model, prompt, (1.0, 0, 1.0)), RUNS)
    assert stat < critical(dof), (
        f"chi2 {stat:.1f} with {dof} dof: the sampled distribution is not the target's"
    )
    assert sum(a > 0 for a in accepted) > RUNS // 100


@torch.no_grad()
def test_loss_is_the_position_weighted_mean_written_out():
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(8, 11, bias=False)
    B, T, Bk, H = 2, 9, 4, 8
    ids = torch.randint(0, 11, (B, T))
    loss_mask = torch.ones(B, T, dtype=torch.bool)
    loss_mask[0, :3] = False
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": torch.ones(B, T, dtype=torch.long)}
    anchors, real = torch.tensor([[1, 6], [2, 7]]), torch.tensor([[True, True], [True, False]])
    outputs = torch.randn(B, 2, Bk, H)
    last = torch.randn(B, T, H)
    for kind in ("ce", "kl"):  # (the formula below runs without gradients)
        for weighting in ("decay", "dpace"):
            got, _ = DFlashLoss(lm_head, Bk, kind, weighting, gamma=2.0, alpha=0.5, chunk=3).loss(
                outputs, batch, anchors, real, last
            )
            num = den = 0.0
            for b in range(B):
                for n in range(2):
                    a, per = int(anchors[b, n]), []
                    for j in range(1, Bk):
                        ok = bool(real[b, n]) and a + j < T and bool(loss_mask[b, a + j])
                        logq = torch.log_softmax(lm_head(outputs[b, n, j]), -1)
                        if kind == "ce":
                            value = float(-logq[ids[b, a + j]]) if ok else None
                        else:
                            logp = torch.log_softmax(lm_head(last[b, a + j - 1]), -1) if ok else None
                            value = float((logp.exp() * (logp - logq)).sum()) if ok else None
                        per.append(value)
                    for j, value in enumerate(per, start=1):
                        if value is None:
                            continue
                        if weighting == "decay":
                            w = math.exp(-(j - 1) / 2.0)
                        else:
                            # w_j = sum_{m >= j} prod_{i <= m} q_i, q_i = 0.5 exp(-loss_i) + 0.5,
                            # 0 where missing
                            q = [0.0 if v is None else 0.5 * math.exp(-float(v)) + 0.5 for v in per]
                            w = sum(math.prod(q[: m + 1]) for m in range(j - 1, len(per)))
                        num, den = num + w * float(value), den + w
            assert float(got) == pytest.approx(num / den, rel=1e-5), (kind, weighting)


def test_labels_stop_at_the_sequence_end_and_outside_the_loss_mask():
    ids = torch.arange(10)[None]
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool)
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": torch.ones(1, 10, dtype=torch.long)}
    labels, counts = block_labels(batch, torch.tensor([[1, 7]]), torch.tensor([[True, True]]), 4)
    assert labels[0, 0].tolist() == [2, 3, 4] and counts[0, 0].tolist() == [True, True, True]
    assert labels[0, 1, :2].tolist() == [8, 9] and counts[0, 1].tolist() == [True, True, False]
    w = dpace_weights(torch.zeros(1, 3), torch.tensor([[True, False, True]]), 0.5)
    assert w.tolist() == [[1.0, 0.0, 0.0]]  # a missing label ends the accepted prefix


def test_dflash_save_and_load_round_trip(tmp_path):
    model = tiny_model("llama")
    draft = random_draft(model, qk_norm=True)
    draft.save_pretrained(tmp_path / "d")
    loaded = load_heads(tmp_path / "d")
    assert isinstance(loaded, DFlashDraft) and loaded.config == draft.config
    for name, value in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert "layers.0.self_attn.q_norm.weight" in loaded.state_dict()
    assert not any("embed" in k or "lm_head" in k for k in loaded.state_dict())


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(block_size=1), "block_size must be >= 2"),
        (dict(mask_token_id=None), "needs `mask_token_id`"),
        (dict(mask_token_id=96), "needs `mask_token_id`"),
        (dict(depth=6), "at most block_size - 1"),
    ],
)
def test_bad_dflash_configs_name_the_field(fields, message):
    model = tiny_model("llama")
    data = dflash_config(model).to_dict() | fields
    with pytest.raises(ValueError, match=message):
        HeadsConfig.from_dict(data)


def test_mask_token_and_qk_norm_are_dflash_only():
    with pytest.raises(
        ValueError, match=r"qk_norm is for DFlash drafters \(medusa drafters do not read it\)"
    ):
        HeadsConfig(kind="medusa", hidden_size=8, vocab_size=8, qk_norm=True)


def test_proposer_refuses_a_depth_past_the_block():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="depth 9 is deeper"):
        proposer(model, random_draft(model), depth=9)


def test_validation_walk_takes_the_steps_decoding_takes():
    """sim_accept's teacher-forced walk over a sequence the target wrote visits the anchors chain decoding
    visits and accepts as many tokens at each (all but the last step, which max_new_tokens cuts)."""
    model = tiny_model("llama")
    prompts = torch.randint(4, 96, (4, 6), generator=torch.Generator().manual_seed(7))
    draft = trained_draft(model, prompts)
    prop = proposer(model, draft)
    starts = []
    propose = prop.propose
    prop.propose = lambda active, contexts, hiddens: (
        starts.append(contexts[0].shape[0] - 1) or propose(active, contexts, hiddens)
    )
    spec = SpeculativeModel(model, prop)
    out = spec.generate(prompts[:1], max_new_tokens=40, eos_token_id=[])
    accepted = spec.last_stats.accepted_drafts
    assert max(accepted) > 1  # the drafter is right several positions deep at some steps
    loss_mask = torch.zeros_like(out, dtype=torch.bool)
    loss_mask[:, prompts.shape[1] :] = True
    method = DFlashMethod(DFlashConfig(block_size=6, anchors=7), model, draft, [])
    streaks, _ = method.streaks(
        {"input_ids": out, "attention_mask": torch.ones_like(out), "loss_mask": loss_mask}
    )
    steps = walk(streaks[0].tolist())
    assert [a for a, _ in steps][:-1] == starts[:-1]
    assert [s for _, s in steps][:-1] == accepted[:-1]
    assert decode_walk(streaks) == (len(steps), sum(s + 1 for _, s in steps))


def test_walk_jumps_over_what_each_step_accepts():
    # anchors 0-1 are the prompt (no block); the stretch's first block is one past its first anchor
    assert walk([-1, 4, 0, 3, 9, 9, 9, 1, 0, 0, -1, 2, 2, 0]) == [(2, 0), (3, 3), (7, 1), (9, 0), (12, 2)]
    assert decode_walk(torch.tensor([[-1, 4, 0, 3, 9, 9, 9, 1, 0, 0]])) == (4, 8)
