"""Random EAGLE-3 drafters on the tiny targets, over the whole vocabulary or a random part of it (so d2t is
not the identity)."""

import torch

from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.fused_draft import default_feature_layers


def eagle3_config(model, draft_vocab_size=0, **extra) -> HeadsConfig:
    return fused_config("eagle3", model, draft_vocab_size, **extra)


def fused_config(kind: str, model, draft_vocab_size=0, **extra) -> HeadsConfig:
    """A drafter config of `kind` on the target's default fused layers (EAGLE-3, P-EAGLE)."""
    c = model.config
    return HeadsConfig(
        kind=kind,
        hidden_size=c.hidden_size,
        vocab_size=c.vocab_size,
        layer=layer_fields(c),
        feature_layers=default_feature_layers(c.num_hidden_layers),
        draft_vocab_size=draft_vocab_size,
        **extra,
    )


def random_draft(model, draft_vocab_size=0, seed=0, **flags) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(eagle3_config(model, draft_vocab_size, **flags))
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return draft.eval()


def reduced_draft(model, seed=0, size=40):
    """A random drafter over `size` of the target's tokens (a random subset, so d2t is not the identity)."""
    draft = random_draft(model, draft_vocab_size=size, seed=seed)
    vocab = model.config.vocab_size
    draft.set_draft_vocab(torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:size])
    draft.config.depth, draft.config.top_k, draft.config.total_tokens = 4, 3, 10
    return draft
