"""The models this repository ships (models/demo-target, models/demo-draft) and their short names."""

from __future__ import annotations

import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
SHORT_NAMES = {
    "demo": "demo-target",
    "demo-target": "demo-target",
    "demo-draft": "demo-draft",
    "smollm2": "smollm2-135m-instruct",
}
BUILT = {"smollm2-135m-instruct": "make real-model"}  # folders built on this machine, not shipped
WEIGHTS_CHECKSUM = "weights.sha256"  # a model folder built here records its checked weights' sha256 in it
# drafters tracked in the repository, ready for their target (short name -> folder under shipped/drafters)
SHIPPED_DRAFTERS = {"smollm2-eagle3": "smollm2-eagle3"}
DRAFTERS_DIR = REPO_ROOT / "shipped" / "drafters"
HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # the same model on the Hub


def hub_id(path: str | Path) -> str | None:
    """The Hub id of a model folder built here from a published model (`smollm2`), else None: what a
    checkpoint written here should name as its target so that it loads on another machine."""
    path = Path(path).resolve()
    return HUB_IDS.get(path.name) if path.parent == MODELS_DIR.resolve() else None


def shipped_drafter(name: str) -> Path | None:
    """The folder of a drafter the repository ships under a short name (`smollm2-eagle3`), else None."""
    return DRAFTERS_DIR / SHIPPED_DRAFTERS[name] if name in SHIPPED_DRAFTERS else None


def resolve_model(name_or_path: str) -> str:
    """Map the short names `demo` / `demo-draft` / `smollm2` to their model folders; pass anything else
    through."""
    if name_or_path in SHORT_NAMES:
        path = MODELS_DIR / SHORT_NAMES[name_or_path]
        if not (path / "config.json").is_file() and path.name in BUILT:
            raise FileNotFoundError(
                f"the model '{name_or_path}' is built on this machine into {path}, which is "
                f"missing: run `{BUILT[path.name]}` in the selfspec checkout first"
            )
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"the shipped model '{name_or_path}' is expected at {path}, but it is missing. "
                "Run from a clone of the selfspec repository installed with `pip install -e .`, "
                "or retrain it with `python train/target.py`."
            )
        return str(path)
    check_model_folder(name_or_path)
    return str(Path(name_or_path).expanduser()) if name_or_path.startswith("~") else name_or_path


def check_model_folder(name_or_path: str) -> None:
    """A local path (or an existing folder) must hold a Hugging Face model; anything else is a hub name."""
    path = Path(name_or_path).expanduser()
    local = name_or_path.startswith(("/", "./", "../", "~")) or path.is_dir()
    if not local:
        return
    if not path.is_dir():
        raise FileNotFoundError(
            f"the model folder {name_or_path} does not exist: give a model's folder or hub name"
        )
    config = path / "config.json"
    if not config.is_file():
        return  # e.g. a tokenizer's folder; transformers names what it lacks
    try:
        data = json.loads(config.read_text())
        kind, base = data.get("kind"), data.get("base_model")
    except (json.JSONDecodeError, AttributeError):
        return  # transformers reports a damaged config itself
    if kind is not None:
        raise ValueError(
            f"{name_or_path} holds a drafter ({kind}), not a target model: give the target it was "
            f"trained on ({base or 'see its base_model'}) as the model, and the drafter as --heads"
        )
