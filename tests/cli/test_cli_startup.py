"""`selfspec --help`, each command's --help and --version answer without importing torch or transformers: they
took 1.7 s (the import of torch) before printing a line."""

import subprocess
import sys

import pytest

from selfspec.cli import COMMANDS

PROBE = """
import sys
from selfspec.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert e.code == 0, e.code
heavy = sorted(m for m in ("torch", "transformers", "datasets", "safetensors") if m in sys.modules)
assert not heavy, f"imported {heavy}"
"""


@pytest.mark.parametrize("argv", [["--help"], ["--version"]] + [[name, "--help"] for name in COMMANDS])
def test_help_and_version_import_no_torch(argv):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip(), "nothing printed"


def test_the_device_default_is_resolved_when_parsed():
    """--device's default names no device until the options are parsed: cuda where there is one, else cpu."""
    import torch

    from selfspec.infer.cli.options import build_parser

    parse = build_parser(COMMANDS).parse_args
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert parse(["generate", "--prompt", "x"]).device == expected
    assert parse(["tune"]).device == expected
    assert parse(["generate", "--prompt", "x", "--device", "cpu"]).device == "cpu"
