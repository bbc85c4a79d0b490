"""Hub: pushing heads with a model card (HfApi patched: nothing leaves the machine) and loading by repo id."""

import json
import logging

import pytest
import torch
from safetensors.torch import load as safetensors_load

from conftest import tiny_model
from selfspec.heads.config import HeadsConfig
from selfspec.heads.hub import push_to_hub, resolve_heads
from selfspec.heads.medusa import MedusaHeads
from selfspec.infer.cli.commands import main as cli
from selfspec.infer.core.generate import SpeculativeModel

TOKEN = "hf_SECRETsecretSECRETsecret123456"


def saved_heads(path, kind="medusa"):
    """Heads with every parameter random and non-zero (a fresh ResBlock's weight is zero), saved to `path`."""
    torch.manual_seed(0)
    heads = MedusaHeads(
        HeadsConfig(
            kind=kind,
            base_model="meta-llama/Llama-3.1-8B-Instruct",
            hidden_size=48,
            vocab_size=96,
            num_heads=2,
        )
    )
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    heads.save_pretrained(path)
    return heads.eval()


def assert_same_tensors(state, heads):
    assert state.keys() == heads.state_dict().keys()
    for k, v in heads.state_dict().items():
        assert torch.equal(state[k], v), k


def test_push_uploads_exactly_the_heads_and_a_card(hub, tmp_path, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    saved_heads(tmp_path)
    (tmp_path / "training_args.json").write_text(
        json.dumps({"learning_rate": 0.001, "num_heads": 2, "command": "accelerate launch train/medusa.py"})
    )
    (tmp_path / "bench.json").write_text(
        json.dumps(
            {
                "num_prompts": 4,
                "max_new_tokens": 64,
                "dtype": "bfloat16",
                "methods": {
                    "medusa": {
                        "tokens_per_s": 210.5,
                        "speedup": 2.1,
                        "tau": 3.2,
                        "identical_to_baseline": True,
                    }
                },
            }
        )
    )
    cli(["push", "--heads", str(tmp_path), "--repo-id", "me/tiny-medusa", "--private", "--token", TOKEN])
    assert set(hub["files"]) == {"config.json", "model.safetensors", "README.md"}
    assert hub["create"]["repo_id"] == hub["upload"]["repo_id"] == "me/tiny-medusa"
    assert hub["create"]["private"] is True and hub["create"]["token"] == TOKEN
    card = hub["files"]["README.md"].decode()
    meta = card.split("---")[1]
    assert "base_model: meta-llama/Llama-3.1-8B-Instruct" in meta
    assert "speculative-decoding" in meta and "medusa" in meta
    assert "## Training recipe" in card and "learning_rate: 0.001" in card and "accelerate launch" in card
    assert "| medusa | 210.5 | 2.10x | 3.20 | yes |" in card
    out = capsys.readouterr()
    for text in [
        *(b.decode(errors="replace") for b in hub["files"].values()),
        out.out,
        out.err,
        caplog.text,
        *(p.read_text(errors="replace") for p in tmp_path.iterdir()),
    ]:
        assert TOKEN not in text


def test_heads_object_push_to_hub(hub, tmp_path):
    heads = saved_heads(tmp_path)
    url = heads.push_to_hub("me/tiny-medusa", token=TOKEN)
    assert url.endswith("me/tiny-medusa") and set(hub["files"]) == {
        "config.json",
        "model.safetensors",
        "README.md",
    }
    assert HeadsConfig.from_dict(json.loads(hub["files"]["config.json"])) == heads.config
    assert_same_tensors(safetensors_load(hub["files"]["model.safetensors"]), heads)


def test_loading_by_repo_id_reads_the_hub_cache(monkeypatch, tmp_path):
    import huggingface_hub

    model = tiny_model("llama")
    heads = saved_heads(tmp_path / "snapshot")
    asked = []
    monkeypatch.setattr(
        huggingface_hub,
        "snapshot_download",
        lambda repo_id, **kw: asked.append((repo_id, kw)) or str(tmp_path / "snapshot"),
    )
    spec = SpeculativeModel.from_pretrained("someone/tiny-medusa", model=model)
    assert asked[0][0] == "someone/tiny-medusa" and "model.safetensors" in asked[0][1]["allow_patterns"]
    assert_same_tensors(spec.proposer.heads.state_dict(), heads)
    hidden, lm = torch.randn(3, 48, generator=torch.Generator().manual_seed(1)), model.get_output_embeddings()
    with torch.no_grad():
        assert torch.equal(torch.stack(spec.proposer.heads(hidden, lm)), torch.stack(heads(hidden, lm)))
    prompt = torch.tensor([[5, 6, 7]])
    ref = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(spec.generate(prompt, max_new_tokens=12), ref)


def test_offline_and_not_cached_is_a_clear_error(monkeypatch, capsys):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(repo_id, **kwargs):
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache, and HF_HUB_OFFLINE=1"):
        resolve_heads("someone/not-here")
    with pytest.raises(FileNotFoundError, match=r"\(hf download someone/not-here\)"):  # not huggingface-cli
        resolve_heads("someone/not-here")
    with pytest.raises(SystemExit) as exit_info:
        cli(["generate", "--heads", "someone/not-here", "--prompt", "x"])
    assert exit_info.value.code == 2 and "HF_HUB_OFFLINE=1" in capsys.readouterr().err


def test_push_refuses_a_directory_without_weights(tmp_path, hub):
    (tmp_path / "config.json").write_text(HeadsConfig(hidden_size=8, vocab_size=8).to_json())
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        push_to_hub(tmp_path, "me/x")
    assert "create" not in hub


def test_push_without_a_network_is_one_line(tmp_path, monkeypatch, capsys):
    """With HF_HUB_OFFLINE unset and the Hub unreachable (here: a local port nothing listens on), the push was
    a 79-line double traceback ending in the HTTP client's ConnectError."""
    import huggingface_hub.constants

    saved_heads(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(SystemExit) as exit_info:
        cli(["push", "--heads", str(tmp_path), "--repo-id", "me/x", "--token", TOKEN])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert (
        "cannot reach the Hub at http://127.0.0.1:9" in err
        and "check the network" in err
        and TOKEN not in err
    )
