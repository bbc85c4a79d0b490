"""The end of a feature drafter's run (EAGLE-1/2/3, P-EAGLE, DFlash): its decoding tree fitted to this machine
by decoding validation prompts, stored in its config, and the drafter saved with its validation on the
card."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from selfspec.infer.measure.tune import format_rows, tune_eagle


def fit_dynamic_tree(
    target: Any,
    draft: torch.nn.Module,
    prompts: list[torch.Tensor],
    grid: list[tuple[int, int, int]],
    new_tokens: int,
    title: str,
) -> dict:
    """Greedy decoding of `prompts` with each (depth, top_k, total_tokens) of `grid`; the fastest, printed as
    a table under `title`."""
    param = next(target.parameters())
    draft = copy.deepcopy(draft).to(dtype=param.dtype).eval()  # as decoding runs it
    best, rows = tune_eagle(target, draft, prompts, grid, new_tokens)
    print(f"{title} fitted to this machine (greedy decoding of validation prompts):")
    print(format_rows(rows, best))
    return best


def save_with_tree(
    draft: torch.nn.Module,
    output_dir: Path,
    cfg: Any,
    metrics: dict[str, float],
    summary: str,
    fit: Callable[[], dict] | None,
    fallback: dict | None = None,
) -> None:
    """Store the tree (the recipe's depth/top_k/total_tokens when all are set, else `fit()`'s, else
    `fallback`, else the drafter's own) in its config and save it, the card naming the validation `summary`
    and the tree."""
    if cfg.depth and cfg.top_k and cfg.total_tokens:
        best = {"depth": cfg.depth, "top_k": cfg.top_k, "total_tokens": cfg.total_tokens}
    elif fit is not None:
        best = fit()
    else:
        best = fallback
    if best is not None:
        draft.config.depth, draft.config.top_k, draft.config.total_tokens = (
            best["depth"],
            best["top_k"],
            best["total_tokens"],
        )
    if not metrics:  # the loop always evaluates before saving; never write a card of zeros
        raise ValueError("no validation metrics for the model card: evaluate before saving")
    c = draft.config
    shape = "chain" if c.top_k == 1 else f"tree of top_k {c.top_k}"
    card = (
        f"\n## Validation (last evaluation)\n\n{summary}; decoding: {shape}, depth {c.depth}, total_tokens "
        f"{c.total_tokens}\n"
    )
    draft.save_pretrained(output_dir, card_extra=card)
