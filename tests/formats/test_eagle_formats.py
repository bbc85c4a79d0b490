"""EAGLE-1 checkpoints of other projects: SafeAILab's layout in, `eagle1` / `sglang-eagle` out."""

import json
import math
import os
import warnings

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, LlamaConfig

from conftest import VOCAB, tiny_model, write_checkpoint
from selfspec.heads.config import HeadsConfig, check_compatible
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle import EagleDraft
from selfspec.heads.formats.eagle import (
    EAGLE_FORMATS,
    EMBED_KEY,
    LAYOUTS,
    detect_eagle_format,
    engine_keys,
    export_eagle,
    import_eagle,
    layer_keys,
    load_eagle_embedding,
    read_eagle_weights,
)
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.drafters.eagle import EagleProposer


def safeailab_checkpoint(
    path, cfg, embed, bias=True, weights="bin", num_layers=1, seed=0, dtype=torch.float32
):
    """A checkpoint laid out as SafeAILab publishes EAGLE-1 (yuhuili/EAGLE-LLaMA3-Instruct-8B): its config
    fields, its key names, fc on cat(embedding, feature); weights random."""
    H, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    inter = cfg.intermediate_size
    hd = H // heads
    gen = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.15):
        return torch.randn(*shape, generator=gen) * std

    state = {"embed_tokens.weight": embed.detach().clone(), "fc.weight": w(H, 2 * H)}
    if bias:
        state["fc.bias"] = w(H)
    for i in range(num_layers):
        p = f"layers.{i}."
        state |= {
            p + "self_attn.q_proj.weight": w(heads * hd, H),
            p + "self_attn.k_proj.weight": w(kv * hd, H),
            p + "self_attn.v_proj.weight": w(kv * hd, H),
            p + "self_attn.o_proj.weight": w(H, heads * hd),
            p + "mlp.gate_proj.weight": w(inter, H),
            p + "mlp.up_proj.weight": w(inter, H),
            p + "mlp.down_proj.weight": w(H, inter),
            p + "post_attention_layernorm.weight": 1 + w(H, std=0.1),
        }
        if i > 0:
            state[p + "input_layernorm.weight"] = 1 + w(H, std=0.1)
    state = {k: v.to(dtype) for k, v in state.items()}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "max_position_embeddings": 512,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": num_layers,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": embed.shape[0],
        "rope_theta": 10000.0,
    }
    if not bias:
        config["bias"] = False  # as in EAGLE-LLaMA3-Instruct-8B.json; absent means True
    write_checkpoint(path, config, state, weights)
    return state, config


def reference_forward(state, config, features, ids):
    """SafeAILab's EAGLE-1 forward (cnets1.py Model) written out in plain torch for one causal sequence:
    fc(cat(embed, feature)), Llama layer(s) with no input norm on layer 0, RoPE by rotate_half, no final
    norm."""
    H, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, eps, T = H // heads, config["rms_norm_eps"], ids.shape[0]
    x = torch.cat([state["embed_tokens.weight"][ids], features], -1) @ state["fc.weight"].T
    if "fc.bias" in state:
        x = x + state["fc.bias"]
    inv = 1.0 / config["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    freqs = torch.arange(T).float()[:, None] * inv[None]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()

    def rms(v, weight):
        return weight * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)

    def rope(v):
        return v * cos + torch.cat([-v[..., hd // 2 :], v[..., : hd // 2]], -1) * sin

    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        h = x if i == 0 else rms(x, state[p + "input_layernorm.weight"])
        q = rope((h @ state[p + "self_attn.q_proj.weight"].T).view(T, heads, hd).transpose(0, 1))
        k = rope((h @ state[p + "self_attn.k_proj.weight"].T).view(T, kv, hd).transpose(0, 1))
        v = (h @ state[p + "self_attn.v_proj.weight"].T).view(T, kv, hd).transpose(0, 1)
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd) + mask, -1) @ v
        x = x + att.transpose(0, 1).reshape(T, H) @ state[p + "self_attn.o_proj.weight"].T
        h = rms(x, state[p + "post_attention_layernorm.weight"])
        gate, up = h @ state[p + "mlp.gate_proj.weight"].T, h @ state[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ state[p + "mlp.down_proj.weight"].T
    return x


def plain_greedy(model, prompt, n):
    out = model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, prompt.shape[1] :].tolist()


def speculative(model, draft):
    prop = EagleProposer(
        draft, model.get_input_embeddings(), model.get_output_embeddings(), depth=4, top_k=3, total_tokens=10
    )
    return SpeculativeModel(model, prop)


def greedy_identical(model, draft, prompt, n):
    new = speculative(model, draft).generate(prompt, max_new_tokens=n)[0, prompt.shape[1] :].tolist()
    return new == plain_greedy(model, prompt, n)


def random_draft(model, fc_bias=True, num_layers=1, seed=0):
    """A drafter with every parameter random and non-zero (norm weights around 1)."""
    torch.manual_seed(seed)
    cfg = HeadsConfig(
        kind="eagle",
        hidden_size=model.config.hidden_size,
        vocab_size=VOCAB,
        fc_bias=fc_bias,
        num_layers=num_layers,
        layer=layer_fields(model.config),
    )
    draft = EagleDraft(cfg)
    for name, p in draft.named_parameters():
        torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.1)
    return draft.eval()


WARNINGS = {
    "vLLM 0.32 drops": "vllm drops fc.bias",
    "needs embed_tokens.weight": "no embedding",
    "head_dim x heads": "head_dim",
}


def export_warnings(draft, fmt, directory, **kwargs):
    """Export, and name every warning given (by WARNINGS, else its message) so a test asserts the exact
    list."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        export_eagle(draft, fmt, directory, **kwargs)
    return [
        next((tag for text, tag in WARNINGS.items() if text in str(w.message)), str(w.message))
        for w in record
    ]


def vllm_bias_warning(fmt, bias):
    return ["vllm drops fc.bias"] if fmt == "eagle1" and bias else []


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


# ---------------------------------------------------------------- import SafeAILab's layout


@pytest.mark.parametrize("weights", ["bin", "safetensors"])
@pytest.mark.parametrize("bias", [True, False], ids=["fc_bias", "no_bias"])
def test_import_safeailab_checkpoint_decodes_losslessly(tmp_path, llama, weights, bias):
    embed = llama.get_input_embeddings().weight
    state, config = safeailab_checkpoint(tmp_path, llama.config, embed, bias=bias, weights=weights)
    assert detect_eagle_format(tmp_path) == "eagle1"
    draft = import_eagle(tmp_path, base_model="tiny", target=llama)

    cfg = draft.config
    assert (cfg.kind, cfg.hidden_size, cfg.vocab_size, cfg.num_layers) == ("eagle", 48, VOCAB, 1)
    assert cfg.fc_bias == bias
    assert cfg.base_model == "tiny" and cfg.layer == layer_fields(llama.config)
    assert "embed_tokens.weight" not in draft.state_dict()  # ours uses the target's ...
    assert torch.equal(load_eagle_embedding(tmp_path), embed)  # ... which is what the file carries
    for name, value in draft.state_dict().items():
        assert torch.equal(value, state[name]), name

    # the imported drafter computes what SafeAILab's forward computes (fc halves, q/k/v, RoPE, norms)
    gen = torch.Generator().manual_seed(1)
    ids, features = torch.randint(3, VOCAB, (7,), generator=gen), torch.randn(7, 48, generator=gen)
    with torch.no_grad():
        ours = draft(features[None], ids[None], llama.get_input_embeddings())[0]
    torch.testing.assert_close(ours, reference_forward(state, config, features, ids), atol=1e-5, rtol=1e-5)

    for length in (1, 6):
        assert greedy_identical(llama, draft, torch.randint(3, VOCAB, (1, length), generator=gen), 24)


def test_import_two_layers_and_float16(tmp_path, llama):
    state, config = safeailab_checkpoint(
        tmp_path,
        llama.config,
        llama.get_input_embeddings().weight,
        num_layers=2,
        dtype=torch.float16,
        weights="safetensors",
    )
    draft = import_eagle(tmp_path)
    assert draft.config.num_layers == 2 and draft.config.dtype == "float16"
    assert draft.fc.weight.dtype == torch.float16
    assert "layers.1.input_layernorm.weight" in draft.state_dict()
    for name, value in draft.state_dict().items():
        assert torch.equal(value, state[name]), name
    draft = draft.float()
    ids, features = torch.randint(3, VOCAB, (5,)), torch.randn(5, 48)
    with torch.no_grad():
        ours = draft(features[None], ids[None], llama.get_input_embeddings())[0]
    ref_state = {k: v.float() for k, v in state.items()}
    ref_state["embed_tokens.weight"] = llama.get_input_embeddings().weight  # what ours reads
    ref = reference_forward(ref_state, config, features, ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert greedy_identical(llama, draft, torch.randint(3, VOCAB, (1, 4)), 20)


def test_sharded_safetensors_checkpoint(tmp_path, llama):
    embed = llama.get_input_embeddings().weight
    state, _ = safeailab_checkpoint(tmp_path, llama.config, embed, weights="safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert detect_eagle_format(tmp_path) == "eagle1"
    assert import_eagle(tmp_path).config.fc_bias


def test_a_drafter_for_another_hidden_size_is_a_clear_error(tmp_path, llama):
    other = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB
    )
    safeailab_checkpoint(tmp_path, other, torch.randn(VOCAB, 32))
    with pytest.raises(ValueError, match="heads expect hidden size 32 but the target .*has hidden size 48"):
        import_eagle(tmp_path, target=llama)
    draft = import_eagle(tmp_path)  # without a target it imports; the check runs where it meets one
    with pytest.raises(ValueError, match="hidden size 32 .* hidden size 48"):
        check_compatible(draft.config, llama)


def test_an_embedding_from_another_model_is_warned_about(tmp_path, llama):
    safeailab_checkpoint(tmp_path, llama.config, torch.randn(VOCAB, 48))
    with pytest.warns(UserWarning, match="embed_tokens differ from the target's"):
        import_eagle(tmp_path, target=llama)


# ---------------------------------------------------------------- unreadable input


def test_unreadable_checkpoints_are_clear_errors(tmp_path, llama):
    embed = llama.get_input_embeddings().weight
    with pytest.raises(ValueError, match="no config.json"):
        import_eagle(tmp_path)

    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not readable JSON \(.*line 1 column 2"):
        import_eagle(tmp_path, format="eagle1")

    safeailab_checkpoint(tmp_path, llama.config, embed)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot read the weights"):
        import_eagle(tmp_path, format="eagle1")

    state, _ = safeailab_checkpoint(tmp_path, llama.config, embed)
    torch.save({**state, "hook": os.getcwd}, tmp_path / "pytorch_model.bin")  # a pickled global: refused
    with pytest.raises(ValueError, match="cannot read the weights"):
        import_eagle(tmp_path, format="eagle1")

    torch.save({k: v for k, v in state.items() if "o_proj" not in k}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"missing \['layers.0.self_attn.o_proj.weight'\]"):
        import_eagle(tmp_path)

    torch.save({**state, "fc.weight": state["fc.weight"][:, :48]}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"fc.weight should have shape \(H, 2H\), found \(48, 48\)"):
        import_eagle(tmp_path, format="eagle1")

    torch.save({**state, "layers.0.mlp.up_proj.weight": torch.zeros(80, 48)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(
        ValueError, match=r"layers.0.mlp.up_proj.weight has shape \(80, 48\), expected \(96, 48\)"
    ):
        import_eagle(tmp_path)

    with pytest.raises(ValueError, match="unknown EAGLE format 'eagle9'"):
        import_eagle(tmp_path, format="eagle9")

    (tmp_path / "pytorch_model.bin").unlink()
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map":\n  {"fc.weight": }}')
    with pytest.raises(
        ValueError, match=r"model\.safetensors\.index\.json is not a readable weight index: .*line 2"
    ):
        import_eagle(tmp_path)


def test_other_directories_are_not_detected(tmp_path, llama):
    assert detect_eagle_format(tmp_path) is None
    random_draft(llama).save_pretrained(tmp_path / "ours")  # a selfspec heads directory
    assert detect_eagle_format(tmp_path / "ours") is None
    llama.save_pretrained(tmp_path / "target")  # a full causal LM
    assert detect_eagle_format(tmp_path / "target") is None
    eagle3 = tmp_path / "eagle3"
    eagle3.mkdir()
    (eagle3 / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    save_file(
        {"fc.weight": torch.zeros(48, 144), "midlayer.hidden_norm.weight": torch.ones(48)},
        str(eagle3 / "model.safetensors"),
    )
    assert detect_eagle_format(eagle3) is None
    with pytest.raises(ValueError, match="not an EAGLE-1 checkpoint"):
        import_eagle(eagle3)


# ---------------------------------------------------------------- export


def assert_same_draft(back, draft, embed):
    """Every key, every tensor bit for bit (dtype included), and the predicted features on a fixed input."""
    state, back_state = draft.state_dict(), back.state_dict()
    assert back_state.keys() == state.keys()
    for name, value in state.items():
        assert back_state[name].dtype == value.dtype and torch.equal(back_state[name], value), name
    gen = torch.Generator().manual_seed(3)
    ids, features = torch.randint(3, VOCAB, (1, 7), generator=gen), torch.randn(1, 7, 48, generator=gen)
    with torch.no_grad():
        assert torch.equal(back(features, ids, embed), draft(features, ids, embed))


@pytest.mark.parametrize("fmt", EAGLE_FORMATS)
@pytest.mark.parametrize("bias", [True, False], ids=["fc_bias", "no_bias"])
def test_export_import_round_trip_is_exact(tmp_path, llama, fmt, bias):
    draft = random_draft(llama, fc_bias=bias, seed=4)
    embed = llama.get_input_embeddings()
    assert export_warnings(draft, fmt, tmp_path, embed_weight=embed.weight) == vllm_bias_warning(fmt, bias)
    assert detect_eagle_format(tmp_path) == fmt
    back = import_eagle(tmp_path, target=llama)
    assert back.config.to_dict() == draft.config.to_dict()
    assert_same_draft(back, draft, embed)
    assert torch.equal(load_eagle_embedding(tmp_path), embed.weight)
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    assert greedy_identical(llama, back, prompt, 20)


def test_eagle1_as_pytorch_bin_round_trips(tmp_path, llama):
    draft = random_draft(llama, fc_bias=False, num_layers=2)
    export_eagle(draft, "eagle1", tmp_path, embed_weight=llama.get_input_embeddings().weight, weights="bin")
    assert (tmp_path / "pytorch_model.bin").is_file() and not (tmp_path / "model.safetensors").exists()
    back = import_eagle(tmp_path)
    assert back.config.to_dict() == draft.config.to_dict()
    assert_same_draft(back, draft, llama.get_input_embeddings())
    with pytest.raises(ValueError, match="already holds pytorch_model.bin"), pytest.warns(UserWarning):
        export_eagle(draft, "eagle1", tmp_path)


@pytest.mark.parametrize("fmt", EAGLE_FORMATS)
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("bias", [True, False], ids=["fc_bias", "no_bias"])
def test_export_writes_every_key_each_engine_reads(tmp_path, llama, fmt, num_layers, bias):
    draft, embed = (
        random_draft(llama, fc_bias=bias, num_layers=num_layers),
        llama.get_input_embeddings().weight,
    )
    assert export_warnings(draft, fmt, tmp_path, embed_weight=embed) == vllm_bias_warning(fmt, bias)
    written = read_eagle_weights(tmp_path)
    # exactly the drafter and the target's embedding; SGLang's fc always has a bias, zeros for none. Nothing a
    # loader would choke on: no `model.` prefix (SGLang and vLLM add it), no lm_head, no input norm on
    # layer 0.
    zero_bias = {"fc.bias": torch.zeros(48)} if fmt == "sglang-eagle" and not bias else {}
    want = draft.state_dict() | {EMBED_KEY: embed.detach()} | zero_bias
    assert (
        written.keys()
        == want.keys()
        == {"fc.weight", EMBED_KEY, *layer_keys(num_layers)}
        | ({"fc.bias"} if bias or fmt == "sglang-eagle" else set())
    )
    for name, value in want.items():
        assert torch.equal(written[name], value), name
    for engine in LAYOUTS[fmt].engines:
        assert set(engine_keys(engine, num_layers, bias)) <= written.keys(), engine


def test_safeailab_key_list_is_what_its_published_layout_holds(tmp_path, llama):
    for bias in (True, False):
        embed = llama.get_input_embeddings().weight
        state, _ = safeailab_checkpoint(tmp_path / str(bias), llama.config, embed, bias=bias, num_layers=2)
        assert set(state) == set(engine_keys("safeailab", 2, bias))


@pytest.mark.parametrize("fmt", EAGLE_FORMATS)
@pytest.mark.parametrize("bias", [True, False], ids=["fc_bias", "no_bias"])
def test_exported_config_is_a_llama_config_the_engines_read(tmp_path, llama, fmt, bias):
    draft = random_draft(llama, fc_bias=bias)
    assert export_warnings(
        draft, fmt, tmp_path, embed_weight=llama.get_input_embeddings().weight
    ) == vllm_bias_warning(fmt, bias)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == [
        {"eagle1": "LlamaForCausalLM", "sglang-eagle": "LlamaForCausalLMEagle"}[fmt]
    ]
    assert raw["model_type"] == "llama"
    assert raw["tie_word_embeddings"] is False and raw["rope_scaling"] is None
    # "bias" is SafeAILab's fc flag (absent = True); vLLM and SGLang read `bias: true` as attention bias
    assert raw.get("bias") is not True and ("bias" in raw) == (not bias)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, LlamaConfig) and not getattr(loaded, "attention_bias", False)
    assert layer_fields(loaded) == draft.config.layer
    assert (loaded.hidden_size, loaded.vocab_size, loaded.num_hidden_layers) == (48, VOCAB, 1)


def test_export_refuses_what_no_loader_reads(tmp_path, llama):
    draft = random_draft(llama)
    with pytest.raises(ValueError, match=r"embed_weight has shape \(10, 48\)"):
        export_eagle(draft, "eagle1", tmp_path, embed_weight=torch.zeros(10, 48))
    with pytest.raises(ValueError, match="unknown EAGLE format"):
        export_eagle(draft, "medusa", tmp_path)
    biased = EagleDraft(
        HeadsConfig(
            kind="eagle",
            hidden_size=48,
            vocab_size=VOCAB,
            layer=layer_fields(llama.config) | {"attention_bias": True},
        )
    )
    with pytest.raises(ValueError, match="tensors no EAGLE-1 loader reads"):
        export_eagle(biased, "sglang-eagle", tmp_path)
    assert not any(tmp_path.iterdir())  # refused before anything is written
    assert export_warnings(random_draft(llama, fc_bias=False), "eagle1", tmp_path / "no-embed") == [
        "no embedding"
    ]
    assert EMBED_KEY not in read_eagle_weights(tmp_path / "no-embed")
    assert export_warnings(random_draft(llama, fc_bias=False), "sglang-eagle", tmp_path / "sglang") == []
