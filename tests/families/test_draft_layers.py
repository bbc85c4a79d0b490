"""The drafters' shared layer pieces (heads/draft_layers.py) compute what transformers' Llama modules do, bit
for bit, in fewer kernels: RoPE by the swapped halves and a signed sine, RMSNorm through the fused op."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

import dflash_drafts
import eagle3_drafts
import eagle_drafts
from conftest import tiny_model
from selfspec.heads.draft_layers import (
    DraftRMSNorm,
    Float32RotaryEmbedding,
    project,
    rotate,
    use_draft_norms,
)
from selfspec.infer.measure.launches import LaunchCounter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_is_apply_rotary_pos_emb_bit_for_bit(dtype):
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=4096)
    rope = Float32RotaryEmbedding(config)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 16, generator=gen).to(dtype)
    positions = torch.randint(0, 4000, (2, 5), generator=gen)
    cos, sin = rope(q, positions)  # transformers' own cos and sin
    want_q, want_k = apply_rotary_pos_emb(q, q.flip(1), cos, sin)
    for bound in (None, 4096):  # computed, and read from the table
        cos_s, sin_s = rope.at(q, positions, bound)
        assert torch.equal(cos_s, cos)
        assert torch.equal(rotate(q, cos_s, sin_s), want_q)
        assert torch.equal(rotate(q.flip(1), cos_s, sin_s), want_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_draft_norm_is_llama_rms_norm_bit_for_bit(dtype):
    for width in (8, 100, 576, 4096):
        gen = torch.Generator().manual_seed(width)
        reference = LlamaRMSNorm(width, 1e-5)
        reference.weight.data = torch.randn(width, generator=gen)
        norm = DraftRMSNorm(width, 1e-5)
        norm.load_state_dict(reference.state_dict())
        reference, norm = reference.to(dtype), norm.to(dtype)
        x = (torch.randn(3, 7, width, generator=gen) * 3).to(dtype)
        with torch.no_grad():
            assert torch.equal(norm(x), reference(x)), width
        x.requires_grad_(True)  # training: the parent's forward, gradients flow to the weight
        norm(x).sum().backward()
        assert norm.weight.grad is not None and x.grad is not None


def test_every_drafter_norm_is_the_draft_norm_under_the_checkpoint_names():
    model = tiny_model("llama")
    drafters = {
        "eagle": eagle_drafts.random_draft(model),
        "eagle3": eagle3_drafts.random_draft(model, norm_before_fc=True),
        "dflash": dflash_drafts.random_draft(model, qk_norm=True),
    }
    for kind, draft in drafters.items():
        norms = {name for name, m in draft.named_modules() if isinstance(m, LlamaRMSNorm)}
        assert norms and all(type(draft.get_submodule(n)) is DraftRMSNorm for n in norms), kind
        assert {f"{n}.weight" for n in norms} <= set(draft.state_dict()), kind


def test_swapping_the_norms_keeps_the_weight_objects():
    module = torch.nn.ModuleDict({"a": LlamaRMSNorm(8), "b": torch.nn.Sequential(LlamaRMSNorm(8))})
    weights = [module["a"].weight, module["b"][0].weight]
    use_draft_norms(module)
    assert type(module["a"]) is DraftRMSNorm and type(module["b"][0]) is DraftRMSNorm
    assert module["a"].weight is weights[0] and module["b"][0].weight is weights[1]


def test_a_draft_layer_rotates_q_and_k_in_four_kernels():
    """roll, two muls and an add over q and k together, after one table lookup (transformers' rotation: two
    lookups, then five kernels for q and five for k)."""
    draft = eagle3_drafts.random_draft(tiny_model("llama"))
    attn = draft.midlayer.self_attn
    x = torch.randn(1, 4, 2 * draft.config.hidden_size)
    draft.rotary_emb.at(x, torch.arange(4)[None], 64)  # the table, made once per generation
    counter = LaunchCounter(torch.nn.Identity())
    with torch.no_grad(), counter.counting():
        cos, sin = draft.rotary_emb.at(x, torch.arange(4)[None], 64)
        project(attn, x, cos, sin)
    rotation = {op: n for op, n in counter.ops.items() if op.split(".")[0] in ("roll", "neg", "index")}
    assert rotation == {"index.Tensor": 1, "roll.default": 1}, counter.ops
    assert counter.ops["mul.Tensor"] == 2 and counter.ops["add.Tensor"] == 1, counter.ops
