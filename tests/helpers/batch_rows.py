"""Batched decoding: a drafter of each kind on a tiny target, left-padded prompts of different lengths, and a
row decoded alone by model.generate to compare a batch's rows with."""

import torch

from conftest import VOCAB, tiny_model
from eagle3_drafts import reduced_draft
from eagle_drafts import random_draft
from medusa_heads import CHOICES, random_heads
from selfspec.infer.drafters.draft_model import DraftModelProposer
from selfspec.infer.drafters.eagle import EagleProposer
from selfspec.infer.drafters.prompt_lookup import LookupFirst, PromptLookupProposer
from selfspec.infer.drafters.proposers import MedusaProposer


def drafter(model, kind: str):
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    if kind == "medusa":
        return MedusaProposer(
            random_heads(model, scale=0.0), lm_head, CHOICES
        )  # the target's own guesses: accepts
    if kind == "eagle":
        return EagleProposer(random_draft(model), embed, lm_head)
    if kind == "eagle3":
        return EagleProposer(reduced_draft(model), embed, lm_head)
    if kind == "draft_model":
        return DraftModelProposer(tiny_model("llama", seed=1), num_tokens=3, vocab_size=VOCAB)
    if kind == "prompt_lookup":
        return PromptLookupProposer(num_tokens=4, max_ngram=2)
    if kind == "eagle3+lookup":  # the lookup-first hybrid in front of EAGLE-3, as `--lookup-first` builds it
        return LookupFirst(EagleProposer(reduced_draft(model), embed, lm_head), PromptLookupProposer(4))
    return LookupFirst(
        MedusaProposer(random_heads(model, scale=0.0), lm_head, CHOICES), PromptLookupProposer(4)
    )


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - p.numel() :] = p
        mask[b, T - p.numel() :] = 1
    return ids, mask


def alone(model, prompt: torch.Tensor, n: int, eos: int | None) -> list[int]:
    """The row decoded by itself with model.generate greedy, up to and including its EOS."""
    out = model.generate(prompt[None], max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=eos)[
        0, prompt.numel() :
    ].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


def batch_prompts(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen) for n in (6, 1, 11, 4)]
