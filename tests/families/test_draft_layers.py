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
from selfspec.heads.joined import for_drafting, gated_mlp
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.core.loading import proposer_for
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


def grad_path(module: torch.nn.Module, *inputs):
    """module(*inputs) as training runs it (autograd on: every layer on its own), as a reference."""
    with torch.enable_grad():
        return module(*inputs).detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joined_projections_draw_what_each_layer_does_bit_for_bit(dtype):
    """When drafting, q/k/v (and gate/up) run as one matmul over weights re-homed as views of one tensor, the
    two EAGLE-3 input norms as one: the same values as the layers one by one (what training runs), in fewer
    kernels."""
    model = tiny_model("llama")
    draft = for_drafting(eagle3_drafts.random_draft(model).to(dtype))
    layer, attn = draft.midlayer, draft.midlayer.self_attn
    gen = torch.Generator().manual_seed(0)
    H = draft.config.hidden_size
    embeds, hidden = (torch.randn(2, 5, H, generator=gen).to(dtype) for _ in range(2))
    want_input = grad_path(lambda e, h: layer.attention_input(e, h), embeds, hidden)
    want_mlp = grad_path(layer.mlp, hidden)
    x = want_input
    cos, sin = draft.rotary_emb.at(x, torch.arange(5)[None].expand(2, 5), 64)
    with torch.enable_grad():
        want_qkv = [t.detach() for t in project(attn, x, cos, sin)]
    with torch.no_grad():
        assert torch.equal(layer.attention_input(embeds, hidden), want_input)
        assert torch.equal(gated_mlp(layer.mlp, hidden), want_mlp)
        for got, want in zip(project(attn, x, cos, sin), want_qkv):
            assert torch.equal(got, want)
    storage = attn.q_proj.weight.untyped_storage().data_ptr()  # joined: one storage for q, k and v
    assert attn.k_proj.weight.untyped_storage().data_ptr() == storage
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == (
        layer.mlp.gate_proj.weight.untyped_storage().data_ptr()
    )


def test_joined_parameters_keep_names_values_and_training():
    """Joining keeps every parameter's name, object and value; a cast joins again on the next draft, and a
    training step on the joined parameters shows in the next draft."""
    model = tiny_model("llama")
    draft = for_drafting(eagle3_drafts.random_draft(model))
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    objects = dict(draft.named_parameters())
    x = torch.randn(1, 3, draft.config.hidden_size)
    with torch.no_grad():
        gated_mlp(draft.midlayer.mlp, x)
    after = draft.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(objects[k] is p for k, p in draft.named_parameters())
    mlp = draft.midlayer.mlp
    optimizer = torch.optim.SGD(draft.parameters(), lr=0.1)
    mlp(x).sum().backward()  # training after a draft: gradients reach the joined parameters
    optimizer.step()
    assert not torch.equal(mlp.gate_proj.weight, before["midlayer.mlp.gate_proj.weight"])
    with torch.no_grad():
        assert torch.equal(gated_mlp(mlp, x), mlp(x))  # the joined tensor holds the new values
    draft.to(torch.bfloat16)  # new storage: joined again on the next draft
    xb = x.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(gated_mlp(mlp, xb), grad_path(mlp, xb))
    assert mlp.up_proj.weight.dtype == torch.bfloat16


def test_parameters_that_are_not_plain_tensors_run_one_by_one():
    """DeepSpeed ZeRO-3's placeholders (`ds_id`) are never re-homed: the layers run as they are."""
    model = tiny_model("llama")
    mlp = for_drafting(eagle3_drafts.random_draft(model)).midlayer.mlp
    mlp.gate_proj.weight.ds_id = 0
    x = torch.randn(1, 3, mlp.gate_proj.weight.shape[1])
    with torch.no_grad():
        assert torch.equal(gated_mlp(mlp, x), mlp(x))
    assert (
        mlp.up_proj.weight.untyped_storage().data_ptr() != mlp.gate_proj.weight.untyped_storage().data_ptr()
    )


@pytest.mark.parametrize("qk_norm", [False, True])
def test_dflash_layers_draft_the_same_joined(qk_norm):
    """DFlash's context keys/values read the k and v rows of the joined q/k/v weights (one group per
    layer, so nothing re-homes back and forth); with Qwen3's per-head norms too."""
    model = tiny_model("llama")
    draft = for_drafting(dflash_drafts.random_draft(model, qk_norm=qk_norm))
    attn = draft.layers[0].self_attn
    x = torch.randn(2, 4, draft.config.hidden_size)
    cos, sin = draft.rotary_emb.at(x, torch.arange(4)[None].expand(2, 4), 64)
    with torch.enable_grad():
        want_kv = [t.detach() for t in draft._context_kv(attn, x, cos, sin)]
        want_qkv = [t.detach() for t in draft._project(attn, x, cos, sin)]
    with torch.no_grad():
        for _ in range(2):  # both, twice: the joined weights stay put
            pointer = attn.q_proj.weight.data_ptr()
            assert all(torch.equal(a, b) for a, b in zip(draft._context_kv(attn, x, cos, sin), want_kv))
            assert all(torch.equal(a, b) for a, b in zip(draft._project(attn, x, cos, sin), want_qkv))
    assert attn.q_proj.weight.data_ptr() == pointer


def storage(linear: torch.nn.Linear) -> int:
    return linear.weight.untyped_storage().data_ptr()


def test_only_a_generation_joins_and_it_lets_go_at_its_end(tmp_path):
    """A drafter joins while a generation runs and gets storage of its own back at its end: its no-grad
    validation forwards in training never join (DeepSpeed's flat buffers keep the parameters), and afterwards
    accelerate's save_model (which drops tensors that share storage) saves every weight."""
    from safetensors.torch import load_file, save_model

    model = tiny_model("llama")
    draft = eagle3_drafts.random_draft(model)
    x = torch.randn(1, 3, draft.config.hidden_size)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    pointers = [p.data_ptr() for p in draft.parameters()]
    with torch.no_grad():
        draft.midlayer.finish(x, x)
        draft.midlayer.attention_input(x, x)
    assert [p.data_ptr() for p in draft.parameters()] == pointers
    proposer = proposer_for(draft, model)
    shared = []
    propose = proposer.propose

    def recording(*args):
        drafts = propose(*args)
        shared.append(storage(draft.midlayer.self_attn.q_proj) == storage(draft.midlayer.self_attn.v_proj))
        return drafts

    proposer.propose = recording
    prompt = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    SpeculativeModel(model, proposer).generate(prompt, max_new_tokens=6, eos_token_id=[], pad_token_id=0)
    assert shared and all(shared)  # joined while drafting
    assert storage(draft.midlayer.self_attn.q_proj) != storage(draft.midlayer.self_attn.v_proj)
    save_model(draft, str(tmp_path / "d.safetensors"))
    saved = load_file(str(tmp_path / "d.safetensors"))
    assert saved.keys() == before.keys() and all(torch.equal(saved[k], before[k]) for k in before)


def test_a_parameter_replaced_after_joining_is_joined_anew():
    """load_state_dict(assign=True) puts new parameter objects in: the next draft joins those, not the old."""
    model = tiny_model("llama")
    mlp = for_drafting(eagle3_drafts.random_draft(model, seed=0)).midlayer.mlp
    other = eagle3_drafts.random_draft(model, seed=1).midlayer.mlp
    x = torch.randn(1, 3, mlp.gate_proj.weight.shape[1])
    with torch.no_grad():
        gated_mlp(mlp, x)
        mlp.load_state_dict(other.state_dict(), assign=True)
        assert torch.equal(gated_mlp(mlp, x), other(x))
