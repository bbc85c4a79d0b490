"""Published Medusa layouts (FasterDecoding v1 / "version 2", vLLM) imported and decoded (export:
tests/formats/test_medusa_export.py).

Checkpoints are written by hand here, with the file names, config fields and keys each project uses, and
the imported heads are checked against a plain re-implementation of what that engine computes.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import VOCAB, tiny_model
from selfspec.heads.config import check_compatible
from selfspec.heads.formats.medusa import (
    detect_medusa_format,
    import_medusa,
)
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.drafters.proposers import MedusaProposer

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
    with pytest.raises(ValueError, match="outside the fastdecoding-medusa layout"):
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


def test_a_config_that_is_not_json_is_named_with_its_line(tmp_path, target):
    d = write_fastdecoding(tmp_path / "m", raw_heads(target, num_heads=4), {"medusa_num_heads": 4})
    (d / "config.json").write_text('{\n  "medusa_num_heads": 4,\n}')
    with pytest.raises(ValueError, match=r"m/config\.json is not readable JSON \(.*line 3"):
        import_medusa(d)
    (d / "medusa_lm_head.safetensors").unlink()  # without FasterDecoding's file, detection reads config.json
    with pytest.raises(ValueError, match=r"m/config\.json is not readable JSON \(.*line 3"):
        detect_medusa_format(d)


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
