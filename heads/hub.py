"""The Hugging Face Hub: heads directories by repo id, and pushing them with a model card.

A token is handed to `huggingface_hub` and nowhere else: never printed, logged or written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from selfspec.heads.config import HeadsConfig
from selfspec.heads.families import family
from selfspec.shipped.models import shipped_drafter

WEIGHTS_NAME = "model.safetensors"
HEAD_FILES = ["config.json", WEIGHTS_NAME, "README.md"]
# The weights of a published drafter, fetched with HEAD_FILES so that it loads as it is: FasterDecoding's
# medusa_lm_head.pt / .safetensors, SafeAILab's pytorch_model.bin, shards and their index (not optimizer
# states).
PUBLISHED_FILES = [
    "medusa_lm_head.*",
    "model*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
]
# A Medusa-2 checkpoint's adapted target: the LoRA adapter (peft's files), or the merged model (HeadsConfig
# fields)
TARGET_FOLDERS = ["adapter/*", "target/*"]
RECIPE_NAME = "training_args.json"  # written next to the heads by the training loop
BENCH_NAME = "bench.json"  # `selfspec bench --json DIR/bench.json`


def model_card(config: HeadsConfig, extra: str = "") -> str:
    base = config.base_model or "unknown"
    return f"""---
base_model: {base}
library_name: selfspec
tags: [speculative-decoding, {config.kind}, selfspec]
---
# {config.kind} drafter for {base}

{family(config.kind).describe(config)}, hidden size {config.hidden_size}, vocabulary {config.vocab_size}. \
Decoding with them is lossless: greedy output is token-identical to the
target's own, sampled output has the target's distribution.

```python
from selfspec import SpeculativeModel
model = SpeculativeModel.from_pretrained("path/to/this/folder")
```
{extra}"""


def resolve_heads(
    name_or_path: str | Path, revision: str | None = None, token: str | bool | None = None
) -> Path:
    """A drafter the repository ships, by its short name (`smollm2-eagle3`); a local heads directory as is;
    otherwise a Hub repo id, downloaded (or found in the HF cache) at `revision` with the files either
    selfspec's layout or a published checkpoint's needs."""
    if (shipped := shipped_drafter(str(name_or_path))) is not None and not Path(name_or_path).is_dir():
        if not (shipped / "config.json").is_file():
            raise FileNotFoundError(
                f"the shipped drafter '{name_or_path}' is expected at {shipped}, which is missing: "
                "use a clone of the selfspec repository (or a wheel built from one)"
            )
        return shipped
    path = Path(name_or_path)
    if (
        path.is_dir()
        or path.exists()
        or str(name_or_path).startswith((".", "/"))
        or str(name_or_path).count("/") != 1
    ):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(
            snapshot_download(
                str(name_or_path),
                revision=revision,
                token=token,
                allow_patterns=HEAD_FILES + PUBLISHED_FILES + TARGET_FOLDERS,
            )
        )
    except LocalEntryNotFoundError:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        why = "HF_HUB_OFFLINE=1 forbids downloading" if offline else "the Hub could not be reached"
        raise FileNotFoundError(
            f"{name_or_path} is not a local directory and not in the Hugging Face cache, and {why}: "
            f"download it where the Hub is reachable (hf download {name_or_path}) or pass a local directory"
        ) from None
    except (RepositoryNotFoundError, HfHubHTTPError) as e:
        raise FileNotFoundError(f"{name_or_path}: no such local directory, and the Hub says: {e}") from None


def _bench_table(bench: dict) -> str:
    rows = ["| method | tokens/s | speedup | tau | identical |", "|---|---|---|---|---|"]
    for name, m in bench.get("methods", {}).items():
        rows.append(
            f"| {name} | {m['tokens_per_s']:.1f} | {m['speedup']:.2f}x | {m['tau']:.2f} | "
            f"{'yes' if m['identical_to_baseline'] else 'no'} |"
        )
    setup = (
        f"{bench.get('num_prompts', '?')} prompts x {bench.get('max_new_tokens', '?')} new tokens, greedy, "
        f"{bench.get('dtype', '?')}, {bench.get('threads', '?')} threads, baseline `model.generate`"
    )
    return f"\n## Measured (selfspec bench)\n\n{setup}.\n\n" + "\n".join(rows) + "\n"


def card_for(directory: str | Path) -> str:
    """The model card for a heads directory: metadata linking the base model, the training recipe
    (from training_args.json) and the bench table (from bench.json) when they are there."""
    directory = Path(directory)
    config = HeadsConfig.load(directory)
    extra = ""
    recipe = directory / RECIPE_NAME
    if recipe.is_file():
        args = json.loads(recipe.read_text())
        command = args.pop("command", None)
        lines = "\n".join(f"{k}: {json.dumps(v)}" for k, v in args.items())
        extra += (
            "\n## Training recipe\n\n" + (f"`{command}`\n\n" if command else "") + f"```yaml\n{lines}\n```\n"
        )
    bench = directory / BENCH_NAME
    if bench.is_file():
        extra += _bench_table(json.loads(bench.read_text()))
    return model_card(config, extra)


@contextlib.contextmanager
def hub_reached(api) -> Iterator[None]:
    """Within: a failure to reach the Hub (no network, a proxy, DNS) is one OSError naming the endpoint and
    the fix, not the HTTP client's own traceback (its class varies with huggingface_hub's client: requests,
    httpx)."""
    try:
        yield
    except Exception as e:
        kinds = {c.__name__ for c in type(e).__mro__}
        if not kinds & {"TransportError", "ConnectionError", "Timeout", "TimeoutException"}:
            raise
        raise OSError(
            f"cannot reach the Hub at {api.endpoint} ({type(e).__name__}: {' '.join(str(e).split())}): "
            "check the network or proxy, then push again"
        ) from None


def push_to_hub(
    directory: str | Path,
    repo_id: str,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload speculative-decoding heads with selfspec",
) -> str:
    """Upload config.json, model.safetensors, a fresh model card and (Medusa-2) the adapted target's subfolder
    from `directory`; returns the repo URL."""
    from huggingface_hub import HfApi

    directory = Path(directory)
    for name in ("config.json", WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory} has no {name}: push a directory written by save_pretrained")
    config = HeadsConfig.load(directory)
    names = ["config.json", WEIGHTS_NAME]
    for sub in filter(None, (config.adapter, config.merged_target)):
        if not (directory / sub).is_dir():
            raise FileNotFoundError(
                f"{directory}/config.json names the subfolder {sub!r}, which is missing: push the "
                "whole directory the training run wrote"
            )
        names += sorted(str(f.relative_to(directory)) for f in (directory / sub).rglob("*") if f.is_file())
    api = HfApi(token=token)
    with hub_reached(api):
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    with tempfile.TemporaryDirectory() as staging, hub_reached(api):
        stage = Path(staging)
        for name in names:
            (stage / name).parent.mkdir(parents=True, exist_ok=True)
            try:  # heads of a large-vocabulary model are gigabytes: link rather than copy where possible
                os.link(directory / name, stage / name)
            except OSError:
                shutil.copyfile(directory / name, stage / name)
        (stage / "README.md").write_text(card_for(directory))  # a private temporary folder: no other reader
        api.upload_folder(
            repo_id=repo_id, folder_path=stage, commit_message=commit_message, repo_type="model"
        )
    return str(url)
