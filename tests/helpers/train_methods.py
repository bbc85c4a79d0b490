"""The recipes' training methods (Medusa, EAGLE, EAGLE-3) on a tiny frozen target with random drafter weights,
and a random batch to train them on."""

import torch

from conftest import VOCAB, tiny_model
from eagle3_drafts import random_draft as random_eagle3_draft
from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle import EagleDraft
from selfspec.heads.medusa import MedusaHeads
from selfspec.train.data.vocabulary import draft_vocabulary
from selfspec.train.methods.eagle import Eagle3Method, EagleMethod
from selfspec.train.methods.medusa import MedusaMethod
from selfspec.train.recipes.eagle import EagleConfig
from selfspec.train.recipes.medusa import MedusaConfig

KINDS = ("medusa", "medusa-own-heads", "eagle", "eagle3")


def make_batch(vocab: int, B: int, T: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """Random tokens; row 1 right-padded from 3/4 of the length; a random loss mask inside the attention."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, T), generator=gen)
    attn = torch.ones_like(ids)
    attn[1, 3 * T // 4 :] = 0
    loss_mask = (torch.rand(B, T, generator=gen) > 0.25) & attn.bool()
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}


def make_method(kind: str, vocab: int = VOCAB, target_dtype: torch.dtype = torch.float32):
    """A recipe's method on a tiny frozen target, its drafter's weights random (so every gradient is
    nonzero)."""
    target = tiny_model("llama", vocab=vocab).requires_grad_(False).to(target_dtype)
    c = target.config
    torch.manual_seed(1)
    if kind.startswith("medusa"):
        share = kind == "medusa"
        heads = MedusaHeads(
            HeadsConfig(
                kind="medusa", hidden_size=c.hidden_size, vocab_size=vocab, num_heads=3, share_lm_head=share
            )
        )
        heads.init_from_lm_head(target.get_output_embeddings())
        with torch.no_grad():
            for p in heads.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        return MedusaMethod(MedusaConfig(num_heads=3, share_lm_head=share), target, heads)
    if kind == "eagle":
        draft = EagleDraft(
            HeadsConfig(kind="eagle", hidden_size=c.hidden_size, vocab_size=vocab, layer=layer_fields(c))
        )
        return EagleMethod(EagleConfig(noise=0.1), target, draft, [])
    draft = random_eagle3_draft(target, draft_vocab_size=vocab // 4)
    batch = make_batch(vocab, 4, 40, seed=9)
    draft.set_draft_vocab(draft_vocabulary([(batch["input_ids"], batch["loss_mask"])], vocab, vocab // 4))
    return Eagle3Method(EagleConfig(version=3, ttt_steps=3, draft_vocab_size=vocab // 4), target, draft, [])
