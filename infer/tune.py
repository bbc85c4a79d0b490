"""Fit a drafter's tree to this machine: `python -m infer tune --heads DIR`.

A bigger tree accepts more tokens per step but costs a wider target forward (and, for EAGLE, more
draft calls); where the balance lies depends on the hardware, so it is measured, not assumed.
  - Medusa: the target's forward latency against tree size here, times the heads' top-k accuracy
    on the target's own greedy continuations of calibration prompts -> the static tree with the
    most expected tokens per second (tree.fit_tree).
  - EAGLE: each (depth, top_k, total_tokens) setting decodes the calibration prompts (greedy);
    its score is tau over the median decode-step time.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

import torch

from heads.eagle import EagleDraft
from heads.medusa import MedusaHeads
from infer.eagle import EagleProposer
from infer.generate import SpeculativeModel
from infer.tree import fit_tree

RANKS = 10  # top-k depth of the Medusa accuracy table
LATENCY_SIZES = [1, 4, 8, 12, 16, 24, 32, 48, 64]


@torch.no_grad()
def medusa_accuracy(model: torch.nn.Module, heads: MedusaHeads, prompts: Sequence[torch.Tensor],
                    new_tokens: int = 96) -> torch.Tensor:
    """(K, RANKS): how often head k's rank-r token is what the target itself generates k + 2 ahead."""
    K = heads.config.num_heads
    hits, count = torch.zeros(K, RANKS), torch.zeros(K)
    lm_head = model.get_output_embeddings()
    for prompt in prompts:
        seq = model.generate(prompt[None], max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        hidden = model.base_model(input_ids=seq, use_cache=False).last_hidden_state[0]  # (T, H)
        start = prompt.numel() - 1  # from the state that chose the first generated token
        for k, logits in enumerate(heads(hidden[start:].to(next(heads.parameters()).dtype), lm_head)):
            labels = seq[0, start + k + 2 :]
            top = logits[: labels.numel()].topk(RANKS, dim=-1).indices
            hits[k] += (top == labels[:, None]).sum(0).cpu().float()
            count[k] += labels.numel()
    return hits / count.clamp(min=1)[:, None]


def tune_medusa(model: torch.nn.Module, heads: MedusaHeads, prompts: Sequence[torch.Tensor],
                latency: dict[int, float] | None = None) -> tuple[list[list[int]], list[dict], torch.Tensor]:
    """The static tree with the most expected tokens per second; `latency` (nodes -> seconds per target
    forward) is measured here when not given. Returns the choices, a row per size and the accuracy table."""
    from infer.bench import forward_latency

    accuracy = medusa_accuracy(model, heads, prompts).clamp(min=1e-6)
    if latency is None:
        latency = forward_latency(model, LATENCY_SIZES)
    choices, rows = fit_tree(accuracy, latency)
    return choices, rows, accuracy


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
