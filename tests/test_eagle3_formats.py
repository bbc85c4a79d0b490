"""EAGLE-3 checkpoints of other projects: SafeAILab / SGLang (`eagle3`) and vllm-project/speculators
(`speculators-eagle3`) in, both out.

The published checkpoints are written here from the key names and config fields their projects document (not
by our exporter), on an 8-layer target so that three distinct layers are fused. What an imported drafter
computes is checked against a plain-torch EAGLE-3 forward over the hidden states the engines fuse (SGLang:
`eagle_config` id + 1; vLLM / speculators: the id itself; none: [2, L // 2, L - 3]), in the variant the config's
flags name (norm_before_residual, norm_before_fc: vLLM 0.32's llama_eagle3.py).
"""

import json
import math
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import WEIGHT_FILES, randomized, write_checkpoint
from selfspec.heads.config import HeadsConfig
from selfspec.heads.convert import export_heads, import_heads
from selfspec.heads.eagle import EagleDraft, layer_fields
from selfspec.heads.eagle3 import Eagle3Draft, default_feature_layers
from selfspec.heads.eagle3_formats import (
    EAGLE3_FORMATS,
    FLAGS,
    VARIANTS,
    detect_eagle3_format,
    export_eagle3,
    import_eagle3,
    layout_keys,
)
from selfspec.heads.eagle_formats import detect_eagle_format, export_eagle
from selfspec.heads.medusa import MedusaHeads
from selfspec.heads.registry import load_heads
from selfspec.infer.cli import main as cli
from selfspec.infer.eagle import EagleProposer
from selfspec.infer.generate import SpeculativeModel

H, HEADS, KV, INTER, V, L = 48, 4, 2, 96, 96, 8
HD = H // HEADS


def deep_target(seed=0):
    """An 8-layer, 48-wide random Llama (the shared tiny models have 2 layers: too few to fuse three)."""
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=L, num_attention_heads=HEADS,
                         num_key_value_heads=KV, vocab_size=V, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
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
        "midlayer.self_attn.k_proj.weight": w(KV * HD, 2 * H), "midlayer.self_attn.v_proj.weight": w(KV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, HEADS * HD),
        "midlayer.mlp.gate_proj.weight": w(INTER, H), "midlayer.mlp.up_proj.weight": w(INTER, H),
        "midlayer.mlp.down_proj.weight": w(H, INTER),
        "midlayer.input_layernorm.weight": 1 + w(H, std=0.1), "midlayer.hidden_norm.weight": 1 + w(H, std=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + w(H, std=0.1),
        "norm.weight": 1 + w(H, std=0.1), "lm_head.weight": w(size, H),
    }
    used = torch.randperm(V, generator=gen)[:size].sort().values  # the draft vocabulary, in target id order
    state["d2t"] = used - torch.arange(size)
    state["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, used, True)
    if input_norm:
        state["input_norm.weight"] = 1 + w(fused * H, std=0.1)
    return state


def merged(config, extra):
    """`config` with `extra` written over it; nested objects (eagle_config, transformer_layer_config) merged."""
    out = dict(config)
    for k, v in extra.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return {k: v for k, v in out.items() if v is not DROP}


DROP = object()  # a value in `extra` that removes the field


def safeailab_checkpoint(path, ids=None, size=40, weights="bin", seed=0, extra=None, state=None):
    """As yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (no ids) or a SpecForge drafter (`eagle_config` ids): a Llama config
    with draft_vocab_size, keys fc / midlayer.* / norm / lm_head / d2t / t2d."""
    state = published_tensors(size, seed=seed) if state is None else state
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": H, "initializer_range": 0.02, "intermediate_size": INTER, "max_position_embeddings": 2048,
        "model_type": "llama", "num_attention_heads": HEADS, "num_key_value_heads": KV, "num_hidden_layers": 1,
        "pad_token_id": 0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "float32",
        "transformers_version": "4.28.1", "use_cache": True, "vocab_size": V, "draft_vocab_size": size,
    }
    if ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    write_checkpoint(path, merged(config, extra or {}), state, weights)
    return state


def speculators_checkpoint(path, verifier, ids=None, size=40, embed=None, seed=0, extra=None, input_norm=False):
    """As vllm-project/speculators saves an Eagle3 speculator (Eagle3SpeculatorConfig, RedHatAI/*.eagle3):
    layers.0.* for the draft layer, the verifier's embed_tokens, d2t / t2d for a smaller draft vocabulary,
    input_norm.weight with norm_before_fc."""
    state = {k.replace("midlayer.", "layers.0."): v
             for k, v in published_tensors(size, seed=seed, input_norm=input_norm).items()}
    if embed is not None:
        state["embed_tokens.weight"] = embed.detach().clone()
    config = {
        "architectures": ["Eagle3Speculator"], "draft_vocab_size": size, "eagle_aux_hidden_state_layer_ids": ids,
        "embed_requires_grad": False, "fc_norm": False, "norm_before_fc": False, "norm_before_residual": False,
        "norm_output": False, "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
        "target_hidden_size": None, "torch_dtype": "float32", "transformers_version": "4.56.2",
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3,
                                  "verifier_accept_k": 1}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": str(verifier)},
        },
        "transformer_layer_config": {
            "head_dim": HD, "hidden_size": H, "intermediate_size": INTER, "max_position_embeddings": 2048,
            "model_type": "llama", "num_attention_heads": HEADS, "num_hidden_layers": 1, "num_key_value_heads": KV,
            "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
            "vocab_size": V,
        },
    }
    write_checkpoint(path, merged(config, extra or {}), state, "safetensors")
    return {k.replace("layers.0.", "midlayer."): v for k, v in state.items() if k != "embed_tokens.weight"}


def reference_logits(state, embed, hidden_states, layers, ids, norm_before_residual=False, norm_before_fc=False):
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
        return v * cos + torch.cat([-v[..., HD // 2:], v[..., : HD // 2]], -1) * sin

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
    """What the imported drafter computes over the target's own features of `prompt` (features at t, token t+1)."""
    with torch.no_grad():
        hs = target(prompt, output_hidden_states=True).hidden_states
        features = torch.cat([hs[i] for i in draft.config.feature_layers], -1)[:, :-1]
        out = draft(draft.fuse(features), prompt[:, 1:], target.get_input_embeddings())
        return draft.logits(out)[0], [s[0, :-1] for s in hs]


def plain_greedy(model, prompt, n):
    return model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)[0, prompt.shape[1]:].tolist()


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
        flipped = [reference_logits(state, embed, hs, layers, prompt[0, 1:], **(variant | {f: False}))
                   for f in FLAGS if variant.get(f)]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits, shifted, atol=1e-2)  # the check tells one layer off from right
    for other in flipped:  # ... and each variant from the drafter without it
        assert not torch.allclose(logits, other, atol=1e-2)
    size = state["lm_head.weight"].shape[0]
    assert torch.equal(draft.to_target(torch.arange(size)), torch.arange(size) + state["d2t"])
    prop = EagleProposer(draft, target.get_input_embeddings(), target.get_output_embeddings(), depth=4, top_k=3,
                         total_tokens=10)
    spec = SpeculativeModel(target, prop)
    for length in (1, 6):
        p = torch.randint(3, V, (1, length), generator=torch.Generator().manual_seed(length))
        assert spec.generate(p, max_new_tokens=20)[0, length:].tolist() == plain_greedy(target, p, 20)


# ---------------------------------------------------------------- import SafeAILab / SGLang


@pytest.mark.parametrize("weights", ["bin", "safetensors"])
@pytest.mark.parametrize("ids", [[0, 3, 6], None], ids=["eagle_config_ids", "no_ids"])
def test_import_safeailab_layout_computes_what_sglang_computes(tmp_path, target, target_dir, weights, ids):
    state = safeailab_checkpoint(tmp_path, ids=ids, weights=weights)
    assert detect_eagle3_format(tmp_path) == "eagle3" and detect_eagle_format(tmp_path) is None
    # SGLang captures hidden_states[id + 1] (llama.py set_eagle3_layers_to_capture); none: [2, L // 2, L - 3]
    layers = [1, 4, 7] if ids else [2, 4, 5]
    base = None if ids else str(target_dir)  # without ids the target's depth decides
    draft = import_eagle3(tmp_path, base_model=base, target=target)
    cfg = draft.config
    assert (cfg.kind, cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size) == ("eagle3", H, V, 40)
    assert not cfg.fc_bias  # Eagle3Draft's fc has none, as training writes it
    assert cfg.layer == layer_fields(LlamaConfig(**json.loads((tmp_path / "config.json").read_text())))
    assert cfg.base_model == (base or "")
    assert_decodes_like(draft, target, state, layers)


def test_import_without_ids_or_a_target_is_a_clear_error(tmp_path):
    safeailab_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"names no eagle_aux_hidden_state_layer_ids.*\[2, L // 2, L - 3\].*"
                                         "--base-model"):
        import_eagle3(tmp_path)


def test_sglang_layer_names_and_unsorted_ids_load_as_sglang_reads_them(tmp_path, target):
    """SGLang renames midlayer to layers.0 itself, and captures layers in increasing order whatever the list's."""
    state = published_tensors(40)
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
    safeailab_checkpoint(tmp_path, ids=[6, 0, 3], weights="safetensors", state=renamed)
    assert detect_eagle3_format(tmp_path) == "eagle3"
    draft = import_eagle3(tmp_path)
    assert draft.config.feature_layers == [1, 4, 7]
    for name, value in draft.state_dict().items():
        assert torch.equal(value, state[name]), name


# ---------------------------------------------------------------- import vllm-project/speculators


@pytest.mark.parametrize("ids", [[1, 4, 7], None], ids=["ids", "no_ids"])
def test_import_speculators_layout_computes_what_vllm_computes(tmp_path, target, target_dir, ids):
    embed = target.get_input_embeddings().weight
    state = speculators_checkpoint(tmp_path, target_dir, ids=ids, embed=embed)
    assert detect_eagle3_format(tmp_path) == "speculators-eagle3" and detect_eagle_format(tmp_path) is None
    draft = import_eagle3(tmp_path)  # the verifier config.json names is the target; its depth gives no_ids' layers
    cfg = draft.config
    assert cfg.base_model == str(target_dir) and cfg.depth == 3  # the verifier; speculative_tokens
    assert "embed_tokens.weight" not in draft.state_dict()  # the target's own is used, as vLLM shares it
    # vLLM captures hidden_states[id] as given (gpu_model_runner.py, llama.py idx + 1)
    assert_decodes_like(draft, target, state, ids or [2, 4, 5])


def test_speculators_embedding_from_another_model_is_warned_about(tmp_path, target, target_dir):
    speculators_checkpoint(tmp_path, target_dir, ids=[1, 4, 7], embed=torch.randn(V, H))
    with pytest.warns(UserWarning, match="embed_tokens differ from the target's"):
        import_eagle3(tmp_path, target=target)


SPECULATORS_VARIANTS = [{"norm_before_residual": True}, {"norm_before_fc": True},
                        {"norm_before_residual": True, "norm_before_fc": True}]  # the last: speculators' defaults


@pytest.mark.parametrize("variant", SPECULATORS_VARIANTS, ids=lambda v: "+".join(v))
def test_import_speculators_variants_computes_what_vllm_computes(tmp_path, target, target_dir, variant):
    state = speculators_checkpoint(tmp_path, target_dir, ids=[1, 4, 7], extra=variant,
                                   input_norm=variant.get("norm_before_fc", False))
    draft = import_eagle3(tmp_path)
    assert_decodes_like(draft, target, state, [1, 4, 7], **variant)


SAFEAILAB_VARIANTS = [  # (config fields, the flags vLLM reads from them)
    ({"eagle_config": {"norm_before_fc": True}}, {"norm_before_fc": True}),  # SGLang and vLLM read it here first
    ({"norm_before_fc": True}, {"norm_before_fc": True}),  # ... and at the top level when eagle_config has none
    ({"norm_before_fc": True, "eagle_config": {"norm_before_fc": False}}, {}),  # eagle_config wins
    ({"norm_before_residual": True}, {"norm_before_residual": True}),  # vLLM only: SGLang ignores it
]


@pytest.mark.parametrize(("extra", "variant"), SAFEAILAB_VARIANTS, ids=[json.dumps(e) for e, _ in SAFEAILAB_VARIANTS])
def test_import_safeailab_layout_variants_computes_what_vllm_computes(tmp_path, target, extra, variant):
    state = published_tensors(40, input_norm=variant.get("norm_before_fc", False))
    safeailab_checkpoint(tmp_path, ids=[0, 3, 6], weights="safetensors", extra=extra, state=state)
    assert_decodes_like(import_eagle3(tmp_path), target, state, [1, 4, 7], **variant)


def test_norm_before_fc_needs_its_input_norm_of_the_fc_input_width(tmp_path):
    state = published_tensors(40)
    safeailab_checkpoint(tmp_path, ids=[0, 3, 6], extra={"eagle_config": {"norm_before_fc": True}}, state=state)
    with pytest.raises(ValueError, match=r"missing \['input_norm.weight'\]"):
        import_eagle3(tmp_path)
    torch.save(state | {"input_norm.weight": torch.ones(H)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"input_norm.weight has shape \(48,\), expected \(144,\)"):
        import_eagle3(tmp_path)


def test_full_vocabulary_without_vocab_maps_is_the_identity(tmp_path, target):
    state = published_tensors(V)
    del state["d2t"], state["t2d"]  # speculators saves none (model.py), SafeAILab deletes them (ea_model.py)
    safeailab_checkpoint(tmp_path, ids=[0, 3, 6], size=V, state=state)
    draft = import_eagle3(tmp_path)
    assert draft.config.draft_vocab_size == 0
    assert torch.equal(draft.to_target(torch.arange(V)), torch.arange(V)) and bool(draft.t2d.all())


def test_a_t2d_that_disagrees_with_d2t_is_rebuilt_with_a_warning(tmp_path):
    state = published_tensors(40)
    wrong = state | {"t2d": ~state["t2d"]}
    safeailab_checkpoint(tmp_path, ids=[0, 3, 6], state=wrong)
    with pytest.warns(UserWarning, match="t2d does not mark exactly the target ids d2t maps to"):
        draft = import_eagle3(tmp_path)
    assert torch.equal(draft.t2d, state["t2d"])


# ---------------------------------------------------------------- variants and other refusals


REFUSED = [
    ("eagle3", {"eagle_config": {"use_aux_hidden_state": False}}),
    ("eagle3", {"fc_norm": True}),
    ("eagle3", {"use_aux_norm": True}),
    ("eagle3", {"norm_output": True}),
    ("eagle3", {"bias": True}),
    ("eagle3", {"logit_scale": 0.5}),
    ("speculators-eagle3", {"fc_norm": True}),
    ("speculators-eagle3", {"norm_output": True}),
    ("speculators-eagle3", {"transformer_layer_config": {"logit_scale": 2.0}}),
]


def published(fmt, path, verifier, extra):
    if fmt == "eagle3":
        return safeailab_checkpoint(path, ids=[0, 3, 6], extra=extra)
    return speculators_checkpoint(path, verifier, ids=[1, 4, 7], extra=extra)


@pytest.mark.parametrize(("fmt", "extra"), REFUSED, ids=[f"{f}-{json.dumps(e)}" for f, e in REFUSED])
def test_each_variant_flag_is_refused_naming_it(tmp_path, target_dir, fmt, extra):
    published(fmt, tmp_path, target_dir, extra)
    flag, value = next(iter(extra.items()))
    if isinstance(value, dict):
        flag, value = next(iter(value.items()))
    with pytest.raises(ValueError, match=f"{flag} = {json.dumps(value)} means .*Eagle3Draft does not compute"):
        import_eagle3(tmp_path)


def test_every_variant_flag_is_exercised():
    named = set()
    for _, extra in REFUSED:
        for key, value in extra.items():
            named |= set(value) if isinstance(value, dict) else {key}
    assert named == set(VARIANTS)


@pytest.mark.parametrize("fmt", EAGLE3_FORMATS)
def test_flags_at_their_neutral_values_load(tmp_path, target_dir, fmt):
    neutral = {flag: v.neutral for flag, v in VARIANTS.items() if flag != "use_aux_hidden_state"}
    neutral |= {flag: False for flag in FLAGS}
    extra = neutral | {"eagle_config": {"norm_before_fc": False, "use_aux_hidden_state": True}} if fmt == "eagle3" \
        else neutral | {"transformer_layer_config": {"logit_scale": 1.0}}
    state = published(fmt, tmp_path, target_dir, extra)
    draft = import_eagle3(tmp_path)
    for name, value in draft.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_speculators_config_without_norm_before_residual_is_read_as_vllm_reads_it(tmp_path, target_dir):
    speculators_checkpoint(tmp_path, target_dir, ids=[1, 4, 7], extra={"norm_before_residual": DROP})
    with pytest.warns(UserWarning, match="norm_before_residual is absent, which vLLM reads as true"):
        draft = import_eagle3(tmp_path)
    assert draft.config.norm_before_residual is True and draft.config.norm_before_fc is False


STRUCTURAL = [
    ("eagle3", {"num_hidden_layers": 2}, "num_hidden_layers = 2 draft layers; Eagle3Draft has one"),
    ("eagle3", {"target_hidden_size": 64}, "target_hidden_size 64 differs from the draft's hidden_size 48"),
    ("eagle3", {"attention_bias": True}, "attention_bias: true"),
    ("eagle3", {"architectures": ["GptOssForCausalLMEagle3"]}, "Eagle3Draft computes the Llama EAGLE-3 layer"),
    ("eagle3", {"eagle_aux_hidden_state_layer_ids": [0, 3, 6]},
     r"SGLang fuses hidden_states \[1, 4, 7\] .* but vLLM \[0, 3, 6\]"),
    ("eagle3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3]}},
     "fuses 3 hidden states, but the config names 2 layers"),
    ("eagle3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 3]}}, r"\[1, 4, 4\] repeat one"),
    ("eagle3", {"num_aux_hidden_states": 2}, "and num_aux_hidden_states 2"),
    ("eagle3", {"draft_vocab_size": 41}, "draft_vocab_size is 41 but lm_head.weight has 40 rows"),
    ("speculators-eagle3", {"transformer_layer_config": {"model_type": "qwen3"}}, "the draft layer is 'qwen3'"),
    ("speculators-eagle3", {"norm_before_fc": "yes"}, 'norm_before_fc must be true or false, got "yes"'),
    ("eagle3", {"eagle_config": {"norm_before_fc": 1}}, "norm_before_fc must be true or false, got 1"),
    ("speculators-eagle3", {"eagle_aux_hidden_state_layer_ids": [1, 4, 8]},
     r"indices \[1, 4, 8\] must lie in \[0, L - 1 = 7\] .index L is normed in transformers"),
]


@pytest.mark.parametrize(("fmt", "extra", "message"), STRUCTURAL, ids=[m[:30] for _, _, m in STRUCTURAL])
def test_what_eagle3draft_cannot_be_is_refused(tmp_path, target_dir, fmt, extra, message):
    published(fmt, tmp_path, target_dir, extra)
    with pytest.raises(ValueError, match=message):
        import_eagle3(tmp_path)


def test_unreadable_or_incomplete_weights_are_clear_errors(tmp_path):
    state = safeailab_checkpoint(tmp_path, ids=[0, 3, 6])
    torch.save({**state, "hook": os.getcwd}, tmp_path / "pytorch_model.bin")  # a pickled global
    with pytest.raises(ValueError, match=r"cannot read the weights .*weights_only=True"):
        import_eagle3(tmp_path, format="eagle3")
    torch.save({k: v for k, v in state.items() if k != "lm_head.weight"}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no lm_head.weight: this drafter would use the target's lm_head"):
        import_eagle3(tmp_path)
    torch.save({k: v for k, v in state.items() if "o_proj" not in k}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"missing \['midlayer.self_attn.o_proj.weight'\]"):
        import_eagle3(tmp_path)
    torch.save(state | {"midlayer.mlp.up_proj.weight": torch.zeros(80, H)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"midlayer.mlp.up_proj.weight has shape \(80, 48\), expected \(96, 48\)"):
        import_eagle3(tmp_path)
    torch.save(state | {"input_norm.weight": torch.ones(3 * H)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"unexpected \['input_norm.weight'\]"):
        import_eagle3(tmp_path)
    torch.save(state | {"d2t": state["d2t"] + V}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"d2t maps draft ids to target ids outside \[0, 96\)"):
        import_eagle3(tmp_path)
    quantized = state | {"midlayer.hidden_norm.weight": torch.ones(H, dtype=torch.int8)}
    torch.save(quantized, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="midlayer.hidden_norm.weight is torch.int8; quantized drafters"):
        import_eagle3(tmp_path)


def test_detection_tells_the_layouts_apart(tmp_path, target, target_dir):
    assert detect_eagle3_format(tmp_path) is None  # empty
    safeailab_checkpoint(tmp_path / "sglang", ids=[0, 3, 6])
    speculators_checkpoint(tmp_path / "speculators", target_dir, ids=[1, 4, 7])
    assert isinstance(import_heads(tmp_path / "sglang"), Eagle3Draft)
    assert import_heads(tmp_path / "speculators").config.feature_layers == [1, 4, 7]
    speculators_checkpoint(tmp_path / "peagle", target_dir, ids=[1, 4, 7], extra={"speculators_model_type": "peagle"})
    assert detect_eagle3_format(tmp_path / "peagle") is None
    eagle1 = EagleDraft(HeadsConfig(kind="eagle", hidden_size=H, vocab_size=V, layer=layer_fields(target.config)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_eagle(eagle1, "eagle1", tmp_path / "eagle1")
    assert detect_eagle3_format(tmp_path / "eagle1") is None and detect_eagle_format(tmp_path / "eagle1") == "eagle1"
    random_draft(target).save_pretrained(tmp_path / "ours")  # a selfspec heads directory
    assert detect_eagle3_format(tmp_path / "ours") is None
    assert detect_eagle3_format(target_dir) is None  # a full causal LM


# ---------------------------------------------------------------- export


def random_draft(target, size=0, feature_layers=None, seed=0, base_model="", **flags):
    """An EAGLE-3 drafter as training builds it (fc_bias False), every parameter random; a random draft
    vocabulary when `size`; `flags`: its variant (norm_before_residual, norm_before_fc)."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(HeadsConfig(kind="eagle3", base_model=base_model, hidden_size=H, vocab_size=V, fc_bias=False,
                                    layer=layer_fields(target.config), draft_vocab_size=size,
                                    feature_layers=feature_layers or default_feature_layers(L), **flags))
    for name, p in draft.named_parameters():
        torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.1)
    if size:
        draft.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:size])
    return draft.eval()


def assert_same_draft(back, draft):
    assert back.config.to_dict() == draft.config.to_dict()
    state, back_state = draft.state_dict(), back.state_dict()
    assert back_state.keys() == state.keys()
    for name, value in state.items():
        assert back_state[name].dtype == value.dtype and torch.equal(back_state[name], value), name


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
@pytest.mark.parametrize("size", [40, 0], ids=["draft_vocab", "full_vocab"])
@pytest.mark.parametrize("fmt", EAGLE3_FORMATS)
def test_export_import_round_trip_is_exact(tmp_path, target, fmt, size, weights):
    draft = random_draft(target, size, feature_layers=[1, 3, 6], base_model="org/target")
    draft.config.dtype = "bfloat16"  # the weights stay float32: each kept as it is
    if fmt == "speculators-eagle3":
        draft.config.depth = 5  # carried as speculative_tokens; the eagle3 layout has no decoding settings
    export_eagle3(draft, fmt, tmp_path, weights=weights, target=target if fmt == "speculators-eagle3" else None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", WEIGHT_FILES[weights]]
    assert detect_eagle3_format(tmp_path) == fmt and detect_eagle_format(tmp_path) is None
    back = import_eagle3(tmp_path, base_model="org/target" if fmt == "eagle3" else None)
    assert_same_draft(back, draft)
    file = tmp_path / WEIGHT_FILES[weights]
    written = load_file(file) if weights == "safetensors" else torch.load(file, weights_only=True)
    assert set(written) == layout_keys(fmt, draft_vocab=bool(size))
    # a full-vocabulary drafter has no d2t: vLLM's loader has no parameter for one (llama_eagle3.py)
    assert ("d2t" in written) == bool(size)
    # speculators saves the verifier's embedding, and its loader leaves a missing one uninitialised
    assert ("embed_tokens.weight" in written) == (fmt == "speculators-eagle3")
    if fmt == "speculators-eagle3":
        assert torch.equal(written["embed_tokens.weight"], target.get_input_embeddings().weight)


def at(raw, path):
    """config.json's value at a dotted path, or DROP where it is absent."""
    for key in path.split("."):
        raw = raw.get(key, DROP) if isinstance(raw, dict) else DROP
    return raw


# (layout, the drafter's flags, where the layout's engines read them in config.json: speculators-eagle3 at the top
# level (vLLM update_eagle3); eagle3 norm_before_fc in eagle_config (SGLang and vLLM read it there first) and no
# norm_before_residual, which SGLang ignores)
ROUND_TRIPS = [("speculators-eagle3", v, {f: v.get(f, False) for f in FLAGS}) for v in SPECULATORS_VARIANTS] + [
    ("eagle3", {"norm_before_fc": True}, {"eagle_config.norm_before_fc": True, "norm_before_residual": DROP})]


@pytest.mark.parametrize(("fmt", "variant", "written"), ROUND_TRIPS,
                         ids=[f"{f}-{'+'.join(v)}" for f, v, _ in ROUND_TRIPS])
def test_export_import_round_trip_keeps_the_variant_flags(tmp_path, target, fmt, variant, written):
    draft = random_draft(target, 40, feature_layers=[1, 3, 6], **variant)
    assert (draft.input_norm is not None) == variant.get("norm_before_fc", False)
    export_eagle3(draft, fmt, tmp_path, target=target if fmt == "speculators-eagle3" else None)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert {path: at(raw, path) for path in written} == written
    names = set(load_file(tmp_path / "model.safetensors"))
    assert names == layout_keys(fmt, draft_vocab=True, norm_before_fc=variant.get("norm_before_fc", False))
    assert ("input_norm.weight" in names) == variant.get("norm_before_fc", False)  # the engines' name
    assert_same_draft(import_eagle3(tmp_path, base_model=""), draft)


def test_eagle3_config_is_what_sglang_safeailab_and_vllm_read(tmp_path, target):
    draft = random_draft(target, 40, feature_layers=[1, 3, 6])
    export_eagle3(draft, "eagle3", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["model_type"] == "llama"
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]  # SGLang adds 1
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # vLLM reads this first, as given
    assert raw["draft_vocab_size"] == 40 and raw["vocab_size"] == V and raw["num_hidden_layers"] == 1
    assert raw["tie_word_embeddings"] is False and "bias" not in raw  # SGLang: bias is fc's, tie makes lm_head embed
    assert not set(raw) & {f for f in [*VARIANTS, *FLAGS] if f != "bias"}  # every variant flag at its default
    assert raw["eagle_config"]["norm_before_fc"] is False
    assert layer_fields(LlamaConfig(**raw)) == draft.config.layer
    safeailab = published_tensors(40)
    assert set(load_file(tmp_path / "model.safetensors")) == set(safeailab)  # SafeAILab's names exactly


def test_speculators_config_is_what_vllm_reads(tmp_path, target, target_dir):
    draft = random_draft(target, 40, feature_layers=[1, 3, 6])
    with pytest.warns(UserWarning, match="names the verifier as .*, a path on this machine.*--base-model <Hub id>"):
        export_eagle3(draft, "speculators-eagle3", tmp_path, base_model=str(target_dir), target=target)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "model_type" not in raw  # vLLM: speculators_config and no model_type make a speculators config
    assert raw["architectures"] == ["Eagle3Speculator"] and raw["speculators_model_type"] == "eagle3"
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # hidden_states indices, as vLLM reads them
    assert raw["norm_before_residual"] is False  # written: vLLM reads an absent one as true
    assert not any(raw[f] for f in ("norm_before_fc", "fc_norm", "norm_output"))
    assert raw["draft_vocab_size"] == 40 and raw["target_hidden_size"] is None
    layer = raw["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["vocab_size"] == V and layer["num_hidden_layers"] == 1
    assert layer_fields(LlamaConfig(**layer)) == draft.config.layer
    spec = raw["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == draft.config.depth
    assert spec["verifier"] == {"name_or_path": str(target_dir.resolve()), "architectures": ["LlamaForCausalLM"]}
    hand = speculators_checkpoint(tmp_path / "hand", target_dir, ids=[1, 3, 6])
    published_names = {k.replace("midlayer.", "layers.0.") for k in hand} | {"embed_tokens.weight"}
    assert set(load_file(tmp_path / "model.safetensors")) == published_names


def test_export_refuses_what_the_layouts_cannot_hold(tmp_path, target):
    eagle1 = EagleDraft(HeadsConfig(kind="eagle", hidden_size=H, vocab_size=V, layer=layer_fields(target.config)))
    medusa = MedusaHeads(HeadsConfig(hidden_size=H, vocab_size=V))
    for fmt in EAGLE3_FORMATS:
        for heads in (eagle1, medusa):
            kind = heads.config.kind
            with pytest.raises(ValueError, match=f"{fmt} is an EAGLE-3 layout but these heads are {kind}"):
                export_heads(heads, fmt, tmp_path / "x")
    draft = random_draft(target, 40)
    for fmt in ("eagle1", "sglang-eagle"):
        with pytest.raises(ValueError, match=f"{fmt} is an EAGLE-1 layout but these heads are eagle3: choose one of "
                                             "eagle3, speculators-eagle3"):
            export_heads(draft, fmt, tmp_path / "x")
    with pytest.raises(ValueError, match="eagle3's config.json names no base model"):
        export_heads(draft, "eagle3", tmp_path / "x", base_model="org/x")
    with pytest.raises(ValueError, match=r"feature_layers \[5, 2, 4\] must be strictly increasing"):
        export_eagle3(random_draft(target, feature_layers=[5, 2, 4]), "eagle3", tmp_path / "x")
    with pytest.raises(ValueError, match="fuses 2 hidden states; vLLM 0.32 builds .* for 3"):
        export_eagle3(random_draft(target, feature_layers=[2, 5]), "speculators-eagle3", tmp_path / "x")
    wider = deep_target(1)
    wider.resize_token_embeddings(V + 1)
    with pytest.raises(ValueError, match="carries the target's input embedding .* give the target"):
        export_eagle3(draft, "speculators-eagle3", tmp_path / "x")
    with pytest.raises(ValueError, match=r"input embedding is \(97, 48\).* give the target it was trained on"):
        export_eagle3(draft, "speculators-eagle3", tmp_path / "x", target=wider)
    with pytest.raises(ValueError, match=r"include hidden_states\[8\], which transformers norms"):
        export_eagle3(random_draft(target, feature_layers=[2, 4, 8]), "eagle3", tmp_path / "x", target=target)
    shuffled = random_draft(target)
    shuffled.d2t[:2] = torch.tensor([1, -1])  # the whole vocabulary, two ids swapped
    with pytest.raises(ValueError, match="whole target vocabulary in another order"):
        export_eagle3(shuffled, "eagle3", tmp_path / "x")
    with pytest.raises(ValueError, match="norm_before_residual, which SGLang and SafeAILab do not read.*"
                                         "export it as speculators-eagle3"):
        export_eagle3(random_draft(target, 40, norm_before_residual=True), "eagle3", tmp_path / "x")
    stale = random_draft(target, 40)
    stale.t2d.fill_(True)
    with pytest.raises(ValueError, match="t2d does not mark exactly the target ids d2t maps to"):
        export_eagle3(stale, "eagle3", tmp_path / "x")
    assert not (tmp_path / "x").exists()  # refused before anything is written
    export_eagle3(draft, "eagle3", tmp_path / "y", weights="bin")
    with pytest.raises(ValueError, match="already holds pytorch_model.bin"):
        export_eagle3(draft, "eagle3", tmp_path / "y")
    # a two-layer drafter exports as eagle3: SGLang and vLLM size fc from eagle_config's ids
    two = random_draft(target, feature_layers=[2, 5])
    export_eagle3(two, "eagle3", tmp_path / "two")
    assert_same_draft(import_eagle3(tmp_path / "two"), two)


@pytest.mark.parametrize("fmt", EAGLE3_FORMATS)
def test_cli_export_then_import_keeps_the_drafter(tmp_path, target, target_dir, fmt, capsys):
    draft = random_draft(target, 40, base_model=str(target_dir))
    draft.save_pretrained(tmp_path / "ours")
    cli(["export", "--heads", str(tmp_path / "ours"), "--format", fmt, "--out", str(tmp_path / "out")])
    cli(["import", "--src", str(tmp_path / "out"), "--out", str(tmp_path / "back"), "--base-model", str(target_dir)])
    assert "imported eagle3 heads" in capsys.readouterr().out
    assert_same_draft(load_heads(tmp_path / "back"), draft)
