"""What "identical" means in bf16: tree verification runs other kernels (other summation orders) than
one-token decoding, so an argmax whose top-2 logits are within rounding may flip. On the 5 tiny architectures
in bf16 a speculative decoder's greedy output equals `generate` except where the baseline's top-2 margin is a
near-tie (within 4 units in the last place), and the bench reports it as a number: the fraction of prompts
identical and, for the others, where they first differ and that margin."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, tiny_model, tiny_tokenizer
from eagle_drafts import random_draft
from medusa_heads import CHOICES, random_heads
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.drafters.eagle import EagleProposer
from selfspec.infer.drafters.proposers import MedusaProposer
from selfspec.infer.measure.bench import hf_runner, run_bench, speculative_runner
from selfspec.infer.measure.bench_report import add_agreement, agreement, format_agreement

PROMPTS = [
    "def add(a, b):",
    "x = 1\nfor i in range(",
    "class Point:\n    x = 0",
    "import os\n",
    "return self.",
    "while True:",
    "if x > 0:\n    y =",
    "print(",
]


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_output_differs_from_generate_only_at_near_ties(arch):
    model = tiny_model(arch).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    lm_head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    spec = {
        "medusa": SpeculativeModel(
            model, MedusaProposer(random_heads(model).to(torch.bfloat16), lm_head, CHOICES)
        ),
        "eagle": SpeculativeModel(
            model, EagleProposer(random_draft(model).to(torch.bfloat16), embed, lm_head)
        ),
    }
    runners = {"generate": hf_runner(model, 32, None, 0)} | {
        k: speculative_runner(s, 32, None, 0) for k, s in spec.items()
    }
    result = add_agreement(run_bench(model, tiny_tokenizer(), runners, PROMPTS, warmup=0))
    for name in spec:
        a = result["methods"][name]["agreement"]
        assert a["all_near_ties"], f"{arch} {name}: " + format_agreement(a)
        assert a["prompts"] == len(PROMPTS) and a["identical_prompts"] + len(a["first_divergence"]) == len(
            PROMPTS
        )


def test_the_agreement_is_counted_from_the_mismatches():
    method = {
        "mismatches": [
            {"prompt": 1, "position": 21, "top2_logit_margin": 0.0625, "near_tie": True},
            {"prompt": 3, "position": 2, "top2_logit_margin": 0.5, "near_tie": False},
        ]
    }
    a = agreement(method, 10)
    assert (a["identical_prompts"], a["fraction_identical"], a["first_divergence"]) == (8, 0.8, [21, 2])
    assert a["largest_margin"] == 0.5 and not a["all_near_ties"]
    assert "8/10 prompts identical" in format_agreement(a) and "a bug" in format_agreement(a)
    assert agreement({}, 4) | {} == {
        "prompts": 4,
        "identical_prompts": 4,
        "fraction_identical": 1.0,
        "first_divergence": [],
        "top2_margins": [],
        "largest_margin": None,
        "all_near_ties": True,
    }
