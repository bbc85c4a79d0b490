"""EAGLE-3 checkpoints of other projects written by hand from the key names and config fields their projects
document (not by our exporter), on an 8-layer target so that three distinct layers are fused, and the
plain-torch EAGLE-3 forward the engines compute, which an imported drafter is checked against. Shared by
tests/formats/test_eagle3_formats.py (import) and tests/formats/test_eagle3_export.py (export)."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import randomized, write_checkpoint
from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.formats.eagle3_config import FLAGS
from selfspec.heads.fused_draft import default_feature_layers
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.drafters.eagle import EagleProposer

H, HEADS, KV, INTER, V, L = 48, 4, 2, 96, 96, 8
HD = H // HEADS


def deep_target(seed=0):
    """An 8-layer, 48-wide random Llama (the shared tiny models have 2 layers: too few to fuse three)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=L,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        vocab_size=V,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return randomized(model)


@pytest.fixture(scope="module")
def target():
    return deep_target()


@pytest.fixture(scope="module")
def target_dir(target, tmp_path_factory):
    path = tmp_path_factory.mktemp("deep-target")
    target.save_pretrained(path)
    return path


# ---------------------------------------------------------------- the published layouts, written by hand


def published_tensors(size, fused=3, seed=0, dtype=torch.float32, input_norm=False):
    """SafeAILab's EAGLE-3 state dict (cnets.py Model, without its frozen embed_tokens): every tensor random;
    with `input_norm`, norm_before_fc's RMSNorm over the fc input (speculators core.py, vLLM, SGLang)."""
    gen = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.15):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    state = {
        "fc.weight": w(H, fused * H),
        "midlayer.self_attn.q_proj.weight": w(HEADS * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(KV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(KV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, HEADS * HD),
        "midlayer.mlp.gate_proj.weight": w(INTER, H),
        "midlayer.mlp.up_proj.weight": w(INTER, H),
        "midlayer.mlp.down_proj.weight": w(H, INTER),
        "midlayer.input_layernorm.weight": 1 + w(H, std=0.1),
        "midlayer.hidden_norm.weight": 1 + w(H, std=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + w(H, std=0.1),
        "norm.weight": 1 + w(H, std=0.1),
        "lm_head.weight": w(size, H),
    }
    used = torch.randperm(V, generator=gen)[:size].sort().values  # the draft vocabulary, in target id order
    state["d2t"] = used - torch.arange(size)
    state["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, used, True)
    if input_norm:
        state["input_norm.weight"] = 1 + w(fused * H, std=0.1)
    return state


def merged(config, extra):
    """`config` with `extra` written over it; nested objects (eagle_config, transformer_layer_config)
    merged."""
    out = dict(config)
    for k, v in extra.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return {k: v for k, v in out.items() if v is not DROP}


DROP = object()  # a value in `extra` that removes the field


def safeailab_checkpoint(path, ids=None, size=40, weights="bin", seed=0, extra=None, state=None):
    """As yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (no ids) or a SpecForge drafter (`eagle_config` ids): a Llama
    config with draft_vocab_size, keys fc / midlayer.* / norm / lm_head / d2t / t2d."""
    state = published_tensors(size, seed=seed) if state is None else state
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": V,
        "draft_vocab_size": size,
    }
    if ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    write_checkpoint(path, merged(config, extra or {}), state, weights)
    return state


def speculators_checkpoint(
    path, verifier, ids=None, size=40, embed=None, seed=0, extra=None, input_norm=False
):
    """As vllm-project/speculators saves an Eagle3 speculator (Eagle3SpeculatorConfig, RedHatAI/*.eagle3):
    layers.0.* for the draft layer, the verifier's embed_tokens, d2t / t2d for a smaller draft vocabulary,
    input_norm.weight with norm_before_fc."""
    state = {
        k.replace("midlayer.", "layers.0."): v
        for k, v in published_tensors(size, seed=seed, input_norm=input_norm).items()
    }
    if embed is not None:
        state["embed_tokens.weight"] = embed.detach().clone()
    config = {
        "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": size,
        "eagle_aux_hidden_state_layer_ids": ids,
        "embed_requires_grad": False,
        "fc_norm": False,
        "norm_before_fc": False,
        "norm_before_residual": False,
        "norm_output": False,
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "target_hidden_size": None,
        "torch_dtype": "float32",
        "transformers_version": "4.56.2",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": str(verifier)},
        },
        "transformer_layer_config": {
            "head_dim": HD,
            "hidden_size": H,
            "intermediate_size": INTER,
            "max_position_embeddings": 2048,
            "model_type": "llama",
            "num_attention_heads": HEADS,
            "num_hidden_layers": 1,
            "num_key_value_heads": KV,
            "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "vocab_size": V,
        },
    }
    write_checkpoint(path, merged(config, extra or {}), state, "safetensors")
    return {k.replace("layers.0.", "midlayer."): v for k, v in state.items() if k != "embed_tokens.weight"}


def reference_logits(
    state, embed, hidden_states, layers, ids, norm_before_residual=False, norm_before_fc=False
):
    """SafeAILab's EAGLE-3 step (cnets.py Model + LlamaDecoderLayeremb) in plain torch, one causal sequence:
    fc over the fused hidden states, q/k/v on [input_layernorm(embedding); hidden_norm(h)], residual from h,
    MLP block, logits lm_head(norm(out)) -> (T, draft vocabulary). vLLM's variants (llama_eagle3.py):
    norm_before_fc puts input_norm over the whole fc input (combine_hidden_states); norm_before_residual takes
    the residual from hidden_norm(h) (_norm_before_residual)."""
    T, eps = ids.shape[0], 1e-6

    def rms(v, weight):
        return weight * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)

    p = "midlayer."
    fused = torch.cat([hidden_states[i] for i in layers], -1)  # (T, 3H)
    if norm_before_fc:
        fused = rms(fused, state["input_norm.weight"])
    h = fused @ state["fc.weight"].T
    normed = rms(h, state[p + "hidden_norm.weight"])
    x = torch.cat([rms(embed[ids], state[p + "input_layernorm.weight"]), normed], -1)
    inv = 1.0 / 10000.0 ** (torch.arange(0, HD, 2).float() / HD)
    freqs = torch.arange(T).float()[:, None] * inv[None]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()

    def rope(v):
        return v * cos + torch.cat([-v[..., HD // 2 :], v[..., : HD // 2]], -1) * sin

    q = rope((x @ state[p + "self_attn.q_proj.weight"].T).view(T, HEADS, HD).transpose(0, 1))
    k = rope((x @ state[p + "self_attn.k_proj.weight"].T).view(T, KV, HD).transpose(0, 1))
    v = (x @ state[p + "self_attn.v_proj.weight"].T).view(T, KV, HD).transpose(0, 1)
    k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
    mask = torch.full((T, T), float("-inf")).triu(1)
    att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(HD) + mask, -1) @ v
    residual = normed if norm_before_residual else h
    h = residual + att.transpose(0, 1).reshape(T, H) @ state[p + "self_attn.o_proj.weight"].T
    g = rms(h, state[p + "post_attention_layernorm.weight"])
    gate, up = g @ state[p + "mlp.gate_proj.weight"].T, g @ state[p + "mlp.up_proj.weight"].T
    h = h + (torch.nn.functional.silu(gate) * up) @ state[p + "mlp.down_proj.weight"].T
    return rms(h, state["norm.weight"]) @ state["lm_head.weight"].T


def ours_logits(draft, target, prompt):
    """What the imported drafter computes over the target's own features of `prompt` (features at t, token
    t+1)."""
    with torch.no_grad():
        hs = target(prompt, output_hidden_states=True).hidden_states
        features = torch.cat([hs[i] for i in draft.config.feature_layers], -1)[:, :-1]
        out = draft(draft.fuse(features), prompt[:, 1:], target.get_input_embeddings())
        return draft.logits(out)[0], [s[0, :-1] for s in hs]


def plain_greedy(model, prompt, n):
    return model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)[
        0, prompt.shape[1] :
    ].tolist()


def assert_decodes_like(draft, target, state, layers, **variant):
    """The drafter computes SafeAILab's forward (in the `variant` its flags name) over the hidden states the
    engines fuse (`layers`), maps draft ids through the file's d2t, and speculative greedy output is the
    target's."""
    assert draft.config.feature_layers == layers
    assert {f: getattr(draft.config, f) for f in FLAGS} == {f: variant.get(f, False) for f in FLAGS}
    assert draft.state_dict().keys() == state.keys()
    for name, value in draft.state_dict().items():
        assert torch.equal(value, state[name]), name
    prompt = torch.randint(3, V, (1, 9), generator=torch.Generator().manual_seed(1))
    logits, hs = ours_logits(draft, target, prompt)
    embed = target.get_input_embeddings().weight.detach()
    with torch.no_grad():
        reference = reference_logits(state, embed, hs, layers, prompt[0, 1:], **variant)
        shifted = reference_logits(state, embed, hs, [i - 1 for i in layers], prompt[0, 1:], **variant)
        flipped = [
            reference_logits(state, embed, hs, layers, prompt[0, 1:], **(variant | {f: False}))
            for f in FLAGS
            if variant.get(f)
        ]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits, shifted, atol=1e-2)  # the check tells one layer off from right
    for other in flipped:  # ... and each variant from the drafter without it
        assert not torch.allclose(logits, other, atol=1e-2)
    size = state["lm_head.weight"].shape[0]
    assert torch.equal(draft.to_target(torch.arange(size)), torch.arange(size) + state["d2t"])
    prop = EagleProposer(
        draft,
        target.get_input_embeddings(),
        target.get_output_embeddings(),
        depth=4,
        top_k=3,
        total_tokens=10,
    )
    spec = SpeculativeModel(target, prop)
    for length in (1, 6):
        p = torch.randint(3, V, (1, length), generator=torch.Generator().manual_seed(length))
        assert spec.generate(p, max_new_tokens=20)[0, length:].tolist() == plain_greedy(target, p, 20)


# ---------------------------------------------------------------- import SafeAILab / SGLang


def random_draft(target, size=0, feature_layers=None, seed=0, base_model="", **flags):
    """An EAGLE-3 drafter as training builds it (fc_bias False), every parameter random; a random draft
    vocabulary when `size`; `flags`: its variant (norm_before_residual, norm_before_fc)."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(
        HeadsConfig(
            kind="eagle3",
            base_model=base_model,
            hidden_size=H,
            vocab_size=V,
            fc_bias=False,
            layer=layer_fields(target.config),
            draft_vocab_size=size,
            feature_layers=feature_layers or default_feature_layers(L),
            **flags,
        )
    )
    for name, p in draft.named_parameters():
        torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.1)
    if size:
        draft.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:size])
    return draft.eval()


SPECULATORS_VARIANTS = [
    {"norm_before_residual": True},
    {"norm_before_fc": True},
    {"norm_before_residual": True, "norm_before_fc": True},
]  # the last: speculators' defaults
