"""Published Medusa / EAGLE checkpoints load as they are: SpeculativeModel.from_pretrained, `--heads` and
Hub ids convert them in memory (nothing written), to the very drafter `import` would write."""

import dataclasses
import json
import warnings

import pytest
import torch
import transformers
from huggingface_hub.utils import filter_repo_objects
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from cli_checks import greedy_reference, user_error
from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle import EagleDraft
from selfspec.heads.formats import export_heads
from selfspec.heads.medusa import MedusaHeads
from selfspec.heads.registry import load_heads
from selfspec.infer.cli.commands import main as cli
from selfspec.infer.core.generate import SpeculativeModel

PROMPT = "def add(a, b):"  # the tiny target continues it for 40 tokens before an EOS
NEW_TOKENS = 40
FORMATS = ("fastdecoding-medusa", "vllm-medusa", "eagle1", "sglang-eagle")
SMALL_TREE = {
    "draft_depth": 4,
    "draft_top_k": 4,
    "draft_total_tokens": 16,
}  # EAGLE's dynamic tree, smaller than the default


@pytest.fixture
def target(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture
def prompt(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)(PROMPT, return_tensors="pt").input_ids


def ours(kind, tiny_model_dir, out):
    """A selfspec drafter for the tiny target, every parameter random and non-zero, saved to `out`."""
    config = AutoConfig.from_pretrained(tiny_model_dir)
    shapes = dict(
        base_model=str(tiny_model_dir), hidden_size=config.hidden_size, vocab_size=config.vocab_size
    )
    if kind == "medusa":
        heads = MedusaHeads(HeadsConfig(kind="medusa", num_heads=3, **shapes))
    else:  # the dynamic-tree defaults: a published EAGLE layout carries none of its own
        heads = EagleDraft(HeadsConfig(kind="eagle", layer=layer_fields(config), **shapes))
    torch.manual_seed(1)
    for name, p in heads.named_parameters():
        torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.1)
    heads.save_pretrained(out)
    return heads.eval()


def publish(fmt, tiny_model_dir, tmp_path, weights=None):
    """Our drafter (saved under tmp_path/ours) and the same drafter as another project publishes it."""
    heads = ours("medusa" if "medusa" in fmt else "eagle", tiny_model_dir, tmp_path / "ours")
    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with warnings.catch_warnings():  # export's notes on what each engine drops are not this test's subject
        warnings.simplefilter("ignore")
        export_heads(heads, fmt, tmp_path / fmt, target, weights=weights)
    return heads, tmp_path / fmt


def drafter(spec):
    return spec.proposer.drafter


def assert_same_drafter(loaded, heads):
    """Every tensor, and the config but for the target it names (an EAGLE layout names none)."""
    before, after = heads.state_dict(), loaded.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert dataclasses.replace(loaded.config, base_model=heads.config.base_model) == heads.config


def stats(spec):
    s = spec.last_stats
    return s.accept_lengths, s.accepted_drafts, s.drafted


@pytest.mark.parametrize("fmt", FORMATS)
def test_from_pretrained_loads_a_published_checkpoint_as_it_is(fmt, tiny_model_dir, tmp_path, target, prompt):
    heads, published = publish(fmt, tiny_model_dir, tmp_path)
    files = sorted(p.name for p in published.iterdir())
    options = SMALL_TREE if "eagle" in fmt else {}
    spec = SpeculativeModel.from_pretrained(published, model=target, **options)
    assert sorted(p.name for p in published.iterdir()) == files  # converted in memory: nothing written
    assert_same_drafter(drafter(spec), heads)
    assert drafter(spec).config.base_model == str(tiny_model_dir)  # the target it is loaded for
    reference = SpeculativeModel.from_pretrained(tmp_path / "ours", model=target, **options)
    out = spec.generate(prompt, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out, target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False))
    assert torch.equal(reference.generate(prompt, max_new_tokens=NEW_TOKENS), out)
    assert stats(spec) == stats(reference)  # the same drafts, step by step
    assert sum(spec.last_stats.accepted_drafts) > 0  # ... and some of them accepted


def test_a_published_medusa_checkpoint_loads_the_target_it_names(tiny_model_dir, tmp_path, prompt):
    heads, published = publish("fastdecoding-medusa", tiny_model_dir, tmp_path)
    assert json.loads((published / "config.json").read_text())["base_model_name_or_path"] == str(
        tiny_model_dir.resolve()
    )
    spec = SpeculativeModel.from_pretrained(published)
    assert_same_drafter(drafter(spec), heads)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for a, b in zip(spec.model.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(spec.generate(prompt, max_new_tokens=NEW_TOKENS), expected)


@pytest.mark.parametrize("fmt, model", [("fastdecoding-medusa", False), ("eagle1", True)])
def test_cli_generate_takes_a_published_checkpoint(fmt, model, tiny_model_dir, tmp_path, target, prompt):
    _, published = publish(fmt, tiny_model_dir, tmp_path)
    out = tmp_path / "gen.json"
    options = SMALL_TREE if "eagle" in fmt else {}
    flags = ["--depth", "4", "--draft-top-k", "4", "--total-tokens", "16"] if options else []  # SMALL_TREE
    cli(
        [
            "generate",
            "--heads",
            str(published),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--quiet",
            "--json",
            str(out),
            *(["--model", str(tiny_model_dir)] if model else []),
            *flags,
        ]
    )
    record = json.loads(out.read_text())
    assert record["token_ids"] == greedy_reference(tiny_model_dir, PROMPT, NEW_TOKENS)
    reference = SpeculativeModel.from_pretrained(tmp_path / "ours", model=target, **options)
    reference.generate(prompt, max_new_tokens=NEW_TOKENS)
    got = record["stats"]
    assert (got["accept_lengths"], got["accepted_drafts"], got["drafted"]) == stats(reference)


def test_a_published_eagle_checkpoint_without_a_target_is_a_clear_error(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    _, published = publish("eagle1", tiny_model_dir, tmp_path)
    with pytest.raises(ValueError, match=f"the drafter in {published} names no target model .*pass model="):
        SpeculativeModel.from_pretrained(published)

    def refuse(*args, **kwargs):
        raise AssertionError("a target was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    capsys.readouterr()  # the export's progress bars
    line = user_error(capsys, ["generate", "--heads", str(published), "--prompt", "x"])
    assert (
        f"--heads {published} names no target model (SafeAILab's EAGLE checkpoints never do): pass --model"
        in line
    )


def test_tune_refuses_to_overwrite_a_published_config(tiny_model_dir, tmp_path, capsys):
    _, published = publish("fastdecoding-medusa", tiny_model_dir, tmp_path)
    config = (published / "config.json").read_text()
    capsys.readouterr()
    line = user_error(capsys, ["tune", "--heads", str(published)])
    assert "a published checkpoint's: write it in selfspec's layout first (selfspec import" in line
    assert (published / "config.json").read_text() == config


def test_a_published_eagle3_checkpoint_takes_its_fused_layers_from_the_target_it_is_loaded_for(
    tmp_path, capsys
):
    from conftest import tiny_config, tiny_tokenizer
    from selfspec.heads.eagle3 import Eagle3Draft
    from selfspec.heads.fused_draft import default_feature_layers

    config = tiny_config("llama")
    config.num_hidden_layers = 8  # deep enough for the engines' default [2, L // 2, L - 3]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in (
            p for p in model.parameters() if p.dim() >= 2
        ):  # as conftest.tiny_model: not one repeated token
            p.normal_(0, 0.3)
    model.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target").eval()
    heads = Eagle3Draft(
        HeadsConfig(
            kind="eagle3",
            base_model=str(tmp_path / "target"),
            hidden_size=48,
            vocab_size=96,
            fc_bias=False,
            layer=layer_fields(config),
            feature_layers=default_feature_layers(8),
        )
    )
    for name, p in heads.named_parameters():
        torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.1)
    published = tmp_path / "eagle3"
    export_heads(heads.eval(), "eagle3", published, target)
    raw = json.loads((published / "config.json").read_text())
    assert raw.pop("eagle_aux_hidden_state_layer_ids") == [2, 4, 5] == heads.config.feature_layers
    del raw["eagle_config"]  # as SafeAILab publishes EAGLE-3 drafters: the engines fuse their default layers
    (published / "config.json").write_text(json.dumps(raw))

    with pytest.raises(ValueError, match="names no eagle_aux_hidden_state_layer_ids.*L is unknown"):
        load_heads(published)
    spec = SpeculativeModel.from_pretrained(published, model=target)
    assert_same_drafter(spec.proposer.draft, heads)
    ids = torch.tensor([[5, 9, 14, 3]])
    expected = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(spec.generate(ids, max_new_tokens=NEW_TOKENS), expected)
    out = tmp_path / "gen.json"
    cli(
        [
            "generate",
            "--heads",
            str(published),
            "--model",
            str(tmp_path / "target"),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--quiet",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["token_ids"] == greedy_reference(
        tmp_path / "target", PROMPT, NEW_TOKENS
    )


def hub_cache(monkeypatch, tmp_path, repos):
    """An offline Hugging Face cache holding each {repo id: directory} as its `main` snapshot; returns the
    allow_patterns each snapshot_download call was given."""
    import huggingface_hub
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    for repo_id, directory in repos.items():
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        commit = "0" * 40
        for folder in ("refs", "snapshots"):
            (repo / folder).mkdir(parents=True)
        (repo / "refs" / "main").write_text(commit)
        directory.rename(repo / "snapshots" / commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    real, asked = huggingface_hub.snapshot_download, []
    monkeypatch.setattr(
        huggingface_hub,
        "snapshot_download",
        lambda repo_id, **kw: asked.append(kw["allow_patterns"]) or real(repo_id, **kw),
    )
    return asked


def test_hub_ids_of_published_checkpoints_load_from_the_cache(
    tiny_model_dir, tmp_path, target, prompt, monkeypatch
):
    medusa, fd = publish("fastdecoding-medusa", tiny_model_dir, tmp_path / "m")
    (fd / "medusa_lm_head.safetensors").unlink()  # as FasterDecoding/medusa-vicuna-7b-v1.3: the .pt alone
    eagle, e1 = publish("eagle1", tiny_model_dir, tmp_path / "e", weights="bin")  # as yuhuili/EAGLE-*: a .bin
    needed = {"medusa": ["config.json", "medusa_lm_head.pt"], "eagle": ["config.json", "pytorch_model.bin"]}
    assert {
        "medusa": sorted(p.name for p in fd.iterdir()),
        "eagle": sorted(p.name for p in e1.iterdir()),
    } == needed
    asked = hub_cache(monkeypatch, tmp_path, {"someone/medusa-tiny": fd, "someone/eagle-tiny": e1})

    spec = SpeculativeModel.from_pretrained("someone/medusa-tiny", model=target)
    assert_same_drafter(drafter(spec), medusa)
    assert torch.equal(
        spec.generate(prompt, max_new_tokens=NEW_TOKENS),
        target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False),
    )
    assert_same_drafter(load_heads("someone/eagle-tiny"), eagle)
    out = tmp_path / "gen.json"
    cli(
        [
            "generate",
            "--heads",
            "someone/eagle-tiny",
            "--model",
            str(tiny_model_dir),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--quiet",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["token_ids"] == greedy_reference(tiny_model_dir, PROMPT, NEW_TOKENS)
    # online, snapshot_download fetches only what allow_patterns match: every weight file a layout reads
    assert len(asked) == 3
    published = [
        *needed["medusa"],
        *needed["eagle"],
        "medusa_lm_head.safetensors",
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model.bin.index.json",
    ]
    for patterns in asked:
        assert list(filter_repo_objects(published, allow_patterns=patterns)) == published
        assert list(filter_repo_objects(["optimizer.pt", "training_args.bin"], allow_patterns=patterns)) == []
