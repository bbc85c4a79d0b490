"""Random P-EAGLE drafters on the tiny targets."""

import torch

from eagle3_drafts import fused_config
from selfspec.heads.config import HeadsConfig
from selfspec.heads.peagle import PEagleDraft


def peagle_config(model, draft_vocab_size=0, **extra) -> HeadsConfig:
    c = model.config
    fields = dict(depth=4, top_k=1, total_tokens=4, mask_token_id=c.vocab_size - 1) | extra
    return fused_config("peagle", model, draft_vocab_size, **fields)


def random_draft(model, seed=0, size=40, **extra) -> PEagleDraft:
    """A random drafter over `size` of the target's tokens (a random subset, so d2t is not the identity)."""
    torch.manual_seed(seed)
    draft = PEagleDraft(peagle_config(model, size, **extra))
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if size:
        draft.set_draft_vocab(
            torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:size]
        )
    return draft.eval()
