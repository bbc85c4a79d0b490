import json
import sys

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfspec.heads.config import HeadsConfig
from selfspec.heads.medusa import MedusaHeads
from selfspec.infer.cli import main as cli
from selfspec.train.config import load_config
from selfspec.train.medusa import MedusaConfig, run


@pytest.fixture
def trained_heads(tiny_model_dir, tmp_path, monkeypatch):
    from conftest import TOKENIZER_TEXT

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data.txt"
    data.write_text(TOKENIZER_TEXT * 30)
    out = tmp_path / "heads"
    args = {"model": tiny_model_dir, "dataset": data, "output_dir": out, "max_length": 32, "max_steps": 4,
            "per_device_train_batch_size": 4, "eval_steps": 4, "num_heads": 3, "max_minutes": 0, "tree_nodes": 8,
            "self_distill": False, "max_train_examples": 0, "mixed_precision": "no"}
    run(load_config(MedusaConfig, [x for k, v in args.items() for x in (f"--{k}", str(v))]))
    return out


def user_error(capsys, argv: list[str]) -> str:
    """Run the CLI expecting a user error: exit status 2 and one line on stderr, no traceback. Returns the line."""
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars share stderr
    try:
        with pytest.raises(SystemExit) as exit_:
            cli(argv)
    finally:
        transformers.utils.logging.enable_progress_bar()
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("selfspec") and ": error: " in err
    return err.strip()


@pytest.fixture
def no_weights(monkeypatch):
    """Loading the target's weights fails the test: what is checked up front must not wait for them."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model's weights were loaded before the check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def greedy_reference(model_dir, prompt: str, max_new_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = AutoTokenizer.from_pretrained(model_dir)(prompt, return_tensors="pt").input_ids
    return model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()


def test_generate_json_equals_transformers_greedy(trained_heads, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "gen.json"
    cli(["generate", "--heads", str(trained_heads), "--prompt", "def add(a, b):", "--max-new-tokens", "30",
         "--json", str(out)])
    record = json.loads(out.read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("def add(a, b):", return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1]:].tolist()
    assert record["token_ids"] == ref
    assert record["stats"]["new_tokens"] == len(ref)
    assert record["text"] == tok.decode(ref, skip_special_tokens=True)
    assert record["text"] in capsys.readouterr().out


def test_bench_writes_every_method(trained_heads, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "class Point:"}\n')
    out = tmp_path / "bench.json"
    cli(["bench", "--heads", str(trained_heads), "--prompts", str(prompts), "--max-new-tokens", "12",
         "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["baseline"] == "hf_generate"
    assert set(result["methods"]) == {"hf_generate", "plain", "medusa"}
    for m in result["methods"].values():
        assert m["identical_to_baseline"] is True
        assert {"tokens_per_s", "tau", "target_forwards", "new_tokens"} <= set(m)
    assert "medusa" in capsys.readouterr().out


def test_missing_heads_dir_is_a_clear_error(tmp_path, capsys):
    line = user_error(capsys, ["generate", "--heads", str(tmp_path / "nope"), "--prompt", "x"])
    assert f"--heads {tmp_path / 'nope'}: no config.json there" in line


def test_bench_compares_several_drafters_on_one_target(medusa_dir, eagle_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "class Point:"}\n{"prompt": "import os"}\n')
    out = tmp_path / "bench.json"
    cli(["bench", "--heads", str(medusa_dir), "--heads", str(eagle_dir), "--heads", str(medusa_dir),
         "--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "8", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 2  # the file's first two
    assert list(result["methods"]) == ["hf_generate", "plain", "medusa", "eagle", "medusa#2"]
    for m in result["methods"].values():
        assert m["identical_to_baseline"] is True
    assert result["tree_nodes"] == {"medusa": 25, "eagle": 9, "medusa#2": 25}  # 24 default choices; 8 + root
    assert result["dtype"] == "float32"
    err = capsys.readouterr().err
    assert "medusa 25, eagle 9, medusa#2 25" in err


@pytest.mark.parametrize("extra, message", [
    (["--depth", "2"], "--depth shape EAGLE's dynamic tree, but the heads are medusa heads"),
    (["--top-k", "2", "--total-tokens", "4"], "--draft-top-k, --total-tokens shape EAGLE's dynamic tree, but"),
    (["--depth", "2", "--tree", "[[0]]"], "give one or the other"),
])
def test_eagle_options_with_medusa_heads_are_a_clear_error(medusa_dir, extra, message, capsys, no_weights):
    assert message in user_error(capsys, ["bench", "--heads", str(medusa_dir), "--num-prompts", "1", *extra])


def test_generate_with_eagle_heads_and_tree_options(eagle_dir, tiny_model_dir, tmp_path, monkeypatch):
    from selfspec.infer.generate import SpeculativeModel

    loaded = []
    load = SpeculativeModel.from_pretrained.__func__
    monkeypatch.setattr(SpeculativeModel, "from_pretrained",
                        classmethod(lambda cls, *a, **kw: loaded.append(load(cls, *a, **kw)) or loaded[-1]))
    out = tmp_path / "gen.json"
    cli(["generate", "--heads", str(eagle_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "12",
         "--depth", "2", "--draft-top-k", "2", "--total-tokens", "4", "--quiet", "--json", str(out)])
    record = json.loads(out.read_text())
    assert record["token_ids"] == greedy_reference(tiny_model_dir, "def add(a, b):", 12)
    proposer = loaded[0].proposer
    assert (proposer.name, proposer.depth, proposer.top_k, proposer.max_nodes) == ("eagle", 2, 2, 5)  # 4 + root
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
    prompts.write_text('{"prompt": "def add(a, b):\\n    return a + b\\n\\ndef add(a, b):"}\n{"prompt": "class Point:"}\n')
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    cli(["bench", "--model", str(tiny_model_dir), "--heads", str(eagle_dir), "--draft-model", str(draft_model_dir),
         "--num-draft-tokens", "3", "--prompt-lookup", "--lookup-first", "--prompts", str(prompts), "--max-new-tokens", "16",
         "--json", str(out), "--plot", str(plot)])
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 2  # all of the file
    assert list(result["methods"]) == ["hf_generate", "plain", "hf_assisted", "hf_prompt_lookup", "eagle",
                                       "eagle+lookup", "draft_model", "prompt_lookup"]
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
    assert "exactly one drafter" in user_error(capsys, ["generate", "--model", str(tiny_model_dir), "--prompt", "x"])
    assert "exactly one drafter" in user_error(capsys, ["generate", "--heads", str(medusa_dir), "--prompt-lookup",
                                                        "--prompt", "x"])


@pytest.mark.parametrize("flag", ["--draft-model", "--prompt-lookup"])
def test_generate_with_a_draft_model_or_prompt_lookup(flag, tiny_model_dir, draft_model_dir, tmp_path):
    out = tmp_path / "gen.json"
    drafter = [flag, str(draft_model_dir)] if flag == "--draft-model" else [flag]
    cli(["generate", "--model", str(tiny_model_dir), *drafter, "--prompt", "def add(a, b):", "--max-new-tokens", "20",
         "--quiet", "--json", str(out)])
    assert json.loads(out.read_text())["token_ids"] == greedy_reference(tiny_model_dir, "def add(a, b):", 20)


def test_tune_stores_a_medusa_tree_and_an_eagle_setting(medusa_dir, eagle_dir, capsys):
    assert json.loads((medusa_dir / "config.json").read_text())["tree"] is None
    cli(["tune", "--heads", str(medusa_dir), "--num-prompts", "2"])
    chosen = next(line for line in capsys.readouterr().out.splitlines() if "<- chosen" in line)
    tree = json.loads((medusa_dir / "config.json").read_text())["tree"]
    assert tree is not None and chosen.startswith(f"{len(tree) + 1:5d} nodes:")  # what was measured best is stored
    cli(["tune", "--heads", str(eagle_dir), "--num-prompts", "2", "--max-new-tokens", "6", "--batch-size", "2"])
    printed = capsys.readouterr().out
    assert "at batch size 2" in printed
    config = json.loads((eagle_dir / "config.json").read_text())
    chosen = next(line for line in printed.splitlines() if "<- chosen" in line)
    assert f"depth {config['depth']:2d}  top_k {config['top_k']:2d}  total_tokens {config['total_tokens']:3d}" in chosen
    assert "stored depth" in printed


def test_tune_prefers_a_smaller_medusa_tree_when_latency_grows_faster():
    from conftest import tiny_model
    from selfspec.infer.tune import tune_medusa

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


GEN = ["generate", "--prompt-lookup", "--prompt", "x"]
BENCH = ["bench", "--prompt-lookup"]
TEMPERATURE_RULE = "temperature must be 0 (greedy) or a finite number >= 1e-06"


@pytest.mark.parametrize("argv, option, value, rule", [
    (GEN + ["--temperature", "nan"], "--temperature", "got nan", TEMPERATURE_RULE),
    (GEN + ["--temperature", "1e-39"], "--temperature", "got 1e-39", TEMPERATURE_RULE),
    (GEN + ["--temperature", "-0.5"], "--temperature", "got -0.5", TEMPERATURE_RULE),
    (GEN + ["--temperature", "hot"], "--temperature", "'hot'", "expected a number"),
    (GEN + ["--top-p", "0"], "--top-p", "got 0.0", "top_p must be in (0, 1]"),
    (GEN + ["--top-p", "1.5"], "--top-p", "got 1.5", "top_p must be in (0, 1]"),
    (GEN + ["--top-k", "-1"], "--top-k", "got -1", "an integer >= 0"),
    (GEN + ["--max-new-tokens", "0"], "--max-new-tokens", "got 0", "an integer >= 1"),
    (GEN + ["--num-draft-tokens", "0"], "--num-draft-tokens", "got 0", "an integer >= 1"),
    (GEN + ["--prompt-lookup-tokens", "0"], "--prompt-lookup-tokens", "got 0", "an integer >= 1"),
    (GEN + ["--depth", "0"], "--depth", "got 0", "an integer >= 1"),
    (GEN + ["--draft-top-k", "0"], "--draft-top-k", "got 0", "an integer >= 1"),
    (GEN + ["--total-tokens", "-3"], "--total-tokens", "got -3", "an integer >= 1"),
    (GEN + ["--tree", "[[0],"], "--tree", "not JSON", "e.g. --tree"),
    (GEN + ["--tree", "[]"], "--tree", "has no node", "nothing would be drafted"),
    (GEN + ["--tree", "[[0], [1], [0]]"], "--tree", "[0] more than once", "give each path once"),
    (BENCH + ["--max-new-tokens", "-5"], "--max-new-tokens", "got -5", "an integer >= 1"),
    (BENCH + ["--num-prompts", "0"], "--num-prompts", "got 0", "an integer >= 1"),
    (BENCH + ["--threads", "-1"], "--threads", "got -1", "an integer >= 0"),
    (BENCH + ["--top-k", "0"], "--draft-top-k/--top-k", "got 0", "an integer >= 1"),
    (["tune", "--heads", "x", "--num-prompts", "0"], "--num-prompts", "got 0", "an integer >= 1"),
    (GEN + ["--device", "meta"], "--device", "meta", "a model cannot run on a meta device"),
    (GEN + ["--device", "xpu"], "--device", "xpu", "no XPU device is available here; use --device cpu"),
])
def test_bad_option_values_are_one_line_errors(argv, option, value, rule, capsys, no_weights):
    line = user_error(capsys, argv)
    assert f"argument {option}: " in line and value in line and rule in line


@pytest.fixture
def short_model_dir(tmp_path):
    """The tiny Llama target saved with a config that allows 48 positions."""
    from conftest import tiny_model, tiny_tokenizer

    path = tmp_path / "short-target"
    model = tiny_model("llama")
    model.config.max_position_embeddings = 48
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_generate_clips_the_budget_to_the_models_positions(short_model_dir, tmp_path, capsys):
    prompt = "def add(a, b):\n    return a + b\n"
    length = AutoTokenizer.from_pretrained(short_model_dir)(prompt, return_tensors="pt").input_ids.shape[1]
    out = tmp_path / "gen.json"
    cli(["generate", "--model", str(short_model_dir), "--prompt-lookup", "--prompt", prompt, "--max-new-tokens", "100",
         "--quiet", "--json", str(out)])
    assert f"note: --max-new-tokens 100 clipped to {48 - length}" in capsys.readouterr().err
    record = json.loads(out.read_text())
    assert record["token_ids"] == greedy_reference(short_model_dir, prompt, 48 - length)


def test_generate_refuses_a_prompt_that_fills_the_positions_before_loading(short_model_dir, capsys, no_weights):
    prompt = "def add(a, b):\n    return a + b\n" * 4
    length = AutoTokenizer.from_pretrained(short_model_dir)(prompt, return_tensors="pt").input_ids.shape[1]
    assert length >= 48
    line = user_error(capsys, ["generate", "--model", str(short_model_dir), "--prompt-lookup", "--prompt", prompt])
    assert f"--prompt: the prompt is {length} tokens but the model takes at most 48 positions" in line


def test_bench_refuses_prompts_that_do_not_fit_before_loading(short_model_dir, tmp_path, capsys, no_weights):
    long = "def add(a, b):\n    return a + b"
    length = AutoTokenizer.from_pretrained(short_model_dir)(long, return_tensors="pt").input_ids.shape[1]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n" + json.dumps({"prompt": long}) + "\n")
    n = 48 - length + 1  # the short prompt fits, the long one is one token over
    line = user_error(capsys, ["bench", "--model", str(short_model_dir), "--prompt-lookup", "--prompts", str(prompts),
                               "--max-new-tokens", str(n)])
    assert (f"1 of 2 prompts (the longest {length} tokens) + --max-new-tokens {n} exceed the model's 48 positions: "
            f"lower --max-new-tokens to {n - 1} or use shorter prompts") in line


def test_bench_plot_without_matplotlib_fails_before_the_benchmark(tiny_model_dir, tmp_path, capsys, monkeypatch,
                                                                   no_weights):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails as if not installed
    line = user_error(capsys, ["bench", "--model", str(tiny_model_dir), "--prompt-lookup", "--num-prompts", "1",
                               "--plot", str(tmp_path / "bench.png")])
    assert "--plot needs matplotlib" in line and "pip install matplotlib" in line


def test_bench_plot_into_an_unknown_file_type_fails_before_the_benchmark(tiny_model_dir, tmp_path, capsys,
                                                                         no_weights):
    line = user_error(capsys, ["bench", "--model", str(tiny_model_dir), "--prompt-lookup", "--num-prompts", "1",
                               "--plot", str(tmp_path / "bench.xyz")])
    assert f"--plot {tmp_path / 'bench.xyz'}: name a file ending in one of" in line and ".png" in line


def test_json_into_a_missing_folder_is_made_before_loading(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "new" / "deeper" / "gen.json"
    load = transformers.AutoModelForCausalLM.from_pretrained

    def load_after_the_folder(*args, **kwargs):
        assert out.parent.is_dir()
        return load(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_after_the_folder)
    cli(["generate", "--model", str(tiny_model_dir), "--prompt-lookup", "--prompt", "def add(a, b):",
         "--max-new-tokens", "5", "--quiet", "--json", str(out)])
    assert json.loads(out.read_text())["token_ids"] == greedy_reference(tiny_model_dir, "def add(a, b):", 5)


def test_json_onto_a_folder_or_under_a_file_is_an_error_before_loading(tiny_model_dir, tmp_path, capsys, no_weights):
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt-lookup", "--prompt", "x", "--json"]
    assert f"--json {tmp_path} is a folder" in user_error(capsys, [*argv, str(tmp_path)])
    (tmp_path / "file").write_text("")
    line = user_error(capsys, [*argv, str(tmp_path / "file" / "gen.json")])
    assert f"--json {tmp_path / 'file' / 'gen.json'}: cannot create its folder" in line


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
    line = user_error(capsys, ["generate", "--model", str(tiny_model_dir), "--prompt-lookup", "--prompt", "x"])
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
    """Writing a checkpoint's files over another's leaves a mix that loads as neither: refused, files untouched."""
    before = {p.name: p.read_bytes() for p in medusa_dir.iterdir() if p.is_file()}
    argv = (["export", "--heads", str(medusa_dir), "--format", "vllm-medusa"] if command == "export"
            else ["import", "--src", str(medusa_dir)])
    err = user_error(capsys, [*argv, "--out", str(medusa_dir)])
    assert f"--out {medusa_dir} already holds a checkpoint (README.md, config.json, model.safetensors)" in err
    assert {p.name: p.read_bytes() for p in medusa_dir.iterdir() if p.is_file()} == before
    if command == "import":  # our own layout needs no import
        assert "is already a selfspec drafter: use it as --heads directly" in user_error(
            capsys, [*argv, "--out", str(tmp_path / "new")])
    notes = tmp_path / "notes"  # a folder holding only the user's README.md: the model card would replace it
    notes.mkdir()
    (notes / "README.md").write_text("mine")
    assert "already holds a checkpoint (README.md)" in user_error(capsys, [*argv, "--out", str(notes)])
    assert (notes / "README.md").read_text() == "mine"


def test_a_medusa_tree_rank_beyond_the_vocabulary_is_a_clear_error(medusa_dir, capsys):
    err = user_error(capsys, ["generate", "--heads", str(medusa_dir), "--prompt", "def", "--tree", "[[0], [9000]]"])
    assert "rank 9000 of a head's guesses" in err


@pytest.mark.parametrize("command", [["generate", "--prompt", "def"], ["bench"]])
def test_lookup_first_without_heads_is_a_clear_error(command, capsys, no_weights):
    err = user_error(capsys, [*command, "--prompt-lookup", "--lookup-first"])
    assert "--lookup-first puts prompt lookup in front of heads: give --heads DIR" in err


@pytest.mark.parametrize("command", [["generate", "--prompt", "def"], ["bench"]])
@pytest.mark.parametrize("extra, message", [
    (["--num-draft-tokens", "9"], "--num-draft-tokens is the draft model's proposal length: give --draft-model"),
    (["--prompt-lookup-tokens", "9"], "--prompt-lookup-tokens applies to prompt lookup: add --prompt-lookup"),
])
def test_a_drafters_option_without_that_drafter_is_refused(command, extra, message, medusa_dir, capsys, no_weights):
    assert message in user_error(capsys, [*command, "--heads", str(medusa_dir), *extra])  # else silently unused


def test_top_k_or_top_p_on_a_greedy_run_is_refused(medusa_dir, capsys):
    err = user_error(capsys, ["generate", "--heads", str(medusa_dir), "--prompt", "def", "--top-p", "0.5"])
    assert "--top-p only apply when sampling, but this run is greedy (no --temperature" in err
    err = user_error(capsys, ["generate", "--heads", str(medusa_dir), "--prompt", "def", "--temperature", "0",
                              "--top-k", "5"])
    assert "--top-k only apply when sampling, but this run is greedy (--temperature 0): add --temperature T" in err


@pytest.mark.parametrize("lines, message", [
    ('{"prompt": "def f():"}\n{"prompt": "x"\n', "prompts.jsonl:2 is not JSON"),
    ('{"prompt": "def f():"}\n\n"def g():"\n', "prompts.jsonl:3 has no \"prompt\" string or \"messages\" list"),
    ('{"prompt": 3}\n', "prompts.jsonl:1 has no \"prompt\" string or \"messages\" list"),
    ('{"text": "def f():"}\n', "prompts.jsonl:1 has no \"prompt\" string or \"messages\" list"),
    ('\n\n', "holds no prompts"),
    (b'\xff\xfe{"prompt"', "cannot read it (not UTF-8 text)"),
    ('{"prompt": " \\n "}\n', "prompts.jsonl:1 has an empty prompt"),
])
@pytest.mark.parametrize("command", ["bench", "tune"])
def test_a_bad_prompts_file_is_one_line_naming_the_line(medusa_dir, tmp_path, lines, message, command, capsys,
                                                        no_weights):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(lines if isinstance(lines, bytes) else lines.encode())
    assert message in user_error(capsys, [command, "--heads", str(medusa_dir), "--prompts", str(prompts)])


def test_a_prompts_file_is_read_as_jsonl_is_written(tmp_path):
    """Lines end at \\n only (JSON text may hold U+2028, which splitlines() breaks at), a byte-order mark and CRLF
    line ends are taken as editors write them."""
    from selfspec.infer.bench import load_prompts

    prompts = ["def f():\u2028    return 1", "class A:\u0085pass", "x = 1"]
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(json.dumps({"prompt": p}, ensure_ascii=False)
                                                  for p in prompts).encode() + b"\r\n")
    assert load_prompts(path) == prompts


def test_a_prompt_rendered_with_its_bos_gets_no_second_one():
    """A chat-templated prompt already starts with the BOS text; tokenizing it with the special tokens added
    (as a plain prompt is) would start it with two BOS tokens."""
    from tokenizers.processors import TemplateProcessing

    from conftest import tiny_tokenizer
    from selfspec.infer.bench import encode_prompt

    tok = tiny_tokenizer()
    tok._tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    plain = encode_prompt(tok, "def add(a, b):")[0].tolist()
    rendered = encode_prompt(tok, "<bos>def add(a, b):")[0].tolist()
    assert plain[0] == tok.bos_token_id and plain[1] != tok.bos_token_id
    assert rendered == plain


def test_the_console_script_names_itself_selfspec(monkeypatch, capsys):
    from selfspec.infer.cli import main as console

    monkeypatch.setattr(sys, "argv", ["selfspec", "generate", "--heads", "/no/such/heads", "--prompt", "x"])
    with pytest.raises(SystemExit) as exit_info:
        console()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("selfspec: error: ")
    monkeypatch.setattr(sys, "argv", ["selfspec", "no-such-command"])
    with pytest.raises(SystemExit):
        console()
    assert capsys.readouterr().err.startswith("selfspec: error: argument command: invalid choice: 'no-such-command'")
