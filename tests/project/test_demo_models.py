"""The shipped demo models: loadable offline with plain transformers, the stated sizes, and a real model
(beats gzip -9 on held-out stdlib source)."""

import gzip
import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfspec.shipped.models import MODELS_DIR, resolve_model
from selfspec.shipped.stdlib_corpus import stdlib_texts


def _load(name):
    path = resolve_model(name)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_sizes_and_special_tokens():
    target, tok = _load("demo")
    draft, draft_tok = _load("demo-draft")
    assert 8e6 <= sum(p.numel() for p in target.parameters()) <= 30e6
    assert 1e6 <= sum(p.numel() for p in draft.parameters()) <= 3e6
    assert type(target).__name__ == "LlamaForCausalLM"
    assert tok.get_vocab() == draft_tok.get_vocab() and 4000 <= len(tok) <= 16000
    assert None not in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    shipped = [
        MODELS_DIR / "demo-target",
        MODELS_DIR / "demo-draft",
    ]  # not what make real-model builds beside them
    weights = sum(p.stat().st_size for folder in shipped for p in folder.rglob("*.safetensors"))
    assert weights <= 40 * 2**20


def test_demo_target_beats_gzip_on_the_test_split():
    model, tok = _load("demo")
    text = "".join(stdlib_texts("test"))[:60_000]
    data = text.encode()
    ids = tok(text, return_tensors="pt").input_ids[0]
    nll, window = 0.0, 512
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window - 1):
            chunk = ids[start : start + window][None]
            logits = model(chunk).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
    model_bpb = nll / math.log(2) / len(data)
    gzip_bpb = 8 * len(gzip.compress(data, compresslevel=9)) / len(data)
    assert model_bpb < gzip_bpb, (model_bpb, gzip_bpb)


def test_speculative_greedy_on_the_demo_target_is_identical(demo_target):
    """The shipped model in fp32 with untrained heads (each projection a copy of the lm_head)."""
    from selfspec.heads.config import HeadsConfig
    from selfspec.heads.medusa import MedusaHeads
    from selfspec.infer.core.generate import SpeculativeModel
    from selfspec.infer.drafters.proposers import MedusaProposer
    from selfspec.infer.measure.bench import default_prompts

    model, tok = demo_target
    heads = MedusaHeads(HeadsConfig(hidden_size=model.config.hidden_size, vocab_size=len(tok), num_heads=4))
    heads.init_from_lm_head(model.get_output_embeddings())
    spec = SpeculativeModel(model, MedusaProposer(heads, model.get_output_embeddings()))
    prompts = default_prompts(2)
    assert len(prompts) == 2
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        ref = model.generate(ids, max_new_tokens=48, do_sample=False)
        assert spec.generate(ids, max_new_tokens=48).tolist() == ref.tolist()
