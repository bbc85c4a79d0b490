"""Virtual environments for the peers our exports are checked against (vLLM, speculators), each with its own
pins, built on first use under ~/.cache/selfspec and reused after (a `.installed` marker says it is
complete)."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

# pulled in by the peers' requirements; builds of them for another torch cannot load next to a CPU torch 2.13
VISION_AUDIO = ["torchvision", "torchaudio", "torchcodec"]


def peer_python(requirement: str, env_var: str, torch_pin: str | None = None) -> Path:
    """The python of a venv holding `requirement` (override its place with $`env_var`); `torch_pin` keeps pip
    from replacing the CPU torch with another build."""
    name = requirement.replace("==", "-")
    venv = Path(os.environ.get(env_var, Path.home() / ".cache/selfspec" / name))
    python = venv / "bin/python"
    if not (venv / ".installed").is_file():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
            constraints.write(f"{torch_pin}\n" if torch_pin else "")
            constraints.flush()
            subprocess.run(
                [str(python), "-m", "pip", "install", "-q", "-c", constraints.name, requirement], check=True
            )
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *VISION_AUDIO], check=True)
        (venv / ".installed").touch()
    return python


def checkout_as_package(folder: Path) -> Path:
    """A folder for PYTHONPATH in which this checkout is laid out as the wheel installs it (selfspec/heads,
    selfspec/infer, ...), made of links: a peer's python imports this checkout's code without installing
    it."""
    root = Path(__file__).resolve().parents[2]
    package = folder / "selfspec"
    package.mkdir(parents=True, exist_ok=True)
    for entry in (root / "selfspec").iterdir():
        (package / entry.name).symlink_to(entry)
    for sub in ("heads", "infer", "train", "shipped", "configs", "models"):
        (package / sub).symlink_to(root / sub)
    return folder
