"""What `SpeculativeModel.generate`/`decode` take as model.generate takes it: EOS ids of any integer type, a
padded batch without its mask, and one generation at a time per drafter."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from batch_rows import left_padded
from conftest import tiny_model, tiny_tokenizer
from medusa_heads import CHOICES, random_heads
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.drafters.prompt_lookup import PromptLookupProposer
from selfspec.infer.drafters.proposers import MedusaProposer, NoDraft

ROOT = Path(__file__).resolve().parents[2]


def greedy(model, ids, n, **kwargs):
    return model.generate(ids, max_new_tokens=n, do_sample=False, **kwargs)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_eos_ids_as_tensors_and_numpy_stop_where_generate_stops(llama):
    spec = SpeculativeModel(llama, PromptLookupProposer(4))
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    eos = greedy(llama, prompt, 12, eos_token_id=[])[0, 9].item()  # the 5th new token: a stop mid-generation
    want = greedy(llama, prompt, 12, eos_token_id=eos, pad_token_id=0)
    assert want.shape[1] < 5 + 12
    for given in (torch.tensor([eos]), torch.tensor(eos), np.int64(eos), [np.int64(eos)], (eos,)):
        assert torch.equal(
            spec.generate(prompt, max_new_tokens=12, eos_token_id=given, pad_token_id=0), want
        ), given
    for given in ([torch.tensor(eos)], torch.tensor([[eos]])):  # model.generate takes these too
        assert torch.equal(
            spec.generate(prompt, max_new_tokens=12, eos_token_id=given, pad_token_id=0), want
        ), given
    for wrong in ("2", 2.0, [True], torch.tensor([True])):
        with pytest.raises(ValueError, match="eos_token_id must be a token id"):
            spec.generate(prompt, max_new_tokens=12, eos_token_id=wrong)


def test_a_padded_batch_without_its_mask_is_read_as_generate_reads_it(llama):
    """model.generate infers the mask from the pad id (0 here, not an EOS id); so must we, not decode the
    pads."""
    spec = SpeculativeModel(llama, PromptLookupProposer(4))
    ids, mask = left_padded([torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([11, 12])])
    assert llama.generation_config.pad_token_id == 0 and bool((ids == 0).any())
    want = greedy(llama, ids, 10, attention_mask=mask, eos_token_id=[], pad_token_id=0)
    assert torch.equal(spec.generate(ids, max_new_tokens=10, eos_token_id=[]), want)
    assert torch.equal(
        spec.generate(ids, max_new_tokens=10, eos_token_id=[], pad_token_id=torch.tensor(0)), want
    )
    assert not torch.equal(spec.generate(ids, max_new_tokens=10, eos_token_id=[], pad_token_id=99), want)
    # the pad id is an EOS id: nothing is inferred (as model.generate), the pads are read as prompt tokens
    assert not torch.equal(
        spec.generate(ids, max_new_tokens=10, eos_token_id=0, pad_token_id=0)[:, :10], want[:, :10]
    )
    holes = ids.clone()
    holes[0, 3] = 0  # a pad id inside a prompt: generate would mask it, which a tree's cache cannot
    with pytest.raises(ValueError, match="pass the tokenizer's attention_mask"):
        spec.generate(holes, max_new_tokens=4)
    one = holes[:1]  # a single prompt holding the pad id: decode takes its mask
    assert len(sum(spec.decode(one, 4, attention_mask=torch.ones_like(one)), [])) == 4


def test_a_second_stream_is_refused_while_the_first_is_unfinished(llama):
    """The drafter holds one generation's state: advancing two streams in turn would mix them up."""
    spec = SpeculativeModel(llama, PromptLookupProposer(4))
    a, b = torch.tensor([5, 6, 7, 8, 5, 6, 7]), torch.tensor([40, 41, 42, 40, 41])
    first = spec.decode(a, 12, eos_token_id=[])
    next(first)
    with pytest.raises(ValueError, match="still decoding another generation"):
        next(spec.decode(b, 12, eos_token_id=[]))
    first.close()
    want = greedy(llama, b[None], 12, eos_token_id=[], pad_token_id=0)[0, 5:].tolist()
    assert sum(spec.decode(b, 12, eos_token_id=[]), []) == want  # free again once the first is closed
    for _ in spec.decode(a, 12, eos_token_id=[]):
        break  # abandoned: the generator is closed as it goes
    assert sum(spec.decode(b, 12, eos_token_id=[]), []) == want


def test_batch_rows_follow_a_change_of_the_drafters_settings(llama):
    """Each row's drafter copy is made per generation, so a setting changed between calls reaches every
    row."""
    spec = SpeculativeModel(llama, PromptLookupProposer(4, max_ngram=3))
    prompt = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5])
    spec.generate(torch.stack([prompt, prompt]), max_new_tokens=16, eos_token_id=[])
    spec.proposer.num_tokens = 1
    spec.generate(prompt[None], max_new_tokens=16, eos_token_id=[])
    alone = spec.last_stats.target_forwards
    spec.generate(torch.stack([prompt, prompt]), max_new_tokens=16, eos_token_id=[])
    assert spec.last_stats.target_forwards == alone and max(spec.last_stats.drafted) <= 1


def test_the_stream_guard_clears_after_an_error_and_spares_stateless_drafters(llama, monkeypatch):
    spec = SpeculativeModel(llama, PromptLookupProposer(4))
    prompt = torch.tensor([5, 6, 7, 8, 5, 6, 7])
    verify = spec.target.verify_rows
    monkeypatch.setattr(spec.target, "verify_rows", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        spec.generate(prompt[None], max_new_tokens=8)
    monkeypatch.setattr(spec.target, "verify_rows", verify)
    want = greedy(llama, prompt[None], 8, eos_token_id=[], pad_token_id=0)
    assert torch.equal(spec.generate(prompt[None], max_new_tokens=8, eos_token_id=[]), want)
    medusa = SpeculativeModel(llama, MedusaProposer(random_heads(llama, scale=0.0), llama.lm_head, CHOICES))
    first, second = medusa.decode(prompt, 8, eos_token_id=[]), medusa.decode(prompt[:4], 8, eos_token_id=[])
    assert next(first) and next(second)  # Medusa keeps no state between calls: both streams may run


ABANDONED_STREAM = """
import sys, torch
sys.path[:0] = ["tests"]
from conftest import tiny_model, tiny_tokenizer
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.drafters.prompt_lookup import PromptLookupProposer
spec = SpeculativeModel(tiny_model("llama"), PromptLookupProposer(4))
stream = spec.decode(torch.tensor([5, 6, 7, 5, 6]), 50, eos_token_id=[])
for i, step in enumerate(stream):
    assert torch.is_grad_enabled()  # the caller's grad mode between steps
    if i == 3:
        break
print("left the stream open")
"""


def test_a_stream_left_open_at_exit_closes_quietly():
    """A user breaks out of a stream and the script ends: the generator is closed during interpreter shutdown,
    where torch.no_grad's generator wrapper printed an 'Exception ignored ... AttributeError' traceback."""
    done = subprocess.run(
        [sys.executable, "-c", ABANDONED_STREAM],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "left the stream open" in done.stdout
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_decoding_runs_without_grad_and_leaves_the_callers_grad_mode(llama):
    spec = SpeculativeModel(llama, PromptLookupProposer(4))
    seen = []
    propose = spec.proposer.propose
    spec.proposer.propose = lambda *a: seen.append(torch.is_grad_enabled()) or propose(*a)
    for _ in spec.decode(torch.tensor([5, 6, 7, 5, 6]), 12, eos_token_id=[]):
        assert torch.is_grad_enabled()
    assert seen and not any(seen)


@pytest.mark.parametrize(
    "ids, error, match",
    [
        ([[5, 6, 7]], TypeError, "input_ids must be a torch.Tensor of token ids .* got list"),
        (torch.ones(1, 7), TypeError, "input_ids must hold integers, got a float32 tensor"),
        (
            torch.ones(1, 1, 7, dtype=torch.long),
            ValueError,
            r"input_ids must be \(tokens,\) or \(batch, tokens\), got shape \(1, 1, 7\)",
        ),
    ],
)
@pytest.mark.parametrize("call", ["generate", "decode", "decode_batch", "stream"])
def test_input_ids_are_checked_at_the_boundary(ids, error, match, call):
    spec = SpeculativeModel(tiny_model("llama"), NoDraft())
    args = (ids, tiny_tokenizer()) if call == "stream" else (ids,)
    with pytest.raises(error, match=match):
        out = getattr(spec, call)(*args, max_new_tokens=3)
        list(out) if call != "generate" else out


@pytest.mark.parametrize(
    "mask, error, match",
    [
        ([[1, 1, 1]], TypeError, "attention_mask must be a torch.Tensor"),
        (torch.ones(1, 3), TypeError, "attention_mask must hold integers, got a float32 tensor"),
        (
            torch.ones(1, 1, 3, dtype=torch.long),
            ValueError,
            r"attention_mask must be .* got shape \(1, 1, 3\)",
        ),
    ],
)
def test_attention_mask_is_checked_at_the_boundary(mask, error, match):
    spec = SpeculativeModel(tiny_model("llama"), NoDraft())
    with pytest.raises(error, match=match):
        spec.generate(torch.tensor([[5, 6, 7]]), attention_mask=mask, max_new_tokens=3)
    bool_mask = torch.ones(1, 3, dtype=torch.bool)  # a bool mask is a mask, as transformers takes it
    assert spec.generate(torch.tensor([[5, 6, 7]]), attention_mask=bool_mask, max_new_tokens=2).shape == (
        1,
        5,
    )


def test_every_drafter_family_is_a_public_name_and_in_the_docs():
    """DFlash was missing from help(selfspec), the public names and the CLI's description and --heads help."""
    import selfspec
    from selfspec.heads.families import FAMILIES
    from selfspec.infer.cli.options import DESCRIPTION

    for f in FAMILIES.values():
        cls = f.load("drafter")
        assert getattr(selfspec, cls.__name__) is cls and cls.__name__ in selfspec.__all__
        for text in (selfspec.__doc__, DESCRIPTION):
            assert f.title.split("-")[0] in text, (f.title, text)
