"""Fit an EAGLE drafter's dynamic tree (depth, top_k, total_tokens) to this machine by measuring it.

A bigger tree accepts more tokens per step but costs more draft calls and a wider target forward;
where the balance lies depends on the hardware. Each setting decodes the same calibration prompts
(greedy); its score is decoded tokens per second of decode time (prefill excluded).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

import torch

from heads.eagle import EagleDraft
from infer.eagle import EagleProposer
from infer.generate import SpeculativeModel


def eagle_grid(depths: Sequence[int] = (3, 4, 5, 6, 8), top_ks: Sequence[int] = (2, 4, 8),
               totals: Sequence[int] = (16, 32)) -> list[tuple[int, int, int]]:
    """Every (depth, top_k, total_tokens) combination."""
    return list(itertools.product(depths, top_ks, totals))


@torch.no_grad()
def tune_eagle(
    model: torch.nn.Module,
    draft: EagleDraft,
    prompts: Sequence[torch.Tensor],
    grid: Sequence[tuple[int, int, int]],
    max_new_tokens: int = 128,
) -> tuple[dict, list[dict]]:
    """Decode `prompts` (1-D token tensors) with every (depth, top_k, total_tokens) in `grid`; returns
    the fastest setting's row and all rows. tau is exact (greedy decoding is deterministic); the step
    time is the median over all steps, so a noisy machine's stalls do not decide the choice."""
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    rows = []
    for depth, top_k, total in grid:
        spec = SpeculativeModel(model, EagleProposer(draft, embed, lm_head, depth, top_k, total))
        spec.generate(prompts[0][None], max_new_tokens=8, eos_token_id=[])  # warm-up, not counted
        steps, tokens, times = 0, 0, []
        for prompt in prompts:
            spec.generate(prompt[None], max_new_tokens=max_new_tokens, eos_token_id=[])
            s = spec.last_stats
            steps, tokens, times = steps + s.decode_steps, tokens + s.decode_tokens, times + s.step_times
        tau, step = tokens / max(steps, 1), statistics.median(times) if times else float("inf")
        rows.append({"depth": depth, "top_k": top_k, "total_tokens": total, "tau": tau, "ms_per_step": 1e3 * step,
                     "tokens_per_s": tau / step})
    return max(rows, key=lambda r: r["tokens_per_s"]), rows


def format_rows(rows: list[dict], best: dict) -> str:
    lines = []
    for r in rows:
        mark = " <- chosen" if r is best else ""
        lines.append(f"  depth {r['depth']:2d}  top_k {r['top_k']:2d}  total_tokens {r['total_tokens']:3d}: "
                     f"tau {r['tau']:.2f}, {r['ms_per_step']:6.2f} ms/step, {r['tokens_per_s']:7.1f} tokens/s{mark}")
    return "\n".join(lines)
