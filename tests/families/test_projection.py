"""The drafters' vocabulary projection: the same logits as F.linear, by the faster GEMM layout where it
applies."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import selfspec.heads.projection as projection
from selfspec.heads.projection import apply_head, is_plain_linear, vocab_logits


def forbid_linear(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("F.linear was called")

    monkeypatch.setattr(projection.F, "linear", fail)


@pytest.mark.parametrize("shape", [(1, 32), (8, 32), (2, 5, 32), (4, 1, 3, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_float32_takes_the_transposed_product_and_equals_linear(monkeypatch, shape, bias):
    torch.manual_seed(0)
    x, w = torch.randn(shape), torch.randn(300, 32)
    b = torch.randn(300) if bias else None
    expected = F.linear(x, w, b)
    forbid_linear(monkeypatch)
    with torch.no_grad():
        out = vocab_logits(x, w, b)
    assert out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected)
    assert torch.equal(out.argmax(-1), expected.argmax(-1))


def test_other_dtypes_and_autograd_keep_linear_exactly(monkeypatch):
    torch.manual_seed(0)
    monkeypatch.setattr(projection.torch, "mm", None)  # the fast path would call it
    x, w = torch.randn(6, 32), torch.randn(300, 32)
    for dtype in (torch.bfloat16, torch.float16):  # no faster layout measured for these: bit-identical
        assert torch.equal(vocab_logits(x.to(dtype), w.to(dtype)), F.linear(x.to(dtype), w.to(dtype)))
    wg = w.clone().requires_grad_()
    vocab_logits(x, wg).sum().backward()  # training: F.linear and its own backward
    torch.testing.assert_close(wg.grad, x.sum(0).expand_as(w))


def test_apply_head_uses_the_fast_path_for_plain_linear_only(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(3, 32)
    plain = nn.Linear(32, 300, bias=True)

    class Scaled(nn.Linear):  # a subclass (quantised layers are) keeps its own forward
        def forward(self, x):
            return 2 * super().forward(x)

    scaled = Scaled(32, 300)
    scaled.load_state_dict(plain.state_dict())
    with torch.no_grad():
        expected = plain(x)
        torch.testing.assert_close(apply_head(scaled, x), 2 * expected)
        forbid_linear(monkeypatch)
        torch.testing.assert_close(apply_head(plain, x), expected)


def test_a_hooked_linear_runs_its_own_forward(monkeypatch):
    torch.manual_seed(0)
    x, head = torch.randn(3, 32), nn.Linear(32, 300)
    assert is_plain_linear(head)
    head.register_forward_pre_hook(lambda module, args: (2 * args[0],))  # as offload or weight_norm hooks do
    assert not is_plain_linear(head)
    with torch.no_grad():
        torch.testing.assert_close(apply_head(head, x), F.linear(2 * x, head.weight, head.bias))


def softcapped_model() -> nn.Module:
    """A tiny Gemma-2, whose forward caps its logits at +-0.5 after the lm_head (tanh(x / 0.5) * 0.5)."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        final_logit_softcapping=0.5,
        attn_logit_softcapping=None,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def test_verification_projects_through_the_cpu_layout_and_keeps_the_models_logit_processing(monkeypatch):
    """Prefill and tree verification run the target's lm_head matmul through vocab_logits, while the model's
    own code around it (here Gemma-2's softcapping) still runs; the model is left unchanged afterwards."""
    import selfspec.infer.core.target as target_module
    from conftest import verify_one
    from selfspec.infer.core.cache import new_cache
    from selfspec.infer.core.target import Target
    from selfspec.infer.core.tree import tree_from_choices

    model = softcapped_model()
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits  # (1, 12, V), capped
    seen = []
    real = target_module.vocab_logits
    monkeypatch.setattr(target_module, "vocab_logits", lambda x, w, b=None: seen.append(w) or real(x, w, b))
    target, cache = Target(model), new_cache(model, 16)
    last, _ = target.prefill_rows(ids[:, :9], cache, hidden=False)
    chain = tree_from_choices([[0], [0, 0]])
    logits, _ = verify_one(target, ids[0, 9:], chain, 9, cache)
    logits = logits[None]
    assert len(seen) == 2 and all(w is model.lm_head.weight for w in seen)
    torch.testing.assert_close(last, expected[:, 8])
    torch.testing.assert_close(logits, expected[:, 9:])
    assert expected.abs().max() < 0.5 and "forward" not in vars(model.lm_head)


def test_verification_leaves_a_hooked_lm_head_to_its_own_forward(monkeypatch):
    import selfspec.infer.core.target as target_module
    from selfspec.infer.core.cache import new_cache
    from selfspec.infer.core.target import Target

    model = softcapped_model()
    model.lm_head.register_forward_hook(lambda module, args, out: out)  # e.g. accelerate's offload hook
    monkeypatch.setattr(target_module, "vocab_logits", None)  # would fail if called
    Target(model).prefill_rows(torch.tensor([[5, 6, 7]]), new_cache(model, 8), hidden=False)
    assert "forward" not in vars(model.lm_head)
