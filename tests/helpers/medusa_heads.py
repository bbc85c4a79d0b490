"""Random Medusa heads on the tiny targets, and a static tree for them."""

import torch

from conftest import VOCAB
from selfspec.heads.config import HeadsConfig
from selfspec.heads.medusa import MedusaHeads

CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def random_heads(model, seed=0, scale=0.5, num_heads=4) -> MedusaHeads:
    torch.manual_seed(seed)
    cfg = HeadsConfig(hidden_size=model.config.hidden_size, vocab_size=VOCAB, num_heads=num_heads)
    heads = MedusaHeads(cfg)
    heads.init_from_lm_head(model.get_output_embeddings())
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * scale)
    return heads
