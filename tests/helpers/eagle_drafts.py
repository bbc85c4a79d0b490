"""Random EAGLE-1 drafters on the tiny targets, their proposer, and a static tree of EAGLE's shape: for the
EAGLE tests and the decode-loop tests that run every drafter family."""

import torch

from conftest import VOCAB
from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle import EagleDraft
from selfspec.infer.drafters.eagle import EagleProposer

STATIC = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def random_draft(model, seed=0, **config) -> EagleDraft:
    torch.manual_seed(seed)
    cfg = HeadsConfig(
        kind="eagle",
        hidden_size=model.config.hidden_size,
        vocab_size=VOCAB,
        layer=layer_fields(model.config),
        **({"depth": 4, "top_k": 3, "total_tokens": 10} | config),
    )
    return EagleDraft(cfg).eval()


def proposer(model, draft, **kwargs) -> EagleProposer:
    return EagleProposer(draft, model.get_input_embeddings(), model.get_output_embeddings(), **kwargs)
