"""The command line's options and input files: each mistake is one line, `error: ...`, found before the
model's weights load (`no_weights`); --max-new-tokens past the model's positions is clipped with a note."""

import json
import sys

import pytest
import transformers
from transformers import AutoTokenizer

from cli_checks import greedy_reference, user_error
from selfspec.cli import main as cli


@pytest.fixture
def no_weights(monkeypatch):
    """Loading the target's weights fails the test: what is checked up front must not wait for them."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model's weights were loaded before the check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--depth", "2"],
            "--depth shape EAGLE's and DFlash's dynamic trees, but the heads are medusa heads",
        ),
        (
            ["--draft-top-k", "2", "--total-tokens", "4"],
            "--draft-top-k, --total-tokens shape EAGLE's and DFlash's",
        ),
        (["--depth", "2", "--tree", "[[0]]"], "give one or the other"),
        (
            ["--top-k", "2"],
            "--top-k is sampling's top-k in selfspec generate; bench decodes greedily, and the tree's "
            "width is --draft-top-k",
        ),
    ],
)
def test_eagle_options_with_medusa_heads_are_a_clear_error(medusa_dir, extra, message, capsys, no_weights):
    assert message in user_error(capsys, ["bench", "--heads", str(medusa_dir), "--num-prompts", "1", *extra])


GEN = ["generate", "--prompt-lookup", "--prompt", "x"]
BENCH = ["bench", "--prompt-lookup"]
TEMPERATURE_RULE = "temperature must be 0 (greedy) or a finite number >= 1e-06"


@pytest.mark.parametrize(
    "argv, option, value, rule",
    [
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
        (BENCH + ["--draft-top-k", "0"], "--draft-top-k", "got 0", "an integer >= 1"),
        (["tune", "--heads", "x", "--num-prompts", "0"], "--num-prompts", "got 0", "an integer >= 1"),
        (GEN + ["--device", "meta"], "--device", "meta", "a model cannot run on a meta device"),
        (GEN + ["--device", "xpu"], "--device", "xpu", "no XPU device is available here; use --device cpu"),
    ],
)
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
    cli(
        [
            "generate",
            "--model",
            str(short_model_dir),
            "--prompt-lookup",
            "--prompt",
            prompt,
            "--max-new-tokens",
            "100",
            "--quiet",
            "--json",
            str(out),
        ]
    )
    assert f"note: --max-new-tokens 100 clipped to {48 - length}" in capsys.readouterr().err
    record = json.loads(out.read_text())
    assert record["token_ids"] == greedy_reference(short_model_dir, prompt, 48 - length)


def test_generate_refuses_a_prompt_that_fills_the_positions_before_loading(
    short_model_dir, capsys, no_weights
):
    prompt = "def add(a, b):\n    return a + b\n" * 4
    length = AutoTokenizer.from_pretrained(short_model_dir)(prompt, return_tensors="pt").input_ids.shape[1]
    assert length >= 48
    line = user_error(
        capsys, ["generate", "--model", str(short_model_dir), "--prompt-lookup", "--prompt", prompt]
    )
    assert f"--prompt: the prompt is {length} tokens but the model takes at most 48 positions" in line


def test_bench_refuses_prompts_that_do_not_fit_before_loading(short_model_dir, tmp_path, capsys, no_weights):
    long = "def add(a, b):\n    return a + b"
    length = AutoTokenizer.from_pretrained(short_model_dir)(long, return_tensors="pt").input_ids.shape[1]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n" + json.dumps({"prompt": long}) + "\n")
    n = 48 - length + 1  # the short prompt fits, the long one is one token over
    line = user_error(
        capsys,
        [
            "bench",
            "--model",
            str(short_model_dir),
            "--prompt-lookup",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            str(n),
        ],
    )
    assert (
        f"1 of 2 prompts (the longest {length} tokens) + --max-new-tokens {n} "
        f"exceed the model's 48 positions: "
        f"lower --max-new-tokens to {n - 1} or use shorter prompts"
    ) in line


def test_bench_plot_without_matplotlib_fails_before_the_benchmark(
    tiny_model_dir, tmp_path, capsys, monkeypatch, no_weights
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails as if not installed
    line = user_error(
        capsys,
        [
            "bench",
            "--model",
            str(tiny_model_dir),
            "--prompt-lookup",
            "--num-prompts",
            "1",
            "--plot",
            str(tmp_path / "bench.png"),
        ],
    )
    assert "--plot needs matplotlib" in line and "pip install matplotlib" in line


def test_bench_plot_into_an_unknown_file_type_fails_before_the_benchmark(
    tiny_model_dir, tmp_path, capsys, no_weights
):
    line = user_error(
        capsys,
        [
            "bench",
            "--model",
            str(tiny_model_dir),
            "--prompt-lookup",
            "--num-prompts",
            "1",
            "--plot",
            str(tmp_path / "bench.xyz"),
        ],
    )
    assert f"--plot {tmp_path / 'bench.xyz'}: name a file ending in one of" in line and ".png" in line


def test_json_into_a_missing_folder_is_made_before_loading(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "new" / "deeper" / "gen.json"
    load = transformers.AutoModelForCausalLM.from_pretrained

    def load_after_the_folder(*args, **kwargs):
        assert out.parent.is_dir()
        return load(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_after_the_folder)
    cli(
        [
            "generate",
            "--model",
            str(tiny_model_dir),
            "--prompt-lookup",
            "--prompt",
            "def add(a, b):",
            "--max-new-tokens",
            "5",
            "--quiet",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["token_ids"] == greedy_reference(tiny_model_dir, "def add(a, b):", 5)


def test_json_onto_a_folder_or_under_a_file_is_an_error_before_loading(
    tiny_model_dir, tmp_path, capsys, no_weights
):
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt-lookup", "--prompt", "x", "--json"]
    assert f"--json {tmp_path} is a folder" in user_error(capsys, [*argv, str(tmp_path)])
    (tmp_path / "file").write_text("")
    line = user_error(capsys, [*argv, str(tmp_path / "file" / "gen.json")])
    assert f"--json {tmp_path / 'file' / 'gen.json'}: cannot create its folder" in line


@pytest.mark.parametrize("command", [["generate", "--prompt", "def"], ["bench"]])
def test_lookup_first_without_heads_is_a_clear_error(command, capsys, no_weights):
    err = user_error(capsys, [*command, "--prompt-lookup", "--lookup-first"])
    assert "--lookup-first puts prompt lookup in front of heads: give --heads DIR" in err


@pytest.mark.parametrize("command", [["generate", "--prompt", "def"], ["bench"]])
@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--num-draft-tokens", "9"],
            "--num-draft-tokens is the draft model's proposal length: give --draft-model",
        ),
        (
            ["--prompt-lookup-tokens", "9"],
            "--prompt-lookup-tokens applies to prompt lookup: add --prompt-lookup",
        ),
    ],
)
def test_a_drafters_option_without_that_drafter_is_refused(
    command, extra, message, medusa_dir, capsys, no_weights
):
    assert message in user_error(
        capsys, [*command, "--heads", str(medusa_dir), *extra]
    )  # else silently unused


def test_top_k_or_top_p_on_a_greedy_run_is_refused(medusa_dir, capsys):
    err = user_error(capsys, ["generate", "--heads", str(medusa_dir), "--prompt", "def", "--top-p", "0.5"])
    assert "--top-p only apply when sampling, but this run is greedy (no --temperature" in err
    err = user_error(
        capsys,
        ["generate", "--heads", str(medusa_dir), "--prompt", "def", "--temperature", "0", "--top-k", "5"],
    )
    assert (
        "--top-k only apply when sampling, but this run is greedy (--temperature 0): add --temperature T"
        in err
    )


@pytest.mark.parametrize(
    "lines, message",
    [
        ('{"prompt": "def f():"}\n{"prompt": "x"\n', "prompts.jsonl:2 is not JSON"),
        (
            '{"prompt": "def f():"}\n\n"def g():"\n',
            'prompts.jsonl:3 has no "prompt" string or "messages" list',
        ),
        ('{"prompt": 3}\n', 'prompts.jsonl:1 has no "prompt" string or "messages" list'),
        ('{"text": "def f():"}\n', 'prompts.jsonl:1 has no "prompt" string or "messages" list'),
        ("\n\n", "holds no prompts"),
        (b'\xff\xfe{"prompt"', "cannot read it (not UTF-8 text)"),
        ('{"prompt": " \\n "}\n', "prompts.jsonl:1 has an empty prompt"),
    ],
)
@pytest.mark.parametrize("command", ["bench", "tune"])
def test_a_bad_prompts_file_is_one_line_naming_the_line(
    medusa_dir, tmp_path, lines, message, command, capsys, no_weights
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(lines if isinstance(lines, bytes) else lines.encode())
    assert message in user_error(capsys, [command, "--heads", str(medusa_dir), "--prompts", str(prompts)])


def test_a_prompts_file_is_read_as_jsonl_is_written(tmp_path):
    """Lines end at \\n only (JSON text may hold U+2028, which splitlines() breaks at), a byte-order mark and
    CRLF line ends are taken as editors write them."""
    from selfspec.infer.measure.bench import load_prompts

    prompts = ["def f():\u2028    return 1", "class A:\u0085pass", "x = 1"]
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf"
        + "\r\n".join(json.dumps({"prompt": p}, ensure_ascii=False) for p in prompts).encode()
        + b"\r\n"
    )
    assert load_prompts(path) == prompts


def test_a_dflash_tree_is_set_from_the_command_line(tiny_model_dir, tmp_path):
    """--depth / --draft-top-k / --total-tokens shape a DFlash drafter's tree (they said "use --tree", which
    DFlash refuses); the tree the run used is the one asked for, and the output is still the target's
    greedy."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_drafts import random_draft

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    draft = random_draft(model)
    draft.config.base_model = str(tiny_model_dir)
    draft.save_pretrained(tmp_path / "dflash")
    out = tmp_path / "gen.json"
    cli(
        [
            "generate",
            "--heads",
            str(tmp_path / "dflash"),
            "--prompt",
            "def add(a, b):",
            "--max-new-tokens",
            "12",
            "--depth",
            "2",
            "--draft-top-k",
            "2",
            "--total-tokens",
            "3",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    record = json.loads(out.read_text())
    assert record["token_ids"] == greedy_reference(tiny_model_dir, "def add(a, b):", 12)
    assert max(record["stats"]["accept_lengths"]) <= 3  # at most depth 2 drafted + the bonus token
    # total_tokens nodes verified a step, not the drafter's default chain of block - 1 = 5
    assert (draft.config.total_tokens, torch.tensor(record["stats"]["drafted"]).max().item()) == (5, 3)
