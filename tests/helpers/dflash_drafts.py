"""Random DFlash drafters on the tiny targets, their proposer, and the target's own greedy continuation they
must reproduce."""

import torch

from selfspec.heads.config import HeadsConfig
from selfspec.heads.dflash import DFlashDraft, default_target_layer_ids
from selfspec.heads.draft_layers import layer_fields
from selfspec.infer.drafters.dflash import DFlashProposer

MASK = 3  # the tiny tokenizer's <unk>: never generated text in these tests' sense, any row works


def dflash_config(model, block=6, qk_norm=True, layers=2, **extra) -> HeadsConfig:
    c = model.config.get_text_config()
    fields = dict(depth=block - 1, top_k=1, total_tokens=block - 1) | extra
    return HeadsConfig(
        kind="dflash",
        hidden_size=c.hidden_size,
        vocab_size=model.get_output_embeddings().weight.shape[0],
        num_layers=layers,
        layer=layer_fields(c),
        block_size=block,
        mask_token_id=MASK,
        qk_norm=qk_norm,
        feature_layers=[i + 1 for i in default_target_layer_ids(c.num_hidden_layers)],
        **fields,
    )


def random_draft(model, seed=0, **kwargs) -> DFlashDraft:
    torch.manual_seed(seed)
    draft = DFlashDraft(dflash_config(model, **kwargs))
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return draft.eval()


def proposer(model, draft, **kwargs) -> DFlashProposer:
    return DFlashProposer(draft, model.get_input_embeddings(), model.get_output_embeddings(), **kwargs)


def plain_greedy(model, prompt, n):
    return model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)[
        0, prompt.shape[1] :
    ].tolist()
