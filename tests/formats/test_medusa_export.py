"""Our Medusa heads written in the published layouts (FasterDecoding v1, vLLM): exact round trips, the files
each engine's loader reads, and what a layout cannot hold refused."""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from conftest import VOCAB, tiny_model
from selfspec.heads.config import HeadsConfig
from selfspec.heads.formats.medusa import (
    LAYOUTS,
    MEDUSA_FORMATS,
    detect_medusa_format,
    engine_keys,
    import_medusa,
)
from selfspec.heads.formats.medusa_export import export_medusa
from selfspec.heads.medusa import MedusaHeads
from selfspec.shipped.models import resolve_model

HIDDEN = 48


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


FD = "fastdecoding-medusa"


def random_heads(
    num_heads=4,
    num_layers=1,
    share=False,
    dtype="float32",
    seed=0,
    base_model="org/target",
    hidden=HIDDEN,
    vocab=VOCAB,
):
    """Heads with every parameter random and non-zero, the ResBlock weights (zero when fresh) included."""
    torch.manual_seed(seed)
    heads = MedusaHeads(
        HeadsConfig(
            base_model=base_model,
            hidden_size=hidden,
            vocab_size=vocab,
            num_heads=num_heads,
            num_layers=num_layers,
            share_lm_head=share,
            dtype=dtype,
        )
    )
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return heads.to(getattr(torch, dtype)).eval()


def config_of(heads):
    c = heads.config
    return (c.base_model, c.hidden_size, c.vocab_size, c.num_heads, c.num_layers, c.share_lm_head, c.dtype)


def fixed_hidden(dtype=torch.float32):
    return torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype)


def assert_same_heads(back, heads, lm_head):
    """Every key, every tensor bit for bit (dtype included), and the logits on fixed hidden states."""
    state, back_state = heads.state_dict(), back.state_dict()
    assert back_state.keys() == state.keys()
    for k, v in state.items():
        assert back_state[k].dtype == v.dtype and torch.equal(back_state[k], v), k
    hidden = fixed_hidden(next(heads.parameters()).dtype)
    with torch.no_grad():
        for a, b in zip(heads(hidden, lm_head), back(hidden, lm_head), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", MEDUSA_FORMATS)
@pytest.mark.parametrize("num_layers,dtype", [(1, "float32"), (2, "bfloat16")])
def test_export_then_import_round_trips_exactly(tmp_path, target, fmt, num_layers, dtype):
    heads = random_heads(num_layers=num_layers, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # FasterDecoding's head-count and repeated-block warnings: tested below
        export_medusa(heads, fmt, tmp_path / "out")
    assert detect_medusa_format(tmp_path / "out") == fmt
    back = import_medusa(tmp_path / "out")
    assert config_of(back) == config_of(heads)
    assert_same_heads(back, heads, target.get_output_embeddings())


@pytest.mark.parametrize("fmt", MEDUSA_FORMATS)
def test_shared_heads_are_exported_with_the_targets_lm_head_in_every_head(tmp_path, target, fmt):
    heads, lm = random_heads(share=True), target.get_output_embeddings()
    with pytest.raises(ValueError, match="lm_head_weight=model.get_output_embeddings"):
        export_medusa(heads, fmt, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()  # refused before anything is written
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_medusa(heads, fmt, tmp_path / fmt, lm_head_weight=lm.weight)
    back = import_medusa(tmp_path / fmt)
    assert config_of(back) == config_of(heads)[:5] + (False, "float32")
    want = heads.state_dict() | {f"heads.{h}.1.weight": lm.weight.detach() for h in range(4)}
    assert back.state_dict().keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(back.state_dict()[k], v), k
    with torch.no_grad():
        for a, b in zip(heads(fixed_hidden(), lm), back(fixed_hidden()), strict=True):
            torch.testing.assert_close(b, a)


class FasterDecodingResBlock(torch.nn.Module):
    """FasterDecoding's ResBlock (medusa/model/medusa_model.py): x + SiLU(linear(x)), the linear biased."""

    def __init__(self, hidden):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)
        self.act = torch.nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def faster_decoding_heads(directory, hidden, vocab, num_layers=1):
    """The heads half of FasterDecoding's current MedusaModel.from_pretrained: 5 heads whatever config.json
    says, each `[ResBlock] * n` then a bias-free projection, filled by `torch.load("medusa_lm_head.pt")` and
    `load_state_dict(strict=False)` (whose missing and unexpected keys are returned here)."""
    medusa_head = torch.nn.ModuleList(
        torch.nn.Sequential(
            *([FasterDecodingResBlock(hidden)] * num_layers), torch.nn.Linear(hidden, vocab, bias=False)
        )
        for _ in range(5)
    )
    result = medusa_head.load_state_dict(
        torch.load(directory / "medusa_lm_head.pt", map_location="cpu"), strict=False
    )
    return medusa_head, result


@pytest.mark.parametrize("share", [True, False], ids=["shared_lm_head", "own_projections"])
def test_fastdecoding_export_loads_in_faster_decodings_loader(tmp_path, target, tiny_model_dir, share):
    heads, lm = (
        random_heads(num_heads=5, share=share, base_model=str(tiny_model_dir)),
        target.get_output_embeddings(),
    )
    out = tmp_path / "exported"
    export_medusa(heads, FD, out, lm_head_weight=lm.weight)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "medusa_lm_head.pt",
        "medusa_lm_head.safetensors",
    ]
    config = json.loads((out / "config.json").read_text())
    # FasterDecoding's AutoConfig attempt must fail (no model_type), TGI must not skip it (no architectures);
    # then it loads the target config.json names: a real folder here.
    assert "model_type" not in config and "architectures" not in config and "version" not in config
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (5, 1)
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    assert AutoConfig.from_pretrained(config["base_model_name_or_path"]).vocab_size == VOCAB
    fd, result = faster_decoding_heads(out, HIDDEN, VOCAB)
    assert result.missing_keys == [] and result.unexpected_keys == []
    with torch.no_grad():
        for k, ours in enumerate(heads(fixed_hidden(), lm)):
            torch.testing.assert_close(fd[k](fixed_hidden()), ours)
    pt, st = (
        torch.load(out / "medusa_lm_head.pt", weights_only=True),
        load_file(out / "medusa_lm_head.safetensors"),
    )
    assert (
        pt.keys() == st.keys() == set(engine_keys(FD, 5, 1))
    )  # TGI reads the same tensors from .safetensors
    for k in pt:
        assert torch.equal(pt[k], st[k]), k


def test_fastdecoding_export_names_a_base_model_its_loader_can_load(tmp_path, tiny_model_dir):
    heads = random_heads(num_heads=5)
    export_medusa(heads, FD, tmp_path / "hub")  # a Hub id is written as given
    assert json.loads((tmp_path / "hub/config.json").read_text())["base_model_name_or_path"] == "org/target"
    export_medusa(heads, FD, tmp_path / "local", base_model=str(tiny_model_dir / ".." / tiny_model_dir.name))
    assert json.loads((tmp_path / "local/config.json").read_text())["base_model_name_or_path"] == str(
        tiny_model_dir.resolve()
    )
    demo = AutoConfig.from_pretrained(resolve_model("demo"))
    shipped = random_heads(num_heads=5, base_model="demo", hidden=demo.hidden_size, vocab=demo.vocab_size)
    export_medusa(shipped, FD, tmp_path / "demo")
    assert json.loads((tmp_path / "demo/config.json").read_text())[
        "base_model_name_or_path"
    ] == resolve_model("demo")
    # nothing FasterDecoding could load the target from: no name, a short name, a folder that is not there
    for unnamed, name in (
        (random_heads(base_model=""), None),
        (heads, "tiny"),
        (heads, str(tmp_path / "nowhere")),
    ):
        with pytest.raises(ValueError, match="pass --base-model"):
            export_medusa(unnamed, FD, tmp_path / "refused", base_model=name)
    with pytest.raises(ValueError, match="hidden size 384 .* name the model they were trained for"):
        export_medusa(heads, FD, tmp_path / "refused", base_model="demo")
    assert not (tmp_path / "refused").exists()
    export_medusa(random_heads(base_model=""), "vllm-medusa", tmp_path / "vllm")  # vLLM never reads the name
    assert json.loads((tmp_path / "vllm/config.json").read_text())["base_model_name_or_path"] == ""


def test_vllm_export_writes_what_vllm_reads(tmp_path):
    heads = random_heads(num_heads=3, num_layers=2)
    export_medusa(heads, "vllm-medusa", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state.keys() == set(engine_keys("vllm-medusa", 3, 2, bias=True))
    assert state["lm_heads.2.weight"].shape == (VOCAB, HIDDEN)
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(LAYOUTS["vllm-medusa"].config) <= set(config)
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
    assert engine_keys(FD, 2, 1) == [
        "0.0.linear.weight",
        "0.0.linear.bias",
        "0.1.weight",
        "1.0.linear.weight",
        "1.0.linear.bias",
        "1.1.weight",
    ]
    assert engine_keys(FD, 1, 2, projection=False) == [
        "0.0.linear.weight",
        "0.0.linear.bias",
        "0.1.linear.weight",
        "0.1.linear.bias",
    ]
    assert engine_keys("vllm-medusa", 2, 1, bias=False) == [
        "blocks.0.layers.0.weight",
        "lm_heads.0.weight",
        "blocks.1.layers.0.weight",
        "lm_heads.1.weight",
    ]


def test_export_warnings_and_errors(tmp_path, target):
    with pytest.warns(UserWarning) as record:
        export_medusa(random_heads(num_heads=3, num_layers=2), FD, tmp_path / "a")
    text = " ".join(str(w.message) for w in record)
    assert "[ResBlock(h)] * n" in text and "builds 5 whatever config.json says" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 5 heads of one block each: what FasterDecoding builds, no warning
        export_medusa(random_heads(num_heads=5), FD, tmp_path / "b")
    with pytest.raises(ValueError, match="unknown Medusa format"):
        export_medusa(random_heads(), "medusa", tmp_path / "c")
    with pytest.raises(ValueError, match="lm_head_weight has shape"):
        export_medusa(
            random_heads(share=True), "vllm-medusa", tmp_path / "d", lm_head_weight=torch.zeros(VOCAB, 8)
        )
