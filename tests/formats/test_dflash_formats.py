"""DFlash layouts: z-lab's `dflash` and speculators' `speculators-dflash` written as their loaders read them,
read back exactly, and a checkpoint written by hand in z-lab's layout computes what a plain re-implementation
of the published drafter computes from its raw tensors (the +1 of the layer ids, fc's order, the norms,
RoPE)."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import tiny_model
from dflash_drafts import MASK, plain_greedy, proposer, random_draft
from selfspec.cli import main as cli
from selfspec.heads.formats import detect_format, export_heads, import_heads
from selfspec.heads.formats.dflash import DFLASH_FORMATS
from selfspec.heads.registry import load_heads
from selfspec.infer.core.generate import SpeculativeModel


@pytest.fixture
def target():
    return tiny_model("llama")


def assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    for field in (
        "feature_layers",
        "block_size",
        "mask_token_id",
        "qk_norm",
        "num_layers",
        "layer",
        "hidden_size",
        "vocab_size",
    ):
        assert getattr(a.config, field) == getattr(b.config, field), field


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
@pytest.mark.parametrize("fmt", DFLASH_FORMATS)
def test_export_import_round_trip_is_exact_and_the_config_is_what_the_engines_read(
    tmp_path, target, fmt, weights
):
    draft = random_draft(target, block=5)
    if (
        weights == "safetensors"
    ):  # a target with tied embeddings (the demo's, SmolLM2's): one tensor, written twice
        target.lm_head.weight = target.model.embed_tokens.weight
    export_heads(
        draft, fmt, tmp_path, target, base_model="org/target" if fmt != "dflash" else None, weights=weights
    )
    assert detect_format(tmp_path) == fmt
    raw = json.loads((tmp_path / "config.json").read_text())
    file = tmp_path / ("model.safetensors" if weights == "safetensors" else "pytorch_model.bin")
    written = load_file(file) if weights == "safetensors" else torch.load(file, weights_only=True)
    layers = draft.config.feature_layers
    if fmt == "dflash":
        assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
        assert raw["dflash_config"]["target_layer_ids"] == [j - 1 for j in layers]  # decoder layer outputs
        assert raw["dflash_config"]["mask_token_id"] == MASK and raw["block_size"] == 5
        assert raw["num_target_layers"] == target.config.num_hidden_layers
        assert raw["dflash_config"]["causal"] is False and set(raw["layer_types"]) == {"full_attention"}
        assert not {"embed_tokens.weight", "lm_head.weight"} & set(written)  # the target's, never carried
    else:
        assert raw["speculators_model_type"] == "dflash" and raw["aux_hidden_state_layer_ids"] == layers
        assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
        assert raw["speculators_config"]["verifier"]["name_or_path"] == "org/target"
        assert raw["sliding_window_non_causal"] is True  # vLLM 0.32 reads false as causal layers
        assert torch.equal(written["embed_tokens.weight"], target.get_input_embeddings().weight)
        assert torch.equal(written["lm_head.weight"], target.get_output_embeddings().weight)
    assert {k for k in written if "q_norm" in k} and not any("inv_freq" in k for k in written)
    back = import_heads(tmp_path)
    assert_same(back, draft)
    assert (back.config.depth, back.config.top_k) == (4, 1)  # the engines' chain of block_size - 1
    assert back.config.base_model == ("org/target" if fmt != "dflash" else "")


def test_cli_export_then_import_decodes_identically(tmp_path, target, tiny_model_dir, capsys):
    target = tiny_model("llama")  # tiny_model_dir's weights
    draft = random_draft(target, block=5)
    draft.config.base_model = str(tiny_model_dir)
    draft.save_pretrained(tmp_path / "ours")
    cli(
        [
            "export",
            "--heads",
            str(tmp_path / "ours"),
            "--format",
            "speculators-dflash",
            "--out",
            str(tmp_path / "x"),
        ]
    )
    cli(["import", "--src", str(tmp_path / "x"), "--out", str(tmp_path / "back")])
    assert "imported" in capsys.readouterr().out
    for loaded in (load_heads(tmp_path / "back"), load_heads(tmp_path / "x")):  # converted, and read as it is
        assert_same(loaded, draft)
        spec = SpeculativeModel(target, proposer(target, loaded))
        prompt = torch.tensor([[5, 9, 14, 3]])
        assert spec.generate(prompt, max_new_tokens=20)[0, 4:].tolist() == plain_greedy(target, prompt, 20)


# ---------------------------------------------------------------- a checkpoint written by hand, z-lab's way

H, HEADS, KV, D, FFN, VOCAB, B = 32, 4, 2, 8, 48, 50, 4
LAYER_IDS = [0, 2]  # decoder layer outputs: hidden_states[1] and hidden_states[3]


def zlab_checkpoint(path, num_layers=2):
    """config.json and weights as z-lab publishes them (Qwen3 draft layers, top-level block_size)."""
    g = torch.Generator().manual_seed(0)
    w = {
        "fc.weight": torch.randn(H, len(LAYER_IDS) * H, generator=g) * 0.2,
        "hidden_norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
    }
    shapes = {
        "self_attn.q_proj": (HEADS * D, H),
        "self_attn.k_proj": (KV * D, H),
        "self_attn.v_proj": (KV * D, H),
        "self_attn.o_proj": (H, HEADS * D),
        "mlp.gate_proj": (FFN, H),
        "mlp.up_proj": (FFN, H),
        "mlp.down_proj": (H, FFN),
    }
    for i in range(num_layers):
        for name, shape in shapes.items():
            w[f"layers.{i}.{name}.weight"] = torch.randn(*shape, generator=g) * 0.2
        for name, size in (
            ("input_layernorm", H),
            ("post_attention_layernorm", H),
            ("self_attn.q_norm", D),
            ("self_attn.k_norm", D),
        ):
            w[f"layers.{i}.{name}.weight"] = 1 + 0.1 * torch.randn(size, generator=g)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": D,
        "num_hidden_layers": num_layers,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_layers,
        "layer_types": ["full_attention"] * num_layers,
        "torch_dtype": "float32",
        "block_size": B,
        "num_target_layers": 4,
        "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": LAYER_IDS},
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(w, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    return w, config


def rms(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def rope(x, positions, theta=1000000.0):
    inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    angles = positions[:, None].float() * inv
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * cos + half * sin


def reference_block(w, num_layers, features, block):
    """The published drafter written out from its raw tensors: one block (B, H) after C context positions."""
    C = features.shape[0]
    ctx = rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = block
    pos_ctx, pos_block = torch.arange(C), torch.arange(C, C + B)
    for i in range(num_layers):
        p = lambda name, i=i: w[f"layers.{i}.{name}.weight"]  # noqa: E731
        x = rms(h, p("input_layernorm"))
        q = rms((x @ p("self_attn.q_proj").T).view(B, HEADS, D), p("self_attn.q_norm"))
        kv_in = torch.cat([ctx, x])
        k = rms((kv_in @ p("self_attn.k_proj").T).view(C + B, KV, D), p("self_attn.k_norm"))
        v = (kv_in @ p("self_attn.v_proj").T).view(C + B, KV, D)
        q = rope(q.transpose(0, 1), pos_block)
        k = rope(k.transpose(0, 1), torch.cat([pos_ctx, pos_block])).repeat_interleave(HEADS // KV, 0)
        v = v.transpose(0, 1).repeat_interleave(HEADS // KV, 0)
        att = torch.softmax(q @ k.transpose(-1, -2) / D**0.5, -1) @ v  # no mask: every query sees everything
        h = h + att.transpose(0, 1).reshape(B, HEADS * D) @ p("self_attn.o_proj").T
        y = rms(h, p("post_attention_layernorm"))
        h = h + (F.silu(y @ p("mlp.gate_proj").T) * (y @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
    return rms(h, w["norm.weight"])


def test_a_zlab_checkpoint_computes_the_published_drafter(tmp_path):
    w, config = zlab_checkpoint(tmp_path)
    assert (
        detect_format(tmp_path) == "dflash"
    )  # not eagle1, whose detector also sees fc.weight and layers.0.*
    draft = import_heads(tmp_path)
    assert draft.config.feature_layers == [1, 3] and draft.config.mask_token_id == VOCAB - 1
    assert draft.config.qk_norm and draft.config.block_size == B
    g = torch.Generator().manual_seed(1)
    hidden_states = [torch.randn(9, H, generator=g) for _ in range(5)]
    features = torch.cat([hidden_states[j + 1] for j in LAYER_IDS], -1)  # z-lab: hidden_states[id + 1]
    block = torch.randn(B, H, generator=g)
    want = reference_block(w, 2, features, block)
    ours = draft(
        torch.cat([hidden_states[j] for j in draft.config.feature_layers], -1)[None],
        block[None],
        torch.arange(9)[None],
        torch.arange(9, 9 + B)[None],
    )
    torch.testing.assert_close(ours[0], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["dflash_config"].update(causal=True), "causal"),
        (lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), "sliding-window"),
        (lambda c: c.update(use_sliding_window=True), "sliding-window"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id must be an integer"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[0]), "fc.weight is"),
        (lambda c: c.update(model_type="gemma3"), "Qwen3"),
        (lambda c: c.update(attention_bias=True), "attention_bias"),
    ],
)
def test_what_the_drafter_does_not_compute_is_refused_in_one_line(tmp_path, edit, message):
    w, config = zlab_checkpoint(tmp_path)
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as e:
        import_heads(tmp_path)
    assert "\n" not in str(e.value)


def test_extra_tensors_and_a_mask_embedding_are_refused(tmp_path):
    w, _ = zlab_checkpoint(tmp_path)
    (tmp_path / "mask_embedding.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="mask embedding"):
        import_heads(tmp_path)
    (tmp_path / "mask_embedding.pt").unlink()
    save_file(w | {"d2t": torch.zeros(10, dtype=torch.long)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="draft vocabulary"):
        import_heads(tmp_path)
    save_file(
        {k: v for k, v in w.items() if k != "layers.1.mlp.up_proj.weight"}, tmp_path / "model.safetensors"
    )
    with pytest.raises(ValueError, match=r"missing \['layers.1.mlp.up_proj.weight'\]"):
        import_heads(tmp_path)


def test_exports_the_engines_cannot_serve_are_refused(tmp_path, target):
    with pytest.raises(ValueError, match="q_norm/k_norm"):
        export_heads(random_draft(target, qk_norm=False), "dflash", tmp_path)
    with pytest.raises(ValueError, match="give the target"):
        export_heads(random_draft(target), "speculators-dflash", tmp_path)
    with pytest.raises(ValueError, match="names no base model"):
        export_heads(random_draft(target), "dflash", tmp_path, base_model="org/x")
    with pytest.raises(ValueError, match="layout of DFlash drafters but these heads are eagle"):
        from selfspec.heads.config import HeadsConfig
        from selfspec.heads.draft_layers import layer_fields
        from selfspec.heads.eagle import EagleDraft

        export_heads(
            EagleDraft(
                HeadsConfig(kind="eagle", hidden_size=48, vocab_size=96, layer=layer_fields(target.config))
            ),
            "dflash",
            tmp_path,
        )
