"""The seed algorithm's draft-model drafter and prompt lookup, in the shared decode loop."""

import pytest
import torch

from conftest import VOCAB, tiny_model
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.core.target import Target
from selfspec.infer.core.verify import SamplingParams
from selfspec.infer.drafters.draft_model import DraftModelProposer
from selfspec.infer.drafters.prompt_lookup import PromptLookupProposer


def plain_greedy(model, prompt, n):
    return model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)[
        0, prompt.shape[1] :
    ].tolist()


@pytest.mark.parametrize("draft_arch", ["llama", "gpt2"])
def test_draft_model_greedy_identical_to_generate(model, draft_arch):
    draft = tiny_model(draft_arch, seed=1)
    spec = SpeculativeModel(model, DraftModelProposer(draft, num_tokens=3, vocab_size=VOCAB))
    gen = torch.Generator().manual_seed(3)
    for length in (1, 7):
        prompt = torch.randint(3, VOCAB, (1, length), generator=gen)
        for n in (1, 4, 30):
            assert spec.generate(prompt, max_new_tokens=n)[0, length:].tolist() == plain_greedy(
                model, prompt, n
            )


def test_draft_model_that_is_the_target_is_always_accepted():
    model = tiny_model("llama")
    spec = SpeculativeModel(model, DraftModelProposer(model, num_tokens=4))
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    out = spec.generate(prompt, max_new_tokens=40, eos_token_id=[])
    assert (
        out[0, 5:].tolist()
        == model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, 5:
        ].tolist()
    )
    stats = spec.last_stats
    assert (
        len(stats.drafted) > 0 and stats.accepted_drafts == stats.drafted
    )  # its own argmax: every draft kept
    assert stats.tau == pytest.approx(5.0, abs=0.3)  # 4 drafted + 1 bonus per step (the last step is cut)


def test_draft_model_keeps_every_rows_context_in_its_cache():
    """The rows of a batch draft in the same forwards: after a generation, each row's columns of the draft
    model's cache hold what a plain prefill of that row's confirmed tokens gives (prompts of different
    lengths: left padding, then ragged acceptance moved down to each row's own end)."""
    from transformers import DynamicCache

    from batch_rows import left_padded

    model, draft = tiny_model("llama"), tiny_model("qwen2", seed=2)
    prop = DraftModelProposer(draft, num_tokens=3)
    spec = SpeculativeModel(model, prop)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (6, 3)]
    ids, mask = left_padded(prompts)
    calls = []
    forward = draft.forward
    draft.forward = lambda *a, **k: calls.append(k["input_ids"].shape[0]) or forward(*a, **k)
    out = spec.generate(ids, attention_mask=mask, max_new_tokens=25, eos_token_id=[])
    assert (
        spec.last_stats.decode_steps > 1 and len(calls) > 3 and set(calls) == {2}
    )  # the batch in each forward
    for b, prompt in enumerate(prompts):
        row = out[b, ids.shape[1] - prompt.shape[0] :]
        start, end = prop.starts[b], prop.filled[b]
        plain = DynamicCache()
        Target(draft).prefill_rows(row[None, : end - start], plain, hidden=False)
        for mine, ref in zip(prop.cache.layers, plain.layers, strict=True):
            torch.testing.assert_close(
                mine.key_buffer[b : b + 1, :, start:end], ref.keys, atol=1e-5, rtol=1e-5
            )
            torch.testing.assert_close(
                mine.value_buffer[b : b + 1, :, start:end], ref.values, atol=1e-5, rtol=1e-5
            )
        expected = model.generate(prompt[None], max_new_tokens=25, do_sample=False, eos_token_id=None)
        assert row.tolist() == expected[0].tolist()


def test_rows_that_stop_drafting_feed_nothing_to_the_draft_model():
    """A row near the model's position limit stops drafting while another goes on: it feeds nothing (its
    padding once got positions past the limit: an index error in GPT-2's position embedding), and its
    generator is not drawn from. Output still equals generate's, also behind prompt lookup."""
    from transformers import AutoModelForCausalLM

    from batch_rows import left_padded
    from conftest import tiny_config
    from selfspec.infer.drafters.prompt_lookup import LookupFirst

    def short_gpt2(seed):
        torch.manual_seed(seed)
        config = tiny_config("gpt2", VOCAB)
        config.n_positions = 32
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()

    model, draft = short_gpt2(0), short_gpt2(1)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (21, 4)]
    ids, mask = left_padded(prompts)
    for proposer in (
        DraftModelProposer(draft, num_tokens=3),
        LookupFirst(
            DraftModelProposer(draft, num_tokens=3), PromptLookupProposer(num_tokens=3), min_tokens=1
        ),
    ):
        out = SpeculativeModel(model, proposer).generate(ids, attention_mask=mask, max_new_tokens=40)
        for b, prompt in enumerate(prompts):
            room = 32 - prompt.numel()  # our budgets are clipped to the positions; generate would fail
            expected = model.generate(prompt[None], max_new_tokens=room, do_sample=False, pad_token_id=0)
            assert out[b, ids.shape[1] :][:room].tolist() == expected[0, prompt.numel() :].tolist()


def test_draft_model_vocabulary_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="96 vocabulary rows but the target has 50"):
        DraftModelProposer(tiny_model("llama"), vocab_size=50)


def test_prompt_lookup_finds_the_latest_longest_match():
    prop = PromptLookupProposer(num_tokens=3, max_ngram=2)
    prop.reset(0, SamplingParams(), None)
    prop._extend([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    assert prop.lookup() == [9, 2, 6]  # "6 7" last seen before "9 2 6 7"
    prop._extend([3])
    assert prop.lookup() == []  # "7 3" and "3" never seen before
    prop._extend([5])
    assert prop.lookup() == [6, 7, 8]  # "3 5" unseen, "5" seen at the start


def lookup_guess(context: list[int]) -> list[int]:
    """What a fresh prompt-lookup proposer drafts after `context`."""
    prop = PromptLookupProposer(num_tokens=5)
    prop._extend(context)
    return prop.lookup()


def test_prompt_lookup_greedy_identical_and_accepts_repeats(model):
    spec = SpeculativeModel(model, PromptLookupProposer(num_tokens=5, device="cpu"))
    gen = torch.Generator().manual_seed(4)
    for length in (1, 9):
        prompt = torch.randint(3, VOCAB, (1, length), generator=gen)
        for n in (1, 6, 40):
            assert spec.generate(prompt, max_new_tokens=n)[0, length:].tolist() == plain_greedy(
                model, prompt, n
            )
    # lookups get accepted: greedy is self-consistent, so after a prefix seq[:j] of its own greedy output
    # the model says seq[j:]; cut where the first lookup (over seq[:j + 1], the root included)
    # drafts seq[j + 1]
    seq = model.generate(
        torch.tensor([[3, 4, 5]]), max_new_tokens=60, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0].tolist()
    cuts = [j for j in range(4, len(seq) - 9) if lookup_guess(seq[: j + 1])[:1] == seq[j + 1 : j + 2]]
    assert cuts, "the model's own output never repeats an n-gram with the same next token: pick another start"
    prompt = torch.tensor([seq[: cuts[0]]])
    out = spec.generate(prompt, max_new_tokens=8, eos_token_id=[])[0, cuts[0] :].tolist()
    assert out == seq[cuts[0] : cuts[0] + 8]
    assert spec.last_stats.accepted_drafts[0] > 0


@pytest.mark.parametrize("kind", ["medusa", "eagle", "peagle"])
def test_lookup_first_is_lossless_and_uses_both_drafters(model, kind):
    from eagle_drafts import proposer as eagle_proposer
    from eagle_drafts import random_draft
    from medusa_heads import CHOICES, random_heads
    from peagle_drafts import random_draft as peagle_draft
    from selfspec.infer.drafters.peagle import peagle_proposer
    from selfspec.infer.drafters.prompt_lookup import LookupFirst
    from selfspec.infer.drafters.proposers import MedusaProposer

    if kind == "eagle":
        primary = eagle_proposer(model, random_draft(model))
    elif kind == "peagle":
        primary = peagle_proposer(peagle_draft(model), model)
    else:
        primary = MedusaProposer(random_heads(model), model.get_output_embeddings(), CHOICES)
    calls = {"primary": 0}
    propose = primary.propose

    def counting(*args):
        calls["primary"] += 1
        return propose(*args)

    primary.propose = counting
    spec = SpeculativeModel(model, LookupFirst(primary, PromptLookupProposer(num_tokens=6), min_tokens=2))
    prompt = torch.tensor([[7, 8, 9, 10]])
    assert spec.generate(prompt, max_new_tokens=40)[0, 4:].tolist() == plain_greedy(model, prompt, 40)
    # a prompt of the model's own output, where tokens recur: lookup drafts where it finds 2+ tokens
    own = plain_greedy(model, torch.tensor([[3, 4, 5]]), 40)
    prompt = torch.tensor([[3, 4, 5, *own[:30]]])
    calls["primary"] = 0
    assert spec.generate(prompt, max_new_tokens=40)[0, 33:].tolist() == plain_greedy(model, prompt, 40)
    steps = len(spec.last_stats.accept_lengths)
    assert (
        0 < calls["primary"] < steps
    )  # lookup drafted some steps (its n-grams recur), the primary the others
