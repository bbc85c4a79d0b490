"""On a GPU (skipped elsewhere; `pytest -m cuda`): batched and compiled decoding equal each row alone on CUDA,
and a target spread over two GPUs (device_map) decodes with its drafter on the last layer's device."""

import pytest
import torch

from batch_rows import alone, batch_prompts, left_padded
from conftest import tiny_model
from eagle_drafts import random_draft
from medusa_heads import CHOICES, random_heads
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.drafters.prompt_lookup import PromptLookupProposer


def spec_on(model, kind: str, device: str, compile: bool = False) -> SpeculativeModel:
    """A drafter of `kind` for `model` (already placed), on `device`."""
    if kind == "prompt_lookup":
        return SpeculativeModel(model, PromptLookupProposer(4, 2, device=device), compile=compile)
    heads = random_heads(model, scale=0.0) if kind == "medusa" else random_draft(model)
    return SpeculativeModel.from_pretrained(
        heads, model=model, device=device, tree=CHOICES if kind == "medusa" else None, compile=compile
    )


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("kind", ["medusa", "eagle", "prompt_lookup"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_batched_greedy_on_cuda_equals_each_row_alone(kind, compile):
    model = tiny_model("llama").cuda()
    spec = spec_on(model, kind, "cuda", compile)
    prompts = [p.cuda() for p in batch_prompts()]
    ids, mask = left_padded([p.cpu() for p in prompts])
    out = spec.generate(
        ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=24, eos_token_id=[], pad_token_id=0
    )
    for b, p in enumerate(prompts):
        assert out[b, ids.shape[1] :].tolist() == alone(model, p, 24, None), b


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_target_split_over_two_gpus_decodes_with_its_drafter_on_the_last_layers_device():
    model = tiny_model("llama")
    device_map = {
        "model.embed_tokens": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.norm": 1,
        "model.rotary_emb": 1,
        "lm_head": 1,
    }
    from accelerate import dispatch_model

    model = dispatch_model(model, device_map=device_map)
    spec = spec_on(model, "medusa", "cuda:1")  # where the last layer and the lm_head are
    prompts = batch_prompts()
    ids, mask = left_padded(prompts)
    out = spec.generate(
        ids.to("cuda:0"), attention_mask=mask.to("cuda:0"), max_new_tokens=16, eos_token_id=[], pad_token_id=0
    )
    for b, p in enumerate(prompts):
        assert out[b, ids.shape[1] :].tolist() == alone(model, p.to("cuda:0"), 16, None), b
