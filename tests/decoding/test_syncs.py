"""One host read per decode step, for every drafter, batch size and sampling mode: a step hands the host its
accepted lengths and tokens in one `.tolist()` and nothing else crosses back (see docs/decoding.md). Counted
on CPU with tests/helpers/sync_counter.py: the calls that would make the host wait on an accelerator."""

import pytest
import torch

import selfspec.infer.core.verify as verify
from batch_rows import alone, batch_prompts, drafter, left_padded
from conftest import tiny_model
from dflash_drafts import proposer as dflash_proposer
from dflash_drafts import random_draft as dflash_draft
from eagle_drafts import STATIC, random_draft
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.drafters.eagle import EagleProposer
from selfspec.infer.drafters.prompt_lookup import LookupFirst, PromptLookupProposer
from selfspec.infer.drafters.proposers import MedusaProposer
from sync_counter import HostSyncs, syncs_per_step

KINDS = [
    "medusa",
    "eagle",
    "eagle1",
    "eagle3",
    "dflash_chain",
    "dflash_tree",
    "draft_model",
    "prompt_lookup",
    "medusa+lookup",
    "eagle+lookup",
]
PREFILL_READS = (
    4  # the first tokens, the prompts for host-side drafters, transformers' checks of a padded mask
)


def make(model, kind: str):
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    if kind == "eagle1":
        return EagleProposer(random_draft(model), embed, lm_head, choices=STATIC)
    if kind == "dflash_chain":
        return dflash_proposer(model, dflash_draft(model))
    if kind == "dflash_tree":
        return dflash_proposer(model, dflash_draft(model, top_k=2, total_tokens=6))
    if kind == "eagle+lookup":
        return LookupFirst(EagleProposer(random_draft(model), embed, lm_head), PromptLookupProposer(4))
    return drafter(model, kind)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def decode_counted(model, proposer, prompts, sampled: bool, n: int = 16, eos=()):
    ids, mask = left_padded(prompts)
    spec = SpeculativeModel(model, proposer)
    options = dict(do_sample=True, temperature=1.0, top_k=20, top_p=0.9) if sampled else {}
    steps = spec.decode_batch(ids, n, attention_mask=mask, eos_token_id=list(eos), pad_token_id=0, **options)
    return syncs_per_step(steps)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_a_decode_step_reads_the_host_once(llama, kind, rows, sampled, monkeypatch):
    monkeypatch.setattr(verify, "GROWS_ON", ())  # top-p as on an accelerator: the search never reads back
    torch.manual_seed(0)  # sampled rows draw from the global generator: not from whatever ran before
    prompts = batch_prompts()[:rows] if rows > 1 else batch_prompts()[2:3]
    eos = alone(llama, prompts[0], 30, None)[5]  # rows stop at different steps and leave the batch
    items, counts = decode_counted(llama, make(llama, kind), prompts, sampled, eos=[eos])
    # a draft model prefills the prompts too, in the same step: transformers checks its padded mask as well
    prefill_reads = PREFILL_READS + (2 if kind == "draft_model" and rows > 1 else 0)
    assert len(counts) > 2 and sum(counts[0].values()) <= prefill_reads, counts[0]
    assert [dict(c) for c in counts[1:]] == [{"tolist": 1}] * (len(counts) - 1)
    if (
        rows > 1 and not sampled
    ):  # some step ran with a row stopped and gone: the drop is inside a counted step
        assert any(any(not new for new in step) and any(step) for step in items[1:])
        out = [sum((step[b] for step in items), []) for b in range(rows)]
        assert out == [alone(llama, p, 16, eos) for p in prompts]


def test_the_counter_sees_a_read_back_inside_a_drafter(llama, monkeypatch):
    """The test above can fail: one `.item()` per step in the Medusa heads' call is counted in every step."""
    propose = MedusaProposer.propose_batch

    def reading(self, roots, hiddens):
        int(roots[0])  # e.g. a Python branch on a token
        return propose(self, roots, hiddens)

    monkeypatch.setattr(MedusaProposer, "propose_batch", reading)
    _, counts = decode_counted(llama, make(llama, "medusa"), batch_prompts()[:3], sampled=False)
    assert all(sum(c.values()) == 2 for c in counts[1:]), counts


def test_each_kind_of_read_back_is_counted():
    x = torch.arange(6)
    with HostSyncs() as syncs:
        x.tolist(), x[0].item(), bool(x[1]), int(x[2]), float(x[3]), x.cpu(), x.numpy(), range(x[1])
        x[x > 2], x.nonzero(), x.unique(), torch.tensor([1], device="cpu"), x.repeat_interleave(x)
    assert syncs.total == 13, syncs.counts
    with HostSyncs() as syncs:  # device work, a non-blocking copy, sizes: nothing waits
        y = x + 1
        y.to("cpu", non_blocking=True), y.shape, y.nonzero_static(size=2), torch.tensor([1]), y.topk(2)
    assert syncs.total == 0, syncs.counts


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_the_nucleus_without_read_backs_equals_the_growing_search(monkeypatch, top_p):
    probs = (torch.randn(6, 5000, generator=torch.Generator().manual_seed(0)) * 3).softmax(-1)
    grown = verify.outside_nucleus(probs, top_p)
    monkeypatch.setattr(verify, "GROWS_ON", ())
    with HostSyncs() as syncs:
        sorted_ = verify.outside_nucleus(probs, top_p)
    assert syncs.total == 0
    assert torch.equal(grown, sorted_)
