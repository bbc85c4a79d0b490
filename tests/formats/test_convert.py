"""`selfspec export | import`: every layout round-trips through the CLI, every tensor and output kept."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from cli_checks import user_error
from selfspec.heads.config import HeadsConfig
from selfspec.heads.formats import EXPORT_FORMATS, detect_format, export_heads
from selfspec.heads.formats.dflash import DFLASH_FORMATS
from selfspec.heads.formats.eagle3 import EAGLE3_FORMATS
from selfspec.heads.formats.mtp import LAYOUTS as MTP_LAYOUTS
from selfspec.heads.formats.peagle import LAYOUTS as PEAGLE_LAYOUTS
from selfspec.heads.medusa import MedusaHeads
from selfspec.heads.registry import load_heads
from selfspec.infer.cli.commands import main as cli
from selfspec.infer.core.generate import SpeculativeModel


def randomised(source, out):
    """The fixture's drafter with every parameter random and non-zero (a fresh ResBlock's weight is zero),
    saved to `out`."""
    heads = load_heads(source)
    torch.manual_seed(1)
    for name, p in heads.named_parameters():
        torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.1)
    heads.save_pretrained(out)
    return heads.eval()


def outputs(heads, model):
    """What the drafter computes on a fixed input: Medusa logits per head, or EAGLE's predicted features."""
    gen = torch.Generator().manual_seed(7)
    features = torch.randn(1, 5, model.config.hidden_size, generator=gen)
    ids = torch.randint(3, 90, (1, 5), generator=gen)
    with torch.no_grad():
        if isinstance(heads, MedusaHeads):
            return torch.stack(heads(features, model.get_output_embeddings()))
        return heads(features, ids, model.get_input_embeddings())


# EAGLE-3 layouts: tests/formats/test_eagle3_formats.py, on a target deep enough for three fused layers;
# DFlash: tests/formats/test_dflash_formats.py
# MTP: tests/families/test_mtp.py (its export is the whole target, read back by transformers' MTP loader, not
# by import)
@pytest.mark.parametrize(
    "fmt",
    [
        f
        for f in EXPORT_FORMATS
        if f not in EAGLE3_FORMATS + DFLASH_FORMATS + tuple(PEAGLE_LAYOUTS) + MTP_LAYOUTS
    ],
)
def test_export_then_import_keeps_every_tensor_and_output(
    fmt, medusa_dir, eagle_dir, tiny_model_dir, tmp_path, capsys
):
    heads = randomised(medusa_dir if "medusa" in fmt else eagle_dir, tmp_path / "random")
    cli(["export", "--heads", str(tmp_path / "random"), "--format", fmt, "--out", str(tmp_path / "exported")])
    cli(
        [
            "import",
            "--src",
            str(tmp_path / "exported"),
            "--out",
            str(tmp_path / "back"),
            "--base-model",
            str(tiny_model_dir),
        ]
    )
    assert "imported" in capsys.readouterr().out
    back = load_heads(tmp_path / "back")
    before, after = heads.state_dict(), back.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert torch.equal(outputs(back, model), outputs(heads, model))
    spec = SpeculativeModel.from_pretrained(tmp_path / "back", model=model)
    prompt = torch.tensor([[5, 9, 14, 3]])
    assert torch.equal(
        spec.generate(prompt, max_new_tokens=16),
        model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0),
    )


def test_fastdecoding_export_of_shared_heads_needs_a_base_model_and_copies_its_lm_head(
    tmp_path, tiny_model_dir, capsys
):
    torch.manual_seed(0)
    heads = MedusaHeads(HeadsConfig(hidden_size=48, vocab_size=96, num_heads=5, share_lm_head=True))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    heads.save_pretrained(tmp_path / "shared")  # names no base model
    export = [
        "export",
        "--heads",
        str(tmp_path / "shared"),
        "--format",
        "fastdecoding-medusa",
        "--out",
        str(tmp_path / "fd"),
    ]
    assert re.search("pass --base-model", user_error(capsys, export))
    assert not (tmp_path / "fd").exists()
    cli([*export, "--base-model", str(tiny_model_dir)])
    config = json.loads((tmp_path / "fd/config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir).get_output_embeddings().weight
    pt = torch.load(tmp_path / "fd/medusa_lm_head.pt", weights_only=True)
    assert pt.keys() == load_file(tmp_path / "fd/medusa_lm_head.safetensors").keys()
    for k in range(5):
        assert torch.equal(pt[f"{k}.1.weight"], lm.detach())
        assert torch.equal(pt[f"{k}.0.linear.weight"], heads.heads[k][0].linear.weight.detach())


def test_export_options_that_do_not_fit_the_layout_are_refused(medusa_dir, eagle_dir, tmp_path, capsys):
    assert re.search(
        "choosing them .* is for EAGLE layouts",
        user_error(
            capsys,
            [
                "export",
                "--heads",
                str(medusa_dir),
                "--format",
                "vllm-medusa",
                "--weights",
                "bin",
                "--out",
                str(tmp_path / "a"),
            ],
        ),
    )
    assert re.search(
        "names no base model .* leave out --base-model",
        user_error(
            capsys,
            [
                "export",
                "--heads",
                str(eagle_dir),
                "--format",
                "eagle1",
                "--base-model",
                "org/x",
                "--model",
                str(load_heads(eagle_dir).config.base_model),
                "--out",
                str(tmp_path / "b"),
            ],
        ),
    )
    cli(
        [
            "export",
            "--heads",
            str(eagle_dir),
            "--format",
            "eagle1",
            "--weights",
            "bin",
            "--out",
            str(tmp_path / "c"),
        ]
    )
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["config.json", "pytorch_model.bin"]


def test_import_errors_name_the_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert re.search(
        "no Medusa or EAGLE checkpoint layout",
        user_error(capsys, ["import", "--src", str(tmp_path), "--out", str(tmp_path / "out")]),
    )
    (tmp_path / "config.json").write_text('{"medusa_num_heads": 5,\n "medusa_num_layers" 1}')
    assert re.search(
        r"config\.json is not readable JSON \(.*line 2",
        user_error(capsys, ["import", "--src", str(tmp_path), "--out", str(tmp_path / "out")]),
    )


@pytest.mark.parametrize("fmt", ["vllm-medusa", "eagle1", "sglang-eagle"])
def test_loading_a_published_drafter_reads_its_config_and_tensor_names_once(
    fmt, medusa_dir, eagle_dir, tiny_model_dir, tmp_path, monkeypatch
):
    """One detection pass: every layout's detector asks the same Checkpoint, so config.json is parsed once and
    the safetensors header opened once, whichever family the folder turns out to be (the last one asked
    here)."""
    import selfspec.heads.formats.checkpoint as checkpoint

    heads = load_heads(medusa_dir if "medusa" in fmt else eagle_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    export_heads(
        heads,
        fmt,
        tmp_path / "out",
        target=model,
        **({"base_model": str(tiny_model_dir)} if "medusa" in fmt else {}),
    )
    reads, opens = [], []
    read_json, safe_open = checkpoint.read_json_object, checkpoint.safe_open
    monkeypatch.setattr(checkpoint, "read_json_object", lambda path: reads.append(path) or read_json(path))
    monkeypatch.setattr(checkpoint, "safe_open", lambda *a, **k: opens.append(a) or safe_open(*a, **k))
    assert detect_format(tmp_path / "out") == fmt
    loaded = load_heads(tmp_path / "out")
    assert type(loaded) is type(heads)
    assert len(reads) == 2, reads  # detect_format once, load_heads once
    assert len(opens) <= 2, opens  # at most one header read per pass (Medusa layouts need no names)
