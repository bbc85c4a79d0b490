"""The tokens a drafter works with, chosen from the training data: a draft vocabulary of the most frequent
loss-bearing tokens (its lm_head started from the target's rows of them), and the mask token of drafters that
draft from masked positions. Shared by the recipes of every family that needs them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from selfspec.train.data.examples import Examples
from selfspec.train.loop.config import ConfigError


def token_counts(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """How often each target token is loss-bearing (vocab_size,), counted over (input_ids, loss_mask) batches
    of any equal shapes one at a time, never the whole corpus at once."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for input_ids, loss_mask in batches:
        counts += torch.bincount(input_ids[loss_mask.bool()].flatten().cpu(), minlength=vocab_size)[
            :vocab_size
        ]
    return counts


def draft_vocabulary(
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int, size: int
) -> torch.Tensor:
    """The `size` most frequent target tokens among the loss-bearing tokens (ties: the lower id), as ids
    (size,) (see `token_counts`). Tokens never seen fill the rest, lowest ids first, so the vocabulary always
    has `size` entries."""
    return most_frequent(token_counts(batches, vocab_size), size)


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ids of the `size` largest counts, ties to the lower id."""
    return torch.sort(counts, descending=True, stable=True).indices[:size]


@torch.no_grad()
def init_from_target(draft: Any, target) -> None:
    """Start the drafter's lm_head as the target's rows of the draft vocabulary: it then learns to produce
    features the target's own head reads, instead of a vocabulary projection from scratch as well."""
    head = target.get_output_embeddings().weight
    draft.lm_head.weight.copy_(head[draft.draft_ids.to(head.device)].to(draft.lm_head.weight.dtype))


def choose_mask_token(cfg: Any, tokenizer: Any, train_data: Examples, vocab: int) -> int:
    """The mask embedding row of a drafter that drafts from masked positions (DFlash, P-EAGLE), for a recipe
    `cfg` with `mask_token_id`: --mask_token_id; the tokenizer's mask token; a row past the tokenizer's
    vocabulary; else its highest special token (not BOS or EOS) that no training answer contains, the pad
    token last."""
    if cfg.mask_token_id is not None:
        if not 0 <= cfg.mask_token_id < vocab:
            raise ConfigError(
                f"--mask_token_id {cfg.mask_token_id} is not a row of the target's embedding (0..{vocab - 1})"
            )
        return cfg.mask_token_id
    if getattr(tokenizer, "mask_token_id", None) is not None and tokenizer.mask_token_id < vocab:
        return tokenizer.mask_token_id
    if len(tokenizer) < vocab:
        return len(tokenizer)  # an embedding row no text token maps to
    used = token_counts(train_data.token_batches(), vocab) > 0
    taken = {tokenizer.bos_token_id, tokenizer.eos_token_id}
    free = [i for i in tokenizer.all_special_ids if i not in taken and i < vocab and not used[i]]
    if not free:
        raise ConfigError(
            "the tokenizer has no mask token, no spare embedding row and no unused special token: pass "
            "--mask_token_id, a token id the target never writes"
        )
    return max(free, key=lambda i: (i != tokenizer.pad_token_id, i))
