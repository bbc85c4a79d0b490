"""The installed distribution: one `selfspec` namespace, the recipes and demo models inside it, the README's
Python quickstart running from the wheel outside the checkout."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the source: a build/ left in the checkout by an earlier build would put
    modules that no longer exist into it."""
    source, out = tmp_path_factory.mktemp("source") / "selfspec", tmp_path_factory.mktemp("wheel")
    skip = shutil.ignore_patterns(
        ".git",
        ".venv",
        "build",
        "outputs",
        "runs",
        "wandb",
        "*.egg-info",
        "__pycache__",
        "smollm2-135m-instruct",
        ".pytest_cache",
        ".ruff_cache",
    )
    shutil.copytree(ROOT, source, ignore=skip)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    return next(out.glob("selfspec-*.whl"))


def test_the_wheel_installs_one_namespace_with_the_recipes_and_demo_models(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"selfspec", wheel.name.split("-py")[0] + ".dist-info"}, tops
    for want in [
        "selfspec/__init__.py",
        "selfspec/__main__.py",
        "selfspec/heads/config.py",
        "selfspec/infer/core/generate.py",
        "selfspec/heads/formats/eagle3.py",
        "selfspec/heads/families/eagle3.py",
        "selfspec/shipped/drafters/smollm2-eagle3/model.safetensors",
        "selfspec/train/eagle.py",
        "selfspec/shipped/models.py",
        "selfspec/shipped/chat/smollm2-heldout.jsonl",
        "selfspec/configs/eagle/llama3.1-8b-eagle3.yaml",
        "selfspec/configs/accelerate/deepspeed-zero3.json",
        "selfspec/models/demo-target/model.safetensors",
        "selfspec/models/demo-draft/tokenizer.json",
    ]:
        assert want in names, want
    assert not any(
        n.startswith("selfspec/models/smollm2") for n in names
    )  # built here, 538 MB: never packaged
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "selfspec = selfspec.cli:main" in meta


ISOLATED = """
import os, selfspec
assert selfspec.__file__.startswith(os.environ["SITE"]), selfspec.__file__
for top in ("heads", "infer", "train", "shipped"):
    try:
        __import__(top)
    except ImportError:
        continue
    raise SystemExit(f"a top-level {top} is importable")
"""


def readme_block(marker: str) -> str:
    """The code block after `<!-- marker -->` in the README, unindented."""
    text = (ROOT / "README.md").read_text()
    lines = text[text.index(f"<!-- {marker} -->") :].splitlines()[1:]
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("```"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
    indent = len(lines[start]) - len(lines[start].lstrip())
    return "\n".join(line[indent:] for line in lines[start + 1 : end])


def test_the_installed_wheel_runs_outside_the_checkout(wheel, tmp_path, medusa_dir):
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    env = os.environ | {"PYTHONPATH": str(site), "SITE": str(site)}
    quickstart = readme_block("cpu-quickstart").replace('"outputs/medusa-demo"', repr(str(medusa_dir)))
    assert (
        str(medusa_dir) in quickstart
    )  # the README's drafter, replaced by an untrained one of a tiny target
    run = subprocess.run(
        [sys.executable, "-c", ISOLATED + quickstart], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.strip(), run.stderr[-3000:]
    cli = subprocess.run(
        [
            str(site / "bin" / "selfspec") if (site / "bin" / "selfspec").exists() else sys.executable,
            *([] if (site / "bin" / "selfspec").exists() else ["-m", "selfspec"]),
            "recipes",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0 and cli.stdout.strip() == str(site / "selfspec" / "configs"), cli.stderr
