"""Drafter files: `config.json` + `model.safetensors` (drafter weights only) + a model card.

The file helpers every checkpoint reader and writer uses, and `PretrainedHeads`, the base class of
every drafter (save_pretrained / from_pretrained / push_to_hub).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from selfspec.heads.config import HeadsConfig
from selfspec.heads.errors import disk_full_instead
from selfspec.heads.hub import WEIGHTS_NAME, model_card, push_to_hub, resolve_heads
from selfspec.heads.joined import drop_joined

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # a model's or drafter's weight files


def saved_model_files(directory: Path) -> list[str]:
    """The files in `directory` that a saved model or drafter consists of (config.json, weights, its card):
    writing another one there would overwrite them, or leave a mix that loads as neither."""
    return sorted(
        p.name
        for p in directory.glob("*")
        if p.name in ("config.json", "README.md") or p.suffix in WEIGHT_SUFFIXES
    )


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Named tensors from a .safetensors file, or from a pickle read only with
    torch.load(weights_only=True)."""
    if path.name.endswith(".safetensors"):
        try:
            state = load_file(str(path), device="cpu")
        except Exception as e:  # corrupt or truncated: one clear error, whatever the library raised
            raise ValueError(
                f"cannot read the weights in {path}: not a readable safetensors file ({e}); re-download it"
            ) from None
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # weights_only raises UnpicklingError and others for anything but tensors
            raise ValueError(
                f"cannot read the weights in {path} with torch.load(weights_only=True): "
                f"{type(e).__name__}: {e}. It must be a plain state_dict of tensors; unpickling arbitrary "
                "objects is refused. Convert it once, where you trust the file, to safetensors "
                "(safetensors.torch.save_file)"
            ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()
    ):
        raise ValueError(
            f"{path} is not a state dict (a dict of name -> tensor); found {type(state).__name__}"
        )
    return dict(state)


def file_mode(directory: bool = False) -> int:
    """The mode a plainly created file (or folder) gets here: 0644 (0755) under the usual umask. For what
    mkstemp and some libraries create 0600."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def sha256_of(path: Path) -> str:
    """A file's sha256, read a MiB at a time (checkpoints, shards and model weights are checked by it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def atomic_write(path: Path, write: Any) -> None:
    """Call `write(tmp_path)` then rename onto `path`, so a crash never leaves a half-written file.
    The file is readable like any other the user creates; a full disk is reported as such."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except Exception as e:
        better = disk_full_instead(e, path)
        if better is e:
            raise
        raise better from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class PretrainedHeads(nn.Module):
    """`save_pretrained` / `from_pretrained` for a drafter holding a `HeadsConfig` as `self.config`."""

    config: HeadsConfig
    kind: ClassVar[str]  # the family whose configs it builds (heads/families)
    source_dir: Path | None = (
        None  # the directory it was loaded from (a Medusa-2 checkpoint's adapter lives there)
    )

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        """A move or cast drops the parameters' joined tensors (heads/joined.py) with the old storage, else
        `.cpu()` or `.half()` would keep them alive until the next draft."""
        drop_joined(self)
        return super()._apply(fn, recurse)

    def check_kind(self, config: HeadsConfig) -> None:
        """Refuse a config of another family (a drafter class built from the wrong config.json)."""
        if config.kind != self.kind:
            raise ValueError(
                f"{type(self).__name__} needs a config of kind {self.kind!r}, got {config.kind!r}"
            )

    def save_pretrained(self, directory: str | Path, card_extra: str = "") -> None:
        """config.json, model.safetensors and a card; a Medusa-2 checkpoint's adapted-target folder comes
        along."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        sub = self.config.adapter or self.config.merged_target
        if (
            sub
            and self.source_dir is not None
            and (self.source_dir / sub).is_dir()
            and out.resolve() != self.source_dir.resolve()
        ):
            shutil.copytree(self.source_dir / sub, out / sub, dirs_exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        atomic_write(out / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        atomic_write(out / "config.json", lambda tmp: Path(tmp).write_text(self.config.to_json()))
        atomic_write(out / "README.md", lambda tmp: Path(tmp).write_text(model_card(self.config, card_extra)))

    def push_to_hub(self, repo_id: str, private: bool | None = None, token: str | None = None) -> str:
        """Save to a temporary folder and upload it with a model card; returns the repo URL."""
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp)
            return push_to_hub(tmp, repo_id, private=private, token=token)

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu") -> PretrainedHeads:
        """Load from a heads directory or a Hub repo id (downloaded, or read from the HF cache offline)."""
        directory = resolve_heads(directory)
        config = HeadsConfig.load(directory)
        weights = directory / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"{directory} has config.json but no {WEIGHTS_NAME}")
        model = cls(config)
        state = read_state_dict(weights)
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(
                f"{weights} does not match its config.json ({config.kind}): missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        model.load_state_dict(state, strict=True)
        if hasattr(model, "check_draft_vocab"):  # EAGLE drafters with a draft vocabulary: d2t one-to-one
            model.check_draft_vocab(weights)
        model.source_dir = directory
        return model.to(device=device, dtype=getattr(torch, config.dtype))
