"""`python -m infer export | import`: every layout round-trips through the CLI and decodes exactly."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from heads.convert import EXPORT_FORMATS
from heads.registry import load_heads
from infer.cli import main as cli
from infer.generate import SpeculativeModel


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_export_then_import_decodes_like_the_target(fmt, medusa_dir, eagle_dir, tiny_model_dir, tmp_path, capsys):
    source = medusa_dir if "medusa" in fmt else eagle_dir
    cli(["export", "--heads", str(source), "--format", fmt, "--out", str(tmp_path / "exported")])
    cli(["import", "--src", str(tmp_path / "exported"), "--out", str(tmp_path / "back"),
         "--base-model", str(tiny_model_dir)])
    assert "imported" in capsys.readouterr().out
    before, after = load_heads(source).state_dict(), load_heads(tmp_path / "back").state_dict()
    shared = set(before) & set(after)
    assert shared and all(torch.equal(before[k], after[k]) for k in shared)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    spec = SpeculativeModel.from_pretrained(tmp_path / "back", model=model)
    prompt = torch.tensor([[5, 9, 14, 3]])
    assert torch.equal(spec.generate(prompt, max_new_tokens=16),
                       model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0))


def test_import_of_an_unknown_layout_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(SystemExit, match="no Medusa or EAGLE checkpoint layout"):
        cli(["import", "--src", str(tmp_path), "--out", str(tmp_path / "out")])
