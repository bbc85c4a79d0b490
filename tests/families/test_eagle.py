"""EAGLE: the dynamic tree, the drafter's tree expansion and cache, and lossless decoding with it."""

import pytest
import torch

from conftest import VOCAB, fit_on_own_continuations, prefill_one, propose_one, tiny_model
from eagle_drafts import STATIC, proposer, random_draft
from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import DraftCache
from selfspec.heads.eagle import EagleDraft
from selfspec.heads.registry import load_heads
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.core.target import Target
from selfspec.infer.core.tree import descend, select_tree, tree_from_parents


def plain_greedy(model, prompt, n):
    return model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)[
        0, prompt.shape[1] :
    ].tolist()


# ---------------------------------------------------------------- the dynamic tree


def hand_made_candidates():
    """top_k 2, depth 3. Depth 1: c0 -0.1, c1 -1.0 (children of the root). Depth 2 expands the
    frontier {c0, c1}: c2 -0.3, c3 -2.0 (of c0), c4 -1.2, c5 -3.0 (of c1). Depth 3 expands the best
    two of depth 2, {c2, c4}: c6 -0.5, c7 -2.5 (of c2), c8 -1.5, c9 -4.0 (of c4)."""
    scores = torch.tensor([-0.1, -1.0, -0.3, -2.0, -1.2, -3.0, -0.5, -2.5, -1.5, -4.0])
    parents = torch.tensor([-1, -1, 0, 0, 1, 1, 2, 2, 4, 4])
    ranks = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1, 0, 1])
    return scores, parents, ranks


def test_select_tree_keeps_the_best_scores_as_a_tree():
    scores, parents, ranks = hand_made_candidates()
    chosen, tree = select_tree(scores, parents, ranks, total_tokens=5, max_depth=3, width=2)
    # the five best: c0 -0.1, c2 -0.3, c6 -0.5, c1 -1.0, c4 -1.2 -> nodes 1..5 in depth order
    assert chosen.tolist() == [0, 1, 2, 4, 6]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 3]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3]  # verification positions are prefix_len + depth
    assert tree.children.tolist() == [[1, 2], [3, -1], [4, -1], [5, -1], [-1, -1], [-1, -1]]
    assert tree.paths.tolist() == [
        [0, 0, 0, 0],
        [0, 1, 1, 1],
        [0, 2, 2, 2],
        [0, 1, 3, 3],
        [0, 2, 4, 4],
        [0, 1, 3, 5],
    ]  # retrieval: root-to-node, padded with the node
    expected_mask = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 1, 0, 1, 0, 1],
    ]
    assert tree.ancestors.int().tolist() == expected_mask
    # the same tree as the host-side builder makes from the parent list
    ref = tree_from_parents([-1, 0, 0, 1, 2, 3], [0, 0, 1, 0, 0, 0])
    for field in ("parents", "depths", "ancestors", "children"):
        assert torch.equal(getattr(tree, field), getattr(ref, field)), field


def test_selection_is_ancestor_closed_even_with_zero_log_probs():
    gen = torch.Generator().manual_seed(0)
    k, depth = 3, 4
    for _ in range(50):
        scores = [torch.log_softmax(torch.randn(k, generator=gen) * 3, -1)]
        parents, ranks = [torch.full((k,), -1)], [torch.arange(k)]
        front, front_index, offset = scores[0], torch.arange(k), k
        for _ in range(depth - 1):
            logp = (
                torch.log_softmax(torch.randn(k, k, generator=gen) * 5, -1).sort(-1, descending=True).values
            )
            logp[0, 0] = 0.0  # a certain child: its score must still fall below its parent's
            child = descend(front, logp).flatten()
            scores.append(child)
            parents.append(front_index.repeat_interleave(k))
            ranks.append(torch.arange(k).repeat(k))
            best = child.topk(k).indices
            front, front_index, offset = child[best], offset + best, offset + k * k
        all_scores, all_parents = torch.cat(scores), torch.cat(parents)
        total = int(torch.randint(1, all_scores.numel() + 1, (1,), generator=gen))
        chosen, tree = select_tree(all_scores, all_parents, torch.cat(ranks), total, depth, k)
        kept = set(chosen.tolist())
        assert all(all_parents[c] < 0 or int(all_parents[c]) in kept for c in kept)
        assert tree.size == total + 1


def test_descend_is_strictly_below_the_parent():
    parent = torch.tensor([-3.0, 0.0])
    child = descend(parent, torch.zeros(2, 2))
    assert (child < parent[:, None]).all()


# ---------------------------------------------------------------- the drafter


def _prefill(model, prompt):
    target = Target(model)
    from selfspec.infer.core.cache import new_cache

    logits, hiddens = prefill_one(target, prompt, new_cache(model, 64))
    return logits.argmax().view(1), hiddens


@pytest.mark.parametrize("choices", [None, STATIC], ids=["dynamic", "static"])
def test_drafted_tokens_equal_plain_drafter_runs_along_each_path(choices):
    """Every tree node's token is what the drafter, run plainly (no cache, no tree mask) over the
    confirmed pairs and the node's drafted ancestors, ranks at the node's rank."""
    model = tiny_model("llama")
    draft = random_draft(model, seed=3)
    prop = proposer(model, draft, choices=choices)
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    root, hiddens = _prefill(model, prompt)
    context = torch.cat([prompt[0], root])
    draft_out = propose_one(prop, context, hiddens)
    tokens, tree = draft_out.tokens, draft_out.tree
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    assert int(tree.depths.max()) > 1  # nodes below depth 1, whose ancestors the drafter must run along
    with torch.no_grad():
        for node in range(1, tree.size):
            path = tree.paths[node][: int(tree.depths[node]) + 1].tolist()  # root ... node
            feats, ids = hiddens, context[1:]
            for ancestor in path[1:-1]:  # run the drafter along the node's drafted ancestors
                out = draft(feats[None], ids[None], embed)[0]
                feats = torch.cat([feats, out[-1:]])
                ids = torch.cat([ids, tokens[ancestor].view(1)])
            out = draft(feats[None], ids[None], embed)[0]
            ranked = lm_head(out[-1]).topk(int(tree.ranks[node]) + 1).indices
            assert int(tokens[node]) == int(ranked[-1]), (node, path)


def test_drafter_cache_holds_exactly_the_confirmed_pairs():
    model = tiny_model("qwen2")
    prompts = torch.randint(3, VOCAB, (4, 5), generator=torch.Generator().manual_seed(2))
    draft = self_distilled_draft(model, prompts, steps=100)
    prop = proposer(model, draft)
    spec = SpeculativeModel(model, prop)
    out = spec.generate(prompts[:1], max_new_tokens=30)
    assert spec.last_stats.decode_steps > 1 and max(spec.last_stats.accepted_drafts) > 1  # multi-pair updates
    # the confirmed pairs at the last step: (f_t, x_{t+1}) for every token up to that step's root
    n = prop.lengths[0]
    confirmed = out[:, : n + 1]
    with torch.no_grad():
        features = model(confirmed, output_hidden_states=True).hidden_states[-1]
        plain = DraftCache.for_drafter(draft, n)  # one call over every confirmed pair
        draft(features[:, :-1], confirmed[:, 1:], model.get_input_embeddings(), cache=plain)
    assert prop.cache.keys.shape[0] == plain.keys.shape[0] > 0 and plain.length == n
    torch.testing.assert_close(prop.cache.keys[:, :, :, :n], plain.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prop.cache.values[:, :, :, :n], plain.values, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- lossless decoding


def test_a_static_tree_deeper_than_the_drafters_depth_decodes(model):
    """A static tree of its own depth (a --tree chain of 6 for a drafter of depth 2), not the dynamic tree's:
    every level gets its position."""
    chain = [[0] * d for d in range(1, 7)]
    spec = SpeculativeModel(model, proposer(model, random_draft(model, depth=2), choices=chain))
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    assert spec.generate(prompt, max_new_tokens=20)[0, 5:].tolist() == plain_greedy(model, prompt, 20)


@pytest.mark.parametrize("choices", [None, STATIC], ids=["dynamic", "static"])
def test_greedy_identical_to_generate_with_a_random_drafter(model, choices):
    spec = SpeculativeModel(model, proposer(model, random_draft(model), choices=choices))
    gen = torch.Generator().manual_seed(5)
    for length in (1, 6):
        prompt = torch.randint(3, VOCAB, (1, length), generator=gen)
        for n in (1, 3, 30):
            assert spec.generate(prompt, max_new_tokens=n)[0, length:].tolist() == plain_greedy(
                model, prompt, n
            )


def self_distilled_draft(model, prompts, steps=150) -> EagleDraft:
    """A drafter trained with the recipe's own loss on the model's greedy continuations of `prompts`."""
    from selfspec.train.methods.eagle import EagleMethod
    from selfspec.train.recipes.eagle import EagleConfig

    draft = random_draft(model, depth=4, top_k=3, total_tokens=12)
    return fit_on_own_continuations(model, prompts, EagleMethod(EagleConfig(), model, draft, []), steps, 3e-3)


def test_greedy_identical_with_a_trained_drafter(model):
    prompts = torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(7))
    spec = SpeculativeModel(model, proposer(model, self_distilled_draft(model, prompts)))
    taus = []
    for i, length in enumerate((6, 3)):
        prompt = prompts[i : i + 1, :length]
        assert spec.generate(prompt, max_new_tokens=48)[0, length:].tolist() == plain_greedy(
            model, prompt, 48
        )
        taus.append(spec.last_stats.tau)
    assert max(taus) > 1.5  # trained: multi-token paths are accepted


def test_save_load_round_trip_and_no_target_weights(tmp_path):
    model = tiny_model("llama")
    draft = random_draft(model)
    draft.config.base_model = "tiny"
    draft.save_pretrained(tmp_path)
    loaded = load_heads(tmp_path)
    assert isinstance(loaded, EagleDraft) and loaded.config == draft.config
    names = set(loaded.state_dict())
    assert "fc.weight" in names and "fc.bias" in names and "layers.0.post_attention_layernorm.weight" in names
    assert not any(
        "embed" in n or "lm_head" in n or "input_layernorm" in n.split("layers.0.")[-1] for n in names
    )
    assert names == set(draft.state_dict())
    for name, value in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value)
    card = (tmp_path / "README.md").read_text()
    assert "eagle" in card and "base_model: tiny" in card


# --------------------------------------------------------------- frequency-ranked drafting (draft vocabulary)


def vocab_draft(model, size=VOCAB // 4, seed=0, **config) -> EagleDraft:
    """A random drafter that drafts among `size` random target tokens."""
    draft = random_draft(model, seed=seed, draft_vocab_size=size, **config)
    draft.set_draft_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:size])
    return draft


def test_draft_vocabulary_logits_are_the_targets_rows_and_follow_the_head():
    model = tiny_model("llama")
    draft, lm_head = vocab_draft(model), model.get_output_embeddings()
    assert draft.draft_ids.shape == (VOCAB // 4,) and not torch.equal(
        draft.draft_ids, torch.arange(VOCAB // 4)
    )
    out = torch.randn(2, 3, model.config.hidden_size)
    torch.testing.assert_close(draft.logits(out, lm_head), lm_head(out)[..., draft.draft_ids])
    with (
        torch.no_grad()
    ):  # the gathered rows are refreshed when the head changes (a new load, a cast, an edit)
        lm_head.weight.mul_(2)
    torch.testing.assert_close(draft.logits(out, lm_head), lm_head(out)[..., draft.draft_ids])
    assert torch.equal(draft.to_target(torch.arange(VOCAB // 4)), draft.draft_ids)


@pytest.mark.parametrize("choices", [None, STATIC], ids=["dynamic", "static"])
def test_a_draft_vocabulary_drafts_only_its_tokens_and_stays_lossless(model, choices):
    draft = vocab_draft(model, seed=1)
    allowed = set(draft.draft_ids.tolist())
    prop = proposer(model, draft, choices=choices)
    spec = SpeculativeModel(model, prop)
    drafted = []
    propose = prop.propose

    def recording(*args):
        out = propose(*args)
        drafted.extend(d.tokens[1:].tolist() for d in out if d is not None)
        return out

    prop.propose = recording
    gen = torch.Generator().manual_seed(6)
    for length in (1, 6):
        prompt = torch.randint(3, VOCAB, (1, length), generator=gen)
        for n in (3, 30):
            assert spec.generate(prompt, max_new_tokens=n)[0, length:].tolist() == plain_greedy(
                model, prompt, n
            )
    assert drafted and all(set(tokens) <= allowed for tokens in drafted)
    assert sum(len(t) for t in drafted) > 20  # trees were drafted, not only roots


def test_a_draft_vocabulary_batched_equals_each_row_alone():
    model = tiny_model("qwen2")
    spec = SpeculativeModel(model, proposer(model, vocab_draft(model, seed=2)))
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (2, 7, 4)]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.arange(width) >= width - len(p) for p in prompts]).long()
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=20, pad_token_id=0)
    for row, p in enumerate(prompts):
        assert out[row, width:].tolist() == plain_greedy(model, p[None], 20)


def test_a_draft_vocabulary_decodes_under_inference_mode():
    """Tensors made under torch.inference_mode (a drafter moved to its device there) keep no edit counter: the
    gathered head rows must not need one."""
    model = tiny_model("llama")
    draft = vocab_draft(model, seed=4)
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        draft.d2t = draft.d2t.clone()  # as a move to another device inside inference mode makes it
        out = SpeculativeModel(model, proposer(model, draft)).generate(prompt, max_new_tokens=12)
    assert out[0, 5:].tolist() == plain_greedy(model, prompt, 12)


def test_top_k_wider_than_the_draft_vocabulary_is_a_clear_error():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="drafts among 4 tokens, fewer than its 5 top_k: use at most 4"):
        proposer(model, vocab_draft(model, size=4), top_k=5)
    with pytest.raises(
        ValueError, match="fewer than its 6 children per node in the static tree: use at most 4"
    ):
        proposer(
            model, vocab_draft(model, size=4, top_k=4), choices=[[0], [5]]
        )  # top_k 4 fits: the tree does not


def test_validation_ranks_only_the_tokens_a_draft_vocabulary_can_draft():
    from selfspec.train.methods.eagle import RANKS, EagleMethod
    from selfspec.train.recipes.eagle import EagleConfig

    model = tiny_model("llama")
    draft = vocab_draft(model, size=8, top_k=2)
    ranked = EagleMethod(EagleConfig(), model, draft, [])._ranked(torch.randn(5, VOCAB))
    assert ranked.shape == (5, RANKS) and set(ranked[:, :8].flatten().tolist()) <= set(
        draft.draft_ids.tolist()
    )
    assert (ranked[:, 8:] == -1).all()  # fewer tokens than ranks: the rest is no token


def test_a_draft_vocabulary_round_trips_and_is_left_out_of_published_layouts(tmp_path):
    from selfspec.heads.formats.eagle import export_eagle, read_eagle_weights

    model = tiny_model("llama")
    draft = vocab_draft(model, seed=3)
    draft.config.base_model = "tiny"
    draft.save_pretrained(tmp_path / "ours")
    loaded = load_heads(tmp_path / "ours")
    assert loaded.config.draft_vocab_size == VOCAB // 4 and torch.equal(loaded.draft_ids, draft.draft_ids)
    for fmt in ("eagle1", "sglang-eagle"):
        with pytest.warns(UserWarning, match="SGLang drafts among them with --speculative-token-map"):
            export_eagle(draft, fmt, tmp_path / fmt, model.get_input_embeddings().weight)
        assert "d2t" not in read_eagle_weights(tmp_path / fmt)
        # SGLang's token map: the draft vocabulary's target ids, loaded as SGLang loads it
        hot = torch.load(tmp_path / fmt / "token_map.pt", weights_only=True)
        assert torch.equal(torch.tensor(hot, dtype=torch.int64), draft.draft_ids)
        back = load_heads(
            tmp_path / fmt, base_model=None
        )  # read back with its token map: the same vocabulary
        assert back.config.draft_vocab_size == VOCAB // 4 and torch.equal(back.draft_ids, draft.draft_ids)
        (tmp_path / fmt / "token_map.pt").unlink()
        assert (
            load_heads(tmp_path / fmt, base_model=None).config.draft_vocab_size == 0
        )  # as published: all tokens
    with pytest.raises(
        ValueError, match="draft_vocab_size is for EAGLE-1/2 and EAGLE-3 and P-EAGLE drafters"
    ):
        HeadsConfig(kind="medusa", hidden_size=8, vocab_size=VOCAB, draft_vocab_size=4)
    with pytest.raises(ValueError, match="draft_vocab_size must be in"):
        random_draft(model, draft_vocab_size=VOCAB + 1)


def test_features_of_the_wrong_size_are_a_clear_error():
    model = tiny_model("llama")
    draft = random_draft(model)
    with pytest.raises(ValueError, match="features have size 32 but the drafter expects 48"):
        draft(torch.zeros(1, 2, 32), torch.zeros(1, 2, dtype=torch.long), model.get_input_embeddings())
