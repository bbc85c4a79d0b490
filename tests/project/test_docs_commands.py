"""Every command the README and docs/ give in a bash block, checked as written: `selfspec ...` parses with the
real command line, `accelerate launch train/X.py ...` names files that exist and options its recipe class
accepts (with the recipe YAML read), `make X` names a Makefile target. What runs elsewhere (pip, vllm serve,
SGLang) is not checked here; tests/formats/test_vllm.py serves the exports."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from selfspec.cli import COMMANDS
from selfspec.infer.cli.options import build_parser
from selfspec.train.loop.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SUBSTITUTE = {"$(selfspec recipes)": "configs", '"$(selfspec recipes)"': "configs"}
NOT_CHECKED = (
    "pip",
    "vllm",
    "git",
    "huggingface-cli",
    "hf",
    "export",
    "cd",
    "ls",
    "cat",
    "wandb",
    "tensorboard",
)


def commands(path: Path) -> list[str]:
    """The command lines of a Markdown file's bash blocks, continuation lines joined, comments kept (shlex
    drops them)."""
    found, block, pending = [], False, ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            block = stripped == "```bash"
            continue
        if not block or not stripped or stripped.startswith("#"):
            continue
        pending += " " + stripped.removesuffix("\\")
        if not stripped.endswith("\\"):
            found.extend(part.strip() for part in pending.split(" && "))
            pending = ""
    return found


def tokens(command: str) -> list[str]:
    for old, new in SUBSTITUTE.items():
        command = command.replace(old, new)
    words = shlex.split(command, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the command
        words.pop(0)
    return words


ALL = [(path.relative_to(ROOT).as_posix(), command) for path in DOCS for command in commands(path)]


def test_the_docs_hold_the_commands_a_user_needs():
    firsts = {tokens(c)[0] for _, c in ALL if tokens(c)}
    assert {"selfspec", "accelerate", "make"} <= firsts, firsts
    assert any("--config" in c and "eagle3" in c for _, c in ALL)  # the 8-GPU EAGLE-3 recipe


def recipe_class(script: str):
    """The config class a training script reads its options into (the one it passes to load_config)."""
    source = (ROOT / "train" / f"{script}.py").read_text()
    name = re.search(r"load_config\((\w+)", source)
    assert name, f"train/{script}.py calls no load_config"
    module = importlib.import_module(f"selfspec.train.{script}")
    return getattr(module, name.group(1))


def check_training(words: list[str]) -> None:
    i = 2 if words[:2] == ["accelerate", "launch"] else 1
    while i < len(words) and words[i].startswith("--") and not words[i].endswith(".py"):
        option = words[i].split("=")[0]
        value = words[i].split("=", 1)[1] if "=" in words[i] else words[i + 1]
        if option == "--config_file":
            assert (ROOT / value).is_file(), f"--config_file {value} does not exist"
        i += 1 if "=" in words[i] else 2
    if words[i] == "-m":
        script, i = words[i + 1].removeprefix("selfspec.train."), i + 2
    else:
        assert words[i].startswith("train/") and (ROOT / words[i]).is_file(), f"no script {words[i]}"
        script, i = Path(words[i]).stem, i + 1
    load_config(recipe_class(script), words[i:])  # a wrong key, a missing recipe or a bad value raises


def check_makefile(target: str) -> None:
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    assert target in targets, f"make {target}: no such target"


@pytest.mark.parametrize(("where", "command"), ALL, ids=[f"{w}:{c[:50]}" for w, c in ALL])
def test_each_documented_command_is_accepted_as_written(where, command):
    words = tokens(command)
    if not words or words[0] in NOT_CHECKED or words[:3] == ["python", "-m", "sglang.launch_server"]:
        return
    if words[0] == "selfspec" or words[:3] == ["python", "-m", "selfspec"]:
        argv = words[1:] if words[0] == "selfspec" else words[3:]
        if argv[:1] == ["recipes"] or argv in ([], ["--help"]):
            return
        build_parser(COMMANDS).parse_args(argv)  # exits 2 with the parser's message on a wrong option
    elif words[0] == "accelerate" or (words[0] == "python" and words[1].startswith("train/")):
        check_training(words)
    elif words[0] == "make":
        check_makefile(words[1])
    elif words[:3] == ["python", "-m", "selfspec.shipped.smollm2"] or words[:2] == ["python", "-m"]:
        importlib.import_module(words[2])
    else:
        pytest.fail(f"{where}: a command this test does not know how to check: {command!r}")
