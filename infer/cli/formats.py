"""`selfspec import | export | push`: a heads directory converted from and to the published layouts, and
uploaded to the Hub; an existing checkpoint is never written over."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from selfspec.heads.io import saved_model_files


def refuse_to_overwrite(out: str) -> None:
    """A checkpoint already in `out` (trained heads, an earlier export) is never written over: a mix of two
    checkpoints' files would load as neither. A path that cannot become a folder fails here, before any
    work."""
    blocked = next((p for p in (Path(out), *Path(out).parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ValueError(f"--out {out}: {blocked} is a file, not a folder: give a folder path")
    held = saved_model_files(Path(out))
    if held:
        raise ValueError(
            f"--out {out} already holds a checkpoint ({', '.join(held)}): write to a new folder, or "
            "delete it first"
        )


def cmd_import(args: argparse.Namespace) -> None:
    from selfspec.heads.formats import import_heads

    refuse_to_overwrite(args.out)
    heads = import_heads(args.src, args.format, base_model=args.base_model, vocab_size=args.vocab_size)
    heads.save_pretrained(args.out)
    print(f"imported {heads.config.kind} heads from {args.src} into {args.out}")


def cmd_export(args: argparse.Namespace) -> None:

    from selfspec.heads.config import check_compatible
    from selfspec.heads.formats import export_heads
    from selfspec.heads.registry import load_heads
    from selfspec.heads.target import load_target

    refuse_to_overwrite(args.out)
    heads = load_heads(args.heads, base_model=args.model or args.base_model)
    target = None
    name = args.model or args.base_model or heads.config.base_model
    adapted = heads.config.adapter or heads.config.merged_target
    if adapted:
        print(
            f"note: {args.heads} are Medusa-2 heads: serve them with their adapted target (train with "
            "--merge true and serve its target/ folder, or merge the adapter into the base with peft), not "
            "the original model",
            file=sys.stderr,
        )
    if (
        name or adapted
    ):  # the target supplies weights some layouts carry (a shared lm_head, the EAGLE embedding);
        try:  # a Medusa-2 checkpoint's adapted target supplies its adapted lm_head
            target = load_target(
                heads,
                args.model or (None if adapted else args.base_model),
                dtype=getattr(torch, heads.config.dtype),
            )
        except (OSError, ValueError) as e:
            raise ValueError(
                f"cannot load the target {name!r} ({' '.join(str(e).split())}): pass --model, a "
                "local model directory or a Hub id (and --base-model for what config.json should "
                "name)"
            ) from None
        check_compatible(heads.config, target)
    export_heads(heads, args.format, args.out, target, base_model=args.base_model, weights=args.weights)
    print(f"exported {args.heads} as {args.format} into {args.out}")


def cmd_push(args: argparse.Namespace) -> None:
    from selfspec.heads.hub import push_to_hub

    url = push_to_hub(args.heads, args.repo_id, private=args.private or None, token=args.token)
    print(f"pushed {args.heads} to {url}")
