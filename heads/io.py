"""Saving and loading drafters: `config.json` + `model.safetensors` (drafter weights only) + a model card."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from heads.config import HeadsConfig

WEIGHTS_NAME = "model.safetensors"


def read_config_json(directory: Path) -> dict[str, Any]:
    """A checkpoint directory's config.json as a dict, or a ValueError saying what is wrong with it."""
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{directory} has no config.json: a Medusa or EAGLE checkpoint needs one")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON ({e}): fix or re-download the file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Named tensors from a .safetensors file, or from a pickle read only with torch.load(weights_only=True)."""
    if path.name.endswith(".safetensors"):
        try:
            state = load_file(str(path), device="cpu")
        except Exception as e:  # corrupt or truncated: one clear error, whatever the library raised
            raise ValueError(f"cannot read the weights in {path}: not a readable safetensors file ({e}); "
                             "re-download it") from None
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # weights_only raises UnpicklingError and others for anything but tensors
            raise ValueError(
                f"cannot read the weights in {path} with torch.load(weights_only=True): {type(e).__name__}: {e}. "
                "It must be a plain state_dict of tensors; unpickling arbitrary objects is refused. Convert it "
                "once, where you trust the file, to safetensors (safetensors.torch.save_file)"
            ) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise ValueError(f"{path} is not a state dict (a dict of name -> tensor); found {type(state).__name__}")
    return dict(state)


def atomic_write(path: Path, write: Any) -> None:
    """Call `write(tmp_path)` then rename onto `path`, so a crash never leaves a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _shape(config: HeadsConfig) -> str:
    if config.kind == "eagle":
        return f"EAGLE draft model: fc (2H -> H) + {config.num_layers} Llama decoder layer(s) on the target's features"
    return f"{config.num_heads} Medusa heads x {config.num_layers} residual block(s)"


def model_card(config: HeadsConfig, extra: str = "") -> str:
    base = config.base_model or "unknown"
    return f"""---
base_model: {base}
library_name: selfspec
tags: [speculative-decoding, {config.kind}, selfspec]
---
# {config.kind} drafter for {base}

{_shape(config)}, hidden size {config.hidden_size}, vocabulary {config.vocab_size}. Decoding with them is lossless: greedy output is token-identical to the
target's own, sampled output has the target's distribution.

```python
from infer.generate import SpeculativeModel
model = SpeculativeModel.from_pretrained("path/to/this/folder")
```
{extra}"""


class PretrainedHeads(nn.Module):
    """`save_pretrained` / `from_pretrained` for a drafter holding a `HeadsConfig` as `self.config`."""

    config: HeadsConfig

    def save_pretrained(self, directory: str | Path, card_extra: str = "") -> None:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        atomic_write(out / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        atomic_write(out / "config.json", lambda tmp: Path(tmp).write_text(self.config.to_json()))
        atomic_write(out / "README.md", lambda tmp: Path(tmp).write_text(model_card(self.config, card_extra)))

    def push_to_hub(self, repo_id: str, private: bool | None = None, token: str | None = None) -> str:
        """Save to a temporary folder and upload it with a model card; returns the repo URL."""
        from heads.hub import push_to_hub

        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp)
            return push_to_hub(tmp, repo_id, private=private, token=token)

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu") -> PretrainedHeads:
        """Load from a heads directory or a Hub repo id (downloaded, or read from the HF cache offline)."""
        from heads.hub import resolve_heads

        directory = resolve_heads(directory)
        config = HeadsConfig.load(directory)
        weights = directory / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"{directory} has config.json but no {WEIGHTS_NAME}")
        model = cls(config)
        state = load_file(str(weights), device=str(device))
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(
                f"{weights} does not match its config.json ({_shape(config)}): missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        model.load_state_dict(state, strict=True)
        return model.to(device=device, dtype=getattr(torch, config.dtype))


SHAPE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _local_config(name: str):
    """The named model's config if it is on this machine (a directory, `demo`, or the HF cache), else None."""
    from transformers import AutoConfig

    from heads.demo import resolve_model

    try:
        return AutoConfig.from_pretrained(resolve_model(name), local_files_only=True)
    except (OSError, ValueError):
        return None


def check_compatible(config: HeadsConfig, target: nn.Module) -> None:
    """Fail with both values named when heads were trained for a target of another shape, or when the base
    model their config names is on this machine and its architecture differs from the target's."""
    named = _local_config(config.base_model) if config.base_model else None
    if named is not None:
        theirs, ours = named.get_text_config(), target.config.get_text_config()
        differ = [f"{f} {getattr(theirs, f, None)} vs {getattr(ours, f, None)}" for f in SHAPE_FIELDS
                  if getattr(theirs, f, None) != getattr(ours, f, None)]
        if differ:
            raise ValueError(
                f"these heads were trained on {config.base_model}, whose architecture differs from the target's "
                f"({'; '.join(differ)}): use them with the model they were trained on"
            )
    hidden = target.config.get_text_config().hidden_size
    vocab = target.get_output_embeddings().weight.shape[0]
    if config.hidden_size != hidden:
        raise ValueError(
            f"heads expect hidden size {config.hidden_size} but the target {config.base_model or ''} has "
            f"hidden size {hidden}: these heads were trained for another model"
        )
    if config.vocab_size != vocab:
        raise ValueError(
            f"heads expect vocabulary size {config.vocab_size} but the target has {vocab} "
            "(lm_head rows): these heads were trained for another model or tokenizer"
        )


def load_heads(directory: str | Path, device: str | torch.device = "cpu") -> PretrainedHeads:
    """Load any selfspec drafter directory, dispatching on `kind` in its config.json."""
    from heads.eagle import EagleDraft  # imported here: the drafters build on this module
    from heads.hub import resolve_heads
    from heads.medusa import MedusaHeads

    directory = resolve_heads(directory)
    classes = {"medusa": MedusaHeads, "eagle": EagleDraft}
    return classes[HeadsConfig.load(directory).kind].from_pretrained(directory, device)
