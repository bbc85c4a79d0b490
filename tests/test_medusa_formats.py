"""Published Medusa layouts (FasterDecoding v1 / "version 2", vLLM): import, decode, export, round trip.

Checkpoints are written by hand here, with the file names, config fields and keys each project uses, and
the imported heads are checked against a plain re-implementation of what that engine computes.
"""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import VOCAB, tiny_model
from heads.config import HeadsConfig, check_compatible
from heads.medusa import MedusaHeads
from heads.medusa_formats import (
    FASTDECODING_CONFIG_FIELDS,
    FASTDECODING_FORBIDDEN_FIELDS,
    FASTDECODING_MEDUSA_KEYS,
    MEDUSA_FORMATS,
    VLLM_CONFIG_FIELDS,
    VLLM_MEDUSA_KEYS,
    detect_medusa_format,
    export_medusa,
    import_medusa,
)
from infer.generate import SpeculativeModel
from infer.proposers import MedusaProposer

HIDDEN = 48
CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def raw_heads(target, num_heads, num_layers=1, seed=0, hidden=HIDDEN, vocab=VOCAB):
    """Per head: [(W, b) per block] and a projection near the target's lm_head (so drafts get accepted)."""
    gen = torch.Generator().manual_seed(seed)
    lm = target.get_output_embeddings().weight.detach() if hidden == HIDDEN and vocab == VOCAB else None
    heads = []
    for _ in range(num_heads):
        blocks = [
            (torch.randn(hidden, hidden, generator=gen) * 0.05, torch.randn(hidden, generator=gen) * 0.05)
            for _ in range(num_layers)
        ]
        noise = torch.randn(vocab, hidden, generator=gen) * 0.1
        heads.append((blocks, (lm + noise) if lm is not None else noise))
    return heads


def reference_logits(raw, hidden, lm_head_weight=None, scale=1.0):
    """What FasterDecoding / TGI / vLLM compute: x = x + SiLU(W x + b) per block, then the projection."""
    out = []
    for blocks, proj in raw:
        x = hidden
        for w, b in blocks:
            x = x + F.silu(F.linear(x, w, b))
        out.append(F.linear(x, proj if lm_head_weight is None else lm_head_weight) * scale)
    return out


def assert_matches_reference(heads, target, raw, shared=False, scale=1.0):
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(9))
    lm = target.get_output_embeddings()
    got = heads(hidden, lm)
    want = reference_logits(raw, hidden, lm.weight.detach() if shared else None, scale)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def assert_greedy_identical(target, heads):
    spec = SpeculativeModel(target, MedusaProposer(heads, target.get_output_embeddings(), CHOICES))
    for seed, length in ((0, 5), (1, 11)):
        prompt = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
        ref = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, length:].tolist()
        assert spec.generate(prompt, max_new_tokens=24)[0, length:].tolist() == ref


def write_fastdecoding(directory, raw, config, weights="medusa_lm_head.safetensors", projection=True):
    directory.mkdir(parents=True, exist_ok=True)
    state = {}
    for h, (blocks, proj) in enumerate(raw):
        for i, (w, b) in enumerate(blocks):
            state[f"{h}.{i}.linear.weight"], state[f"{h}.{i}.linear.bias"] = w, b
        if projection:
            state[f"{h}.{len(blocks)}.weight"] = proj
    if weights.endswith(".safetensors"):
        save_file(state, str(directory / weights))
    else:
        torch.save(state, directory / weights)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def vllm_config(num_heads, num_layers=1, **extra):
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": HIDDEN,
        "vocab_size": VOCAB,
        "num_heads": num_heads,
        "num_hidden_layers": num_layers,
        "truncated_vocab_size": VOCAB,
        "medusa_fc_bias": True,
        "original_lm_head": False,
        **extra,
    }


def write_vllm(directory, raw, config, bias=True, prefix=""):
    directory.mkdir(parents=True, exist_ok=True)
    state = {}
    for h, (blocks, proj) in enumerate(raw):
        for i, (w, b) in enumerate(blocks):
            state[f"{prefix}blocks.{h}.layers.{i}.weight"] = w
            if bias:
                state[f"{prefix}blocks.{h}.layers.{i}.bias"] = b
        state[f"{prefix}lm_heads.{h}.weight"] = proj
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# ---------------------------------------------------------------------------------------- import


@pytest.mark.parametrize("weights", ["medusa_lm_head.safetensors", "medusa_lm_head.pt"])
def test_fastdecoding_v1_imports_and_decodes_like_the_target(tmp_path, target, weights):
    raw = raw_heads(target, num_heads=5)
    config = {
        "medusa_num_heads": 5,
        "medusa_num_layers": 1,
        "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
    }
    d = write_fastdecoding(tmp_path / "medusa", raw, config, weights)
    assert detect_medusa_format(d) == "fastdecoding-medusa"
    heads = import_medusa(d)
    c = heads.config
    assert (c.num_heads, c.num_layers, c.hidden_size, c.vocab_size) == (5, 1, HIDDEN, VOCAB)
    assert (c.share_lm_head, c.dtype, c.base_model) == (False, "float32", "lmsys/vicuna-7b-v1.3")
    assert_matches_reference(heads, target, raw)
    assert_greedy_identical(target, heads)
    assert import_medusa(d, base_model="other/base").config.base_model == "other/base"


def test_fastdecoding_v2_shares_the_targets_lm_head(tmp_path, target, tiny_model_dir):
    raw = raw_heads(target, num_heads=4)
    config = {
        "medusa_num_heads": 4,
        "medusa_num_layers": 1,
        "base_model_name_or_path": str(tiny_model_dir),
        "version": "2",
    }
    d = write_fastdecoding(tmp_path / "medusa", raw, config, projection=False)
    heads = import_medusa(d, format="fastdecoding-medusa")  # vocab size read from the base model's config
    assert heads.config.share_lm_head and heads.config.vocab_size == VOCAB
    assert not any(k.endswith(".1.weight") for k in heads.state_dict())
    assert_matches_reference(heads, target, raw, shared=True)
    assert_greedy_identical(target, heads)
    check_compatible(heads.config, target)


def test_fastdecoding_v2_needs_a_vocab_size_from_somewhere(tmp_path, target):
    raw = raw_heads(target, num_heads=4)
    d = write_fastdecoding(
        tmp_path / "m", raw, {"medusa_num_heads": 4, "medusa_num_layers": 1}, projection=False
    )
    with pytest.raises(ValueError, match="vocab_size="):
        import_medusa(d)
    assert import_medusa(d, vocab_size=VOCAB).config.vocab_size == VOCAB


def test_config_with_fewer_heads_than_the_weights_warns_and_trusts_the_weights(tmp_path, target):
    raw = raw_heads(target, num_heads=5)
    config = {"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "x"}  # as published
    d = write_fastdecoding(tmp_path / "m", raw, config)
    with pytest.warns(UserWarning, match=r"medusa_num_heads = 2 .* holds 5 heads"):
        heads = import_medusa(d)
    assert heads.config.num_heads == 5
    assert_matches_reference(heads, target, raw)
    config["medusa_num_heads"] = 6
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="holds only 5 heads"):
        import_medusa(d)


class NotATensor:
    """Anything but tensors in a .pt file: torch.load(weights_only=True) must refuse to build it."""


def test_pt_is_read_with_weights_only(tmp_path, target, monkeypatch):
    raw = raw_heads(target, num_heads=4)
    d = write_fastdecoding(
        tmp_path / "m", raw, {"medusa_num_heads": 4, "medusa_num_layers": 1}, "medusa_lm_head.pt"
    )
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    import_medusa(d)
    assert calls == [True]
    monkeypatch.undo()
    torch.save({"0.0.linear.weight": torch.zeros(2, 2), "payload": NotATensor()}, d / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="weights_only=True"):
        import_medusa(d)


def test_vllm_layout_imports_and_decodes_like_the_target(tmp_path, target):
    raw = raw_heads(target, num_heads=4, num_layers=2)
    d = write_vllm(
        tmp_path / "vllm", raw, vllm_config(4, 2), prefix="medusa_heads."
    )  # vLLM strips the prefix
    assert detect_medusa_format(d) == "vllm-medusa"
    heads = import_medusa(d)
    assert (heads.config.num_heads, heads.config.num_layers, heads.config.share_lm_head) == (4, 2, False)
    assert_matches_reference(heads, target, raw)
    assert_greedy_identical(target, heads)


def test_vllm_bias_free_shared_scaled_and_renamed_variants(tmp_path, target):
    raw = raw_heads(target, num_heads=4)
    # medusa_fc_bias false (vLLM's default): bias-free layers, which are zero biases here.
    bias_free = [([(w, torch.zeros_like(b)) for w, b in blocks], p) for blocks, p in raw]
    d = write_vllm(tmp_path / "nobias", raw, vllm_config(4, medusa_fc_bias=False), bias=False)
    assert_matches_reference(import_medusa(d), target, bias_free)
    # Biases in the file but no medusa_fc_bias: vLLM builds no bias parameter and drops them; so do we.
    d = write_vllm(
        tmp_path / "dropped", raw, {k: v for k, v in vllm_config(4).items() if k != "medusa_fc_bias"}
    )
    with pytest.warns(UserWarning, match="medusa_fc_bias"):
        assert_matches_reference(import_medusa(d), target, bias_free)
    # original_lm_head: one projection (lm_heads.0.weight) used by every head.
    one = [(blocks, raw[0][1]) for blocks, _ in raw]
    d = write_vllm(tmp_path / "orig", one[:1], vllm_config(4, original_lm_head=True))
    state = load_file(str(d / "model.safetensors"))
    for h, (blocks, _) in enumerate(raw[1:], start=1):
        state[f"blocks.{h}.layers.0.weight"], state[f"blocks.{h}.layers.0.bias"] = blocks[0]
    save_file(state, str(d / "model.safetensors"))
    assert_matches_reference(import_medusa(d), target, one)
    # logit_scale multiplies every head's logits; folded into the projections.
    d = write_vllm(tmp_path / "scaled", raw, vllm_config(4, logit_scale=0.5))
    assert_matches_reference(import_medusa(d), target, raw, scale=0.5)
    # FasterDecoding-style field names: vLLM's MedusaConfig renames any "num..heads"/"num..layers" key.
    cfg = vllm_config(4)
    cfg["medusa_num_heads"], cfg["medusa_num_layers"] = cfg.pop("num_heads"), cfg.pop("num_hidden_layers")
    d = write_vllm(tmp_path / "renamed", raw, cfg)
    assert import_medusa(d).config.num_heads == 4


def test_vllm_truncated_vocab_is_refused_clearly(tmp_path, target):
    raw = raw_heads(target, num_heads=4)
    d = write_vllm(tmp_path / "t", raw, vllm_config(4, truncated_vocab_size=64))
    with pytest.raises(ValueError, match="truncated_vocab_size"):
        import_medusa(d)


def test_unreadable_inputs_fail_with_the_problem_named(tmp_path, target):
    with pytest.raises(ValueError, match="not a directory"):
        import_medusa(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert detect_medusa_format(tmp_path / "empty") is None
    with pytest.raises(ValueError, match="no known Medusa layout"):
        import_medusa(tmp_path / "empty")
    with pytest.raises(ValueError, match="unknown Medusa format"):
        import_medusa(tmp_path / "empty", format="eagle")
    with pytest.raises(ValueError, match="no config.json"):
        import_medusa(tmp_path / "empty", format="fastdecoding-medusa")
    raw = raw_heads(target, num_heads=4)
    d = write_fastdecoding(tmp_path / "odd", raw, {"medusa_num_heads": 4})
    state = load_file(str(d / "medusa_lm_head.safetensors"))
    state["model.embed_tokens.weight"] = torch.zeros(2, 2)
    save_file(state, str(d / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match="outside the FasterDecoding Medusa layout"):
        import_medusa(d)
    (d / "medusa_lm_head.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        import_medusa(d)
    d = write_fastdecoding(tmp_path / "bad", raw, {"medusa_num_heads": 4})
    state = load_file(str(d / "medusa_lm_head.safetensors"))
    state["2.0.linear.weight"] = torch.zeros(HIDDEN, HIDDEN + 1)
    save_file(state, str(d / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=r"2\.0\.linear\.weight has shape"):
        import_medusa(d)


def test_heads_for_another_target_fail_clearly(tmp_path, target):
    small = raw_heads(target, num_heads=4, hidden=32)
    heads = import_medusa(write_fastdecoding(tmp_path / "h32", small, {"medusa_num_heads": 4}))
    heads.save_pretrained(tmp_path / "saved")
    with pytest.raises(ValueError, match="hidden size 32 but the target"):
        SpeculativeModel.from_pretrained(tmp_path / "saved", model=target)
    other_vocab = raw_heads(target, num_heads=4, vocab=80)
    heads = import_medusa(
        write_vllm(tmp_path / "v80", other_vocab, vllm_config(4, vocab_size=80, truncated_vocab_size=80))
    )
    with pytest.raises(ValueError, match="vocabulary size 80 but the target has 96"):
        check_compatible(heads.config, target)


# ---------------------------------------------------------------------------------------- export


def random_heads(target, num_heads=4, num_layers=1, share=False, dtype="float32", seed=0):
    torch.manual_seed(seed)
    cfg = HeadsConfig(
        base_model="org/target",
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        num_heads=num_heads,
        num_layers=num_layers,
        share_lm_head=share,
        dtype=dtype,
    )
    heads = MedusaHeads(cfg)
    heads.init_from_lm_head(target.get_output_embeddings())
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return heads.to(getattr(torch, dtype)).eval()


def config_of(heads):
    c = heads.config
    return (c.base_model, c.hidden_size, c.vocab_size, c.num_heads, c.num_layers, c.share_lm_head, c.dtype)


@pytest.mark.parametrize("fmt", MEDUSA_FORMATS)
@pytest.mark.parametrize("num_layers,dtype", [(1, "float32"), (2, "bfloat16")])
def test_export_then_import_round_trips_exactly(tmp_path, target, fmt, num_layers, dtype):
    heads = random_heads(target, num_layers=num_layers, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the 2-block FasterDecoding warning is tested below
        export_medusa(heads, fmt, tmp_path / "out")
    assert detect_medusa_format(tmp_path / "out") == fmt
    back = import_medusa(tmp_path / "out")
    assert config_of(back) == config_of(heads)
    state, back_state = heads.state_dict(), back.state_dict()
    assert state.keys() == back_state.keys()
    for k in state:
        assert back_state[k].dtype == state[k].dtype and torch.equal(back_state[k], state[k]), k


def test_shared_heads_round_trip_as_version_2_or_materialised(tmp_path, target):
    heads = random_heads(target, share=True)
    lm = target.get_output_embeddings().weight
    export_medusa(heads, "fastdecoding-medusa", tmp_path / "v2")  # version 2: no projections needed
    back = import_medusa(tmp_path / "v2")
    assert config_of(back) == config_of(heads)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in heads.state_dict().items())
    with pytest.raises(ValueError, match="lm_head_weight=model.get_output_embeddings"):
        export_medusa(heads, "vllm-medusa", tmp_path / "vllm")
    export_medusa(heads, "fastdecoding-medusa", tmp_path / "v2b", lm_head_weight=lm)  # still version 2
    assert import_medusa(tmp_path / "v2b").config.share_lm_head
    with pytest.raises(ValueError, match="lm_head_weight=model.get_output_embeddings"):
        export_medusa(heads, "fastdecoding-medusa", tmp_path / "v1", per_head_projections=True)
    for fmt in MEDUSA_FORMATS:
        export_medusa(heads, fmt, tmp_path / fmt, lm_head_weight=lm, per_head_projections=True)
        back = import_medusa(tmp_path / fmt)
        assert not back.config.share_lm_head
        for k, v in heads.state_dict().items():
            assert torch.equal(back.state_dict()[k], v), k
        for h in range(heads.config.num_heads):
            assert torch.equal(back.heads[h][-1].weight, lm.detach())
        hidden = torch.randn(2, HIDDEN)
        for a, b in zip(heads(hidden, target.get_output_embeddings()), back(hidden)):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("share", [False, True])
def test_fastdecoding_export_writes_what_faster_decoding_and_tgi_read(tmp_path, target, share):
    heads = random_heads(target, num_heads=5, share=share)
    export_medusa(heads, "fastdecoding-medusa", tmp_path, write_pt=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "medusa_lm_head.pt",
        "medusa_lm_head.safetensors",
    ]
    keys = FASTDECODING_MEDUSA_KEYS(5, 1, projection=not share)
    state = load_file(str(tmp_path / "medusa_lm_head.safetensors"))
    assert sorted(state) == sorted(keys)
    pt = torch.load(tmp_path / "medusa_lm_head.pt", weights_only=True)
    assert sorted(pt) == sorted(keys) and all(torch.equal(pt[k], state[k]) for k in keys)
    assert all(state[f"{h}.1.weight"].shape == (VOCAB, HIDDEN) for h in range(5) if not share)
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(FASTDECODING_CONFIG_FIELDS) <= set(config)
    assert not set(FASTDECODING_FORBIDDEN_FIELDS) & set(
        config
    )  # TGI skips Medusa when `architectures` is set
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (5, 1)
    assert config["base_model_name_or_path"] == "org/target"
    assert config.get("version") == ("2" if share else None)


def test_vllm_export_writes_what_vllm_reads(tmp_path, target):
    heads = random_heads(target, num_heads=3, num_layers=2)
    export_medusa(heads, "vllm-medusa", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    state = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(state) == sorted(VLLM_MEDUSA_KEYS(3, 2, bias=True))
    assert state["lm_heads.2.weight"].shape == (VOCAB, HIDDEN)
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(VLLM_CONFIG_FIELDS) <= set(config)
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["num_heads"], config["num_hidden_layers"], config["hidden_size"]) == (3, 2, HIDDEN)
    assert config["vocab_size"] == config["truncated_vocab_size"] == VOCAB  # no token_map needed
    assert config["medusa_fc_bias"] is True and config["original_lm_head"] is False
    # vLLM's MedusaConfig.from_pretrained renames any key with "num" and "heads"/"layers": only ours may.
    assert [k for k in config if "num" in k and ("heads" in k or "layers" in k)] == [
        "num_heads",
        "num_hidden_layers",
    ]


def test_key_lists():
    assert FASTDECODING_MEDUSA_KEYS(2, 1) == [
        "0.0.linear.weight",
        "0.0.linear.bias",
        "0.1.weight",
        "1.0.linear.weight",
        "1.0.linear.bias",
        "1.1.weight",
    ]
    assert FASTDECODING_MEDUSA_KEYS(1, 2, projection=False) == [
        "0.0.linear.weight",
        "0.0.linear.bias",
        "0.1.linear.weight",
        "0.1.linear.bias",
    ]
    assert VLLM_MEDUSA_KEYS(2, 1, bias=False) == [
        "blocks.0.layers.0.weight",
        "blocks.1.layers.0.weight",
        "lm_heads.0.weight",
        "lm_heads.1.weight",
    ]
    assert VLLM_MEDUSA_KEYS(2, 1, original_lm_head=True)[-1] == "lm_heads.0.weight"


def test_export_warnings_and_errors(tmp_path, target):
    heads = random_heads(target, num_layers=2, share=True)
    with pytest.warns(UserWarning) as record:
        export_medusa(heads, "fastdecoding-medusa", tmp_path / "a")
    text = " ".join(str(w.message) for w in record)
    assert "[ResBlock(h)] * n" in text and "medusa_num_layers == 1" in text
    heads = random_heads(target)
    heads.config.base_model = ""
    with pytest.warns(UserWarning, match="base_model_name_or_path"):
        export_medusa(heads, "fastdecoding-medusa", tmp_path / "b")
    with pytest.raises(ValueError, match="unknown Medusa format"):
        export_medusa(heads, "medusa", tmp_path / "c")
    shared = random_heads(target, share=True)
    with pytest.raises(ValueError, match="lm_head_weight has shape"):
        export_medusa(shared, "vllm-medusa", tmp_path / "d", lm_head_weight=torch.zeros(VOCAB, 8))
