"""Resumable checkpoints that never lose work: atomic writes, checksums, one run per output folder.

A checkpoint is accelerate's `save_state` folder plus `trainer_state.json` (step, epoch, data position,
last metrics, the run's id and fingerprint) and `manifest.json` (size and sha256 of every file). It is
written under a dot-name and renamed when complete, so a crash never leaves a loadable half. Rotation
deletes only this run's older checkpoints. Resuming verifies the checksums (a damaged newest checkpoint
falls back to the previous intact one, with a warning naming the file) and refuses a run whose batch
size, data or model differ from the checkpoint's unless asked to.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from selfspec.heads.config import read_json_object
from selfspec.heads.errors import disk_full_instead
from selfspec.heads.io import file_mode, saved_model_files, sha256_of

STATE_NAME = "trainer_state.json"
MANIFEST_NAME = "manifest.json"


def check_writable(output_dir: Path) -> None:
    """Fail before any work when the output folder cannot be created or written to."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=output_dir, prefix=".write-test-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(
            f"--output_dir {output_dir} cannot be written ({e.strerror or e}): choose a folder you "
            "can write to"
        ) from None


def checkpoints(output_dir: Path, run_id: str | None = None) -> list[Path]:
    """Complete checkpoints (of run `run_id`, when given), oldest first. A half-written one is still a
    dot-folder and never listed."""
    found = [p for p in (output_dir / "checkpoints").glob("step-*") if (p / STATE_NAME).is_file()]
    if run_id is not None:
        found = [p for p in found if read_state(p).get("run_id") == run_id]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def read_state(checkpoint: Path) -> dict[str, Any]:
    return read_json_object(checkpoint / STATE_NAME)


def prepare_output_dir(
    accelerator: Accelerator, output_dir: Path, resume: str | None, overwrite: bool, model: str | None = None
) -> None:
    """Check the folder is writable, is not the target's own, holds no model or drafter a new run would
    overwrite, and no other run's checkpoints (they would be mixed up with this run's on resume): refuse,
    unless `--resume` continues them or `--overwrite_output_dir` deletes them."""
    if accelerator.is_main_process:
        check_writable(output_dir)
        if resume:
            check_resumable(resume, output_dir)
        target = Path(model).resolve() if model is not None and Path(model).is_dir() else None
        if target is not None and (target == output_dir.resolve() or output_dir.resolve() in target.parents):
            raise ValueError(
                f"--output_dir {output_dir} holds the target model ({model}): saving there could "
                "overwrite it; choose another --output_dir"
            )
        saved = saved_model_files(output_dir)
        if saved and not resume and not checkpoints(output_dir) and not overwrite:
            raise ValueError(
                f"{output_dir} already holds a saved model's or drafter's files ({', '.join(saved[:3])}): "
                "choose another --output_dir, or replace them with --overwrite_output_dir true"
            )
        found = checkpoints(output_dir)
        if found and not resume:
            if not overwrite:
                raise ValueError(
                    f"{output_dir} already holds checkpoints of an earlier run "
                    f"({', '.join(p.name for p in found)}): continue it with --resume latest, delete them "
                    "with --overwrite_output_dir true, or choose another --output_dir"
                )
            print(
                f"--overwrite_output_dir: deleting {len(found)} earlier checkpoint(s) in "
                f"{output_dir}/checkpoints",
                file=sys.stderr,
            )
            shutil.rmtree(output_dir / "checkpoints")
    accelerator.wait_for_everyone()


def _manifest(folder: Path) -> dict[str, dict[str, Any]]:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    return {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in files
    }


def damage(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint's files (None when every file matches its manifest). Checkpoints
    written before manifests existed are taken as they are."""
    manifest_path = checkpoint / MANIFEST_NAME
    try:
        read_state(checkpoint)
    except ValueError as e:
        return str(e)
    if not manifest_path.is_file():
        return None
    try:
        manifest = read_json_object(manifest_path)
    except ValueError as e:
        return str(e)
    for name, want in manifest.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != want["bytes"] or sha256_of(path) != want["sha256"]:
            return f"{path} is damaged (its checksum differs from the one written with it)"
    return None


def save_checkpoint(accelerator: Accelerator, output_dir: Path, state: dict[str, Any], keep: int) -> Path:
    """save_state into a temporary folder, add the trainer state and checksums, then rename; then delete
    this run's checkpoints beyond the newest `keep`."""
    root = output_dir / "checkpoints"
    final = root / f"step-{state['step']}"
    tmp = root / f".tmp-step-{state['step']}"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    try:
        # DeepSpeed would also write every frozen tensor the trained module holds (Medusa-2's whole target)
        accelerator.save_state(
            str(tmp),
            **({"exclude_frozen_parameters": True} if accelerator.state.deepspeed_plugin is not None else {}),
        )
        accelerator.wait_for_everyone()  # DeepSpeed: every rank writes its own shard; seal only after all did
        if accelerator.is_main_process:
            (tmp / STATE_NAME).write_text(json.dumps(state, indent=2))
            for path in tmp.rglob(
                "*"
            ):  # some writers create files 0600; make them readable as the umask says
                path.chmod(file_mode(directory=path.is_dir()))
            (tmp / MANIFEST_NAME).write_text(json.dumps(_manifest(tmp), indent=2))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in checkpoints(output_dir, state["run_id"])[:-keep] if keep > 0 else []:
                shutil.rmtree(old)
    except (OSError, RuntimeError) as e:  # torch.save on a full disk raises RuntimeError('basic_ios::clear')
        better = disk_full_instead(e, tmp / "x")
        if better is e:
            raise
        raise better from e
    accelerator.wait_for_everyone()
    return final


def check_resumable(resume: str, output_dir: Path) -> None:
    """That `--resume` names a checkpoint that is there: checked when the run starts, before any data is
    prepared (self-distillation can take an hour), not when the loop begins."""
    if resume in ("latest", "true", "auto"):
        if not checkpoints(output_dir):
            raise FileNotFoundError(
                f"--resume latest: no checkpoint under {output_dir}/checkpoints (start without "
                "--resume, or give the --output_dir of the run to continue)"
            )
    elif not (Path(resume) / STATE_NAME).is_file():
        raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint (no {STATE_NAME})")


def find_resume(resume: str | None, output_dir: Path) -> Path | None:
    """The checkpoint to resume from: `latest` is the newest intact one in output_dir (a damaged newer one is
    skipped with a warning naming the damaged file); a named folder must be intact."""
    if not resume:
        return None
    check_resumable(resume, output_dir)
    if resume in ("latest", "true", "auto"):
        found = checkpoints(output_dir)
        for candidate in reversed(found):
            problem = damage(candidate)
            if problem is None:
                return candidate
            print(
                f"warning: skipping checkpoint {candidate.name}: {problem}; trying the previous one",
                file=sys.stderr,
            )
        raise ValueError(f"--resume latest: every checkpoint under {output_dir}/checkpoints is damaged")
    path = Path(resume)
    problem = damage(path)
    if problem is not None:
        raise ValueError(f"--resume {path}: {problem}; resume from an earlier checkpoint")
    return path


def check_same_run(checkpoint: Path, saved: dict[str, Any], now: dict[str, Any], allow: bool) -> None:
    """Refuse to resume when a setting that decides what the run computes changed (batch size, data, model):
    the result would no longer be the uninterrupted run. `allow` (--resume_allow_changes) only warns."""
    changed = {
        key: f"{key} was {saved.get(key)!r}, now {value!r}"
        for key, value in now.items()
        if key in saved and saved[key] != value
    }
    if not changed:
        return
    named = [text for key, text in changed.items() if not key.endswith("_sha1")]
    what = "; ".join(named or list(changed.values()))  # a digest is named only when no setting explains it
    if any(
        key.startswith("drafter_") for key in changed
    ):  # the saved tensors cannot be loaded into other shapes
        raise ValueError(
            f"--resume {checkpoint}: {what}, which changes the drafter's tensors, so its checkpoint "
            "cannot be loaded: resume with the run's own settings, or start a new run"
        )
    if allow:
        print(f"warning: resuming {checkpoint} although {what} (--resume_allow_changes)", file=sys.stderr)
        return
    raise ValueError(
        f"--resume {checkpoint}: {what}. Resume with the run's own settings, or pass "
        "--resume_allow_changes true to continue anyway (no longer equal to an uninterrupted run)"
    )


def check_rng_files(checkpoint: Path, process_index: int) -> None:
    """accelerate swallows an RNG state it cannot load and continues with another stream; read it first so a
    damaged file is an error naming it instead."""
    from accelerate.utils import load

    path = checkpoint / f"random_states_{process_index}.pkl"
    if not path.is_file():
        raise ValueError(
            f"--resume {checkpoint}: {path.name} is missing (the random state of process "
            f"{process_index}); resume with as many processes as the run had"
        )
    try:
        states = load(path)  # as accelerate reads it: weights_only=True with numpy's RNG types allowed
    except Exception as e:  # unpickling raises many types; all mean the file is unusable
        raise ValueError(
            f"--resume {checkpoint}: cannot read the random state {path} ({type(e).__name__}: {e})"
        ) from None
    missing = [k for k in ("random_state", "numpy_random_seed", "torch_manual_seed") if k not in states]
    if missing:
        raise ValueError(f"--resume {checkpoint}: the random state {path} lacks {', '.join(missing)}")
