"""`selfspec generate | bench | tune` end to end, the drafters they take, and the one-line errors of what does
not load; the options and input files checked before loading are test_cli_options.py's."""

import json
import sys

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from cli_checks import greedy_reference, user_error
from selfspec.cli import main as cli
from selfspec.heads.config import HeadsConfig
from selfspec.heads.medusa import MedusaHeads
from selfspec.train.loop.config import load_config
from selfspec.train.medusa import run
from selfspec.train.recipes.medusa import MedusaConfig


@pytest.fixture
def trained_heads(tiny_model_dir, tmp_path, monkeypatch):
    from conftest import TOKENIZER_TEXT

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data.txt"
    data.write_text(TOKENIZER_TEXT * 30)
    out = tmp_path / "heads"
    args = {
        "model": tiny_model_dir,
        "dataset": data,
        "output_dir": out,
        "max_length": 32,
        "max_steps": 4,
        "per_device_train_batch_size": 4,
        "eval_steps": 4,
        "num_heads": 3,
        "max_minutes": 0,
        "tree_nodes": 8,
        "self_distill": False,
        "max_train_examples": 0,
        "mixed_precision": "no",
    }
    run(load_config(MedusaConfig, [x for k, v in args.items() for x in (f"--{k}", str(v))]))
    return out


def test_generate_json_equals_transformers_greedy(trained_heads, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "gen.json"
    cli(
        [
            "generate",
            "--heads",
            str(trained_heads),
            "--prompt",
            "def add(a, b):",
            "--max-new-tokens",
            "30",
            "--json",
            str(out),
        ]
    )
    record = json.loads(out.read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("def add(a, b):", return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1] :].tolist()
    assert record["token_ids"] == ref
    assert record["stats"]["new_tokens"] == len(ref)
    assert record["text"] == tok.decode(ref, skip_special_tokens=True)
    assert record["text"] in capsys.readouterr().out


def test_bench_writes_every_method(trained_heads, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "class Point:"}\n')
    out = tmp_path / "bench.json"
    cli(
        [
            "bench",
            "--heads",
            str(trained_heads),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "12",
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert result["baseline"] == "hf_generate"
    assert set(result["methods"]) == {"hf_generate", "plain", "medusa"}
    for m in result["methods"].values():
        assert m["identical_to_baseline"] is True
        assert {"tokens_per_s", "tau", "target_forwards", "new_tokens"} <= set(m)
        assert m["launches_per_step"]["inside"] > m["launches_per_step"]["outside"] > 0
    printed = capsys.readouterr().out
    assert "medusa" in printed and "kernel launches per step outside the target's forward" in printed


def test_missing_heads_dir_is_a_clear_error(tmp_path, capsys):
    line = user_error(capsys, ["generate", "--heads", str(tmp_path / "nope"), "--prompt", "x"])
    assert f"--heads {tmp_path / 'nope'}: no config.json there" in line


def test_bench_compares_several_drafters_on_one_target(medusa_dir, eagle_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "class Point:"}\n{"prompt": "import os"}\n')
    out = tmp_path / "bench.json"
    cli(
        [
            "bench",
            "--heads",
            str(medusa_dir),
            "--heads",
            str(eagle_dir),
            "--heads",
            str(medusa_dir),
            "--prompts",
            str(prompts),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "8",
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 2  # the file's first two
    assert list(result["methods"]) == ["hf_generate", "plain", "medusa", "eagle", "medusa#2"]
    for m in result["methods"].values():
        assert m["identical_to_baseline"] is True
    assert result["tree_nodes"] == {"medusa": 25, "eagle": 9, "medusa#2": 25}  # 24 default choices; 8 + root
    assert result["dtype"] == "float32"
    err = capsys.readouterr().err
    assert "medusa 25, eagle 9, medusa#2 25" in err


def test_generate_with_eagle_heads_and_tree_options(eagle_dir, tiny_model_dir, tmp_path, monkeypatch):
    from selfspec.infer.core.generate import SpeculativeModel

    loaded = []
    load = SpeculativeModel.from_pretrained.__func__
    monkeypatch.setattr(
        SpeculativeModel,
        "from_pretrained",
        classmethod(lambda cls, *a, **kw: loaded.append(load(cls, *a, **kw)) or loaded[-1]),
    )
    out = tmp_path / "gen.json"
    cli(
        [
            "generate",
            "--heads",
            str(eagle_dir),
            "--prompt",
            "def add(a, b):",
            "--max-new-tokens",
            "12",
            "--depth",
            "2",
            "--draft-top-k",
            "2",
            "--total-tokens",
            "4",
            "--quiet",
            "--json",
            str(out),
        ]
    )
    record = json.loads(out.read_text())
    assert record["token_ids"] == greedy_reference(tiny_model_dir, "def add(a, b):", 12)
    proposer = loaded[0].proposer
    assert (proposer.name, proposer.depth, proposer.top_k, proposer.max_nodes) == (
        "eagle",
        2,
        2,
        5,
    )  # 4 + root
    assert max(record["stats"]["accept_lengths"]) <= 3  # depth 2: two drafted tokens and the bonus at most


@pytest.fixture
def draft_model_dir(tmp_path):
    """A different tiny model with the target's vocabulary, saved like a hub draft model."""
    from conftest import tiny_model

    path = tmp_path / "tiny-draft"
    tiny_model("gpt2", seed=1).save_pretrained(path)
    return path


def test_bench_races_transformers_speculative_decoding(tiny_model_dir, draft_model_dir, eagle_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "def add(a, b):\\n    return a + b\\n\\ndef add(a, b):"}\n{"prompt": "class Point:"}\n'
    )
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    cli(
        [
            "bench",
            "--model",
            str(tiny_model_dir),
            "--heads",
            str(eagle_dir),
            "--draft-model",
            str(draft_model_dir),
            "--num-draft-tokens",
            "3",
            "--prompt-lookup",
            "--lookup-first",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "16",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 2  # all of the file
    assert list(result["methods"]) == [
        "hf_generate",
        "plain",
        "hf_assisted",
        "hf_prompt_lookup",
        "eagle",
        "eagle+lookup",
        "draft_model",
        "prompt_lookup",
    ]
    for name, m in result["methods"].items():
        assert m["identical_to_baseline"] is True, name
        assert m["tau"] >= 1 and m["target_forwards"] >= 2
    assert result["methods"]["hf_generate"]["tau"] == 1.0  # one forward per token, counted by the hook
    for name in ("draft_model", "prompt_lookup"):
        m = result["methods"][name]
        assert 0 <= m["alpha"] <= 1 and m["predicted_tau"] >= 1
    assert "alpha" not in result["methods"]["eagle"]
    assert plot.stat().st_size > 10_000


def test_generate_takes_exactly_one_drafter(tiny_model_dir, draft_model_dir, medusa_dir, capsys):
    assert "exactly one drafter" in user_error(
        capsys, ["generate", "--model", str(tiny_model_dir), "--prompt", "x"]
    )
    assert "exactly one drafter" in user_error(
        capsys, ["generate", "--heads", str(medusa_dir), "--prompt-lookup", "--prompt", "x"]
    )


@pytest.mark.parametrize("flag", ["--draft-model", "--prompt-lookup"])
def test_generate_with_a_draft_model_or_prompt_lookup(flag, tiny_model_dir, draft_model_dir, tmp_path):
    out = tmp_path / "gen.json"
    drafter = [flag, str(draft_model_dir)] if flag == "--draft-model" else [flag]
    cli(
        [
            "generate",
            "--model",
            str(tiny_model_dir),
            *drafter,
            "--prompt",
            "def add(a, b):",
            "--max-new-tokens",
            "20",
            "--quiet",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["token_ids"] == greedy_reference(tiny_model_dir, "def add(a, b):", 20)


def test_tune_stores_a_medusa_tree_and_an_eagle_setting(medusa_dir, eagle_dir, capsys):
    assert json.loads((medusa_dir / "config.json").read_text())["tree"] is None
    cli(["tune", "--heads", str(medusa_dir), "--num-prompts", "2"])
    chosen = next(line for line in capsys.readouterr().out.splitlines() if "<- chosen" in line)
    tree = json.loads((medusa_dir / "config.json").read_text())["tree"]
    assert tree is not None and chosen.startswith(
        f"{len(tree) + 1:5d} nodes:"
    )  # what was measured best is stored
    cli(
        [
            "tune",
            "--heads",
            str(eagle_dir),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "6",
            "--batch-size",
            "2",
        ]
    )
    printed = capsys.readouterr().out
    assert "at batch size 2" in printed
    config = json.loads((eagle_dir / "config.json").read_text())
    chosen = next(line for line in printed.splitlines() if "<- chosen" in line)
    assert (
        f"depth {config['depth']:2d}  top_k {config['top_k']:2d}  total_tokens {config['total_tokens']:3d}"
        in chosen
    )
    assert "stored depth" in printed


def test_tune_prefers_a_smaller_medusa_tree_when_latency_grows_faster():
    from conftest import tiny_model
    from selfspec.infer.measure.tune import tune_medusa

    model = tiny_model("llama")
    heads = MedusaHeads(HeadsConfig(hidden_size=48, vocab_size=96, num_heads=3))
    heads.init_from_lm_head(model.get_output_embeddings())
    prompts = [torch.randint(3, 90, (6,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    sizes = [1, 4, 8, 16, 32, 64]
    flat = {n: 0.010 * (1 + 0.005 * n) for n in sizes}  # a GPU-like curve: nodes are nearly free
    steep = {n: 0.010 * (1 + 0.1 * n) for n in sizes}  # every node costs a tenth of a forward
    flat_tree, _, accuracy = tune_medusa(model, heads, prompts, latency=flat)
    steep_tree, rows, _ = tune_medusa(model, heads, prompts, latency=steep)
    assert accuracy.shape == (3, 10) and accuracy[0, 0] > 0
    assert len(steep_tree) < len(flat_tree)


def test_damaged_heads_files_are_one_line_errors_naming_the_file(medusa_dir, capsys):
    argv = ["generate", "--heads", str(medusa_dir), "--prompt", "x"]
    weights = medusa_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    assert f"cannot read the weights in {weights}" in user_error(capsys, argv)
    config = json.loads((medusa_dir / "config.json").read_text())
    (medusa_dir / "config.json").write_text(json.dumps(config | {"hidden_size": "48"}))
    line = user_error(capsys, argv)
    assert str(medusa_dir / "config.json") in line and "hidden_size must be int" in line
    (medusa_dir / "config.json").write_text("{not json")
    assert str(medusa_dir / "config.json") in user_error(capsys, argv)


def test_damaged_target_weights_are_one_line_errors_naming_the_file(tiny_model_dir, capsys):
    weights = tiny_model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    line = user_error(
        capsys, ["generate", "--model", str(tiny_model_dir), "--prompt-lookup", "--prompt", "x"]
    )
    assert f"--model {tiny_model_dir}: the weights in {weights}: cannot load it: SafetensorError" in line
    missing = tiny_model_dir.parent / "nope"
    line = user_error(capsys, ["generate", "--model", str(missing), "--prompt-lookup", "--prompt", "x"])
    assert f"the model folder {missing} does not exist" in line


def test_debug_shows_the_traceback(tmp_path, monkeypatch):
    argv = ["generate", "--heads", str(tmp_path / "nope"), "--prompt", "x"]
    with pytest.raises(ValueError, match="no config.json"):
        cli([*argv, "--debug"])
    monkeypatch.setenv("SELFSPEC_DEBUG", "1")
    with pytest.raises(ValueError, match="no config.json"):
        cli(argv)


@pytest.mark.parametrize("command", ["export", "import"])
def test_export_and_import_never_write_over_a_checkpoint(medusa_dir, tmp_path, capsys, command):
    """Writing a checkpoint's files over another's leaves a mix that loads as neither: refused, files
    untouched."""
    before = {p.name: p.read_bytes() for p in medusa_dir.iterdir() if p.is_file()}
    argv = (
        ["export", "--heads", str(medusa_dir), "--format", "vllm-medusa"]
        if command == "export"
        else ["import", "--src", str(medusa_dir)]
    )
    err = user_error(capsys, [*argv, "--out", str(medusa_dir)])
    assert f"--out {medusa_dir} already holds a checkpoint (README.md, config.json, model.safetensors)" in err
    assert {p.name: p.read_bytes() for p in medusa_dir.iterdir() if p.is_file()} == before
    if command == "import":  # our own layout needs no import
        assert "is already a selfspec drafter: use it as --heads directly" in user_error(
            capsys, [*argv, "--out", str(tmp_path / "new")]
        )
    notes = tmp_path / "notes"  # a folder holding only the user's README.md: the model card would replace it
    notes.mkdir()
    (notes / "README.md").write_text("mine")
    assert "already holds a checkpoint (README.md)" in user_error(capsys, [*argv, "--out", str(notes)])
    assert (notes / "README.md").read_text() == "mine"


def test_a_medusa_tree_rank_beyond_the_vocabulary_is_a_clear_error(medusa_dir, capsys):
    err = user_error(
        capsys, ["generate", "--heads", str(medusa_dir), "--prompt", "def", "--tree", "[[0], [9000]]"]
    )
    assert "rank 9000 of a head's guesses" in err


def test_a_prompt_rendered_with_its_bos_gets_no_second_one():
    """A chat-templated prompt already starts with the BOS text; tokenizing it with the special tokens added
    (as a plain prompt is) would start it with two BOS tokens."""
    from tokenizers.processors import TemplateProcessing

    from conftest import tiny_tokenizer
    from selfspec.infer.measure.bench import encode_prompt

    tok = tiny_tokenizer()
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)]
    )
    plain = encode_prompt(tok, "def add(a, b):")[0].tolist()
    rendered = encode_prompt(tok, "<bos>def add(a, b):")[0].tolist()
    assert plain[0] == tok.bos_token_id and plain[1] != tok.bos_token_id
    assert rendered == plain


def test_the_console_script_names_itself_selfspec(monkeypatch, capsys):
    from selfspec.cli import main as console

    monkeypatch.setattr(sys, "argv", ["selfspec", "generate", "--heads", "/no/such/heads", "--prompt", "x"])
    with pytest.raises(SystemExit) as exit_info:
        console()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("selfspec: error: ")
    monkeypatch.setattr(sys, "argv", ["selfspec", "no-such-command"])
    with pytest.raises(SystemExit):
        console()
    assert capsys.readouterr().err.startswith(
        "selfspec: error: argument command: invalid choice: 'no-such-command'"
    )


def test_version_prints_the_installed_version(capsys):
    import selfspec

    with pytest.raises(SystemExit) as exit_info:
        cli(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"selfspec {selfspec.__version__}\n"


def test_quiet_prints_nothing_and_warnings_are_one_plain_line(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import warnings

    import selfspec.cli as console
    import selfspec.infer.cli.commands as infer_cli

    out = tmp_path / "gen.json"
    transformers.utils.logging.enable_progress_bar()  # as in a fresh process: the "Loading weights" bar is on
    cli(
        [
            "generate",
            "--prompt-lookup",
            "--model",
            str(tiny_model_dir),
            "--prompt",
            "def add(a, b):",
            "--max-new-tokens",
            "8",
            "--quiet",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err == ""
    assert len(json.loads(out.read_text())["token_ids"]) == 8
    assert transformers.utils.logging.is_progress_bar_enabled()  # given back as it was

    def warns(args):
        warnings.warn("the tree was fitted on a busy machine:\n re-fit it", UserWarning, stacklevel=1)

    monkeypatch.setitem(console.COMMANDS, "recipes", infer_cli.Command(infer_cli.recipes_parser, warns))
    cli(["recipes"])
    assert capsys.readouterr().err == "selfspec: warning: the tree was fitted on a busy machine: re-fit it\n"
