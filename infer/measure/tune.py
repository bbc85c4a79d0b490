"""Fit a drafter's tree to this machine: `selfspec tune --heads DIR`.

A bigger tree accepts more tokens per step but costs a wider target forward (and, for EAGLE, more
draft calls); where the balance lies depends on the hardware, so it is measured, not assumed.
  - Medusa: the target's forward latency against tree size here, times how often each rank path of
    the heads is accepted on the target's own greedy continuations of calibration prompts -> the
    static tree with the most expected tokens per second (tree.fit_tree).
  - EAGLE: each (depth, top_k, total_tokens) setting decodes the calibration prompts (greedy);
    its score is tau over its decode-step time.
Timings are repeated with the sizes or settings taking turns, each keeps a low quantile (a busy
machine only adds time), and the printed rows end with a warning when the repeats disagree too much.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from selfspec.heads.eagle import EagleDraft
from selfspec.heads.families import family
from selfspec.heads.medusa import MedusaHeads
from selfspec.infer.core.generate import GenerationStats, SpeculativeModel
from selfspec.infer.core.tree import (
    LOW_QUANTILE,
    NOISE_LIMIT,
    fit_tree,
    label_ranks,
    low_and_spread,
    path_frequencies,
)
from selfspec.infer.drafters.eagle import EagleProposer

RANKS = 10  # top-k depth of the Medusa accuracy table
LATENCY_SIZES = [1, 4, 8, 12, 16, 24, 32, 48, 64]


@torch.no_grad()
def medusa_ranks(
    model: torch.nn.Module, heads: MedusaHeads, prompts: Sequence[torch.Tensor], new_tokens: int = 96
) -> torch.Tensor:
    """(N, K) at the N positions of the target's own greedy continuations where every head has a label: the
    rank of what the target generates k + 2 ahead among head k's candidates (RANKS: not in its top RANKS)."""
    K = heads.config.num_heads
    lm_head, rows = model.get_output_embeddings(), []
    for prompt in prompts:
        seq = model.generate(
            prompt[None], max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        hidden = model.base_model(input_ids=seq, use_cache=False).last_hidden_state[0]  # (T, H)
        start = prompt.numel() - 1  # from the state that chose the first generated token
        length = seq.shape[1] - start - K - 1  # positions where the last head still has a label
        if length <= 0:
            continue
        ranks = []
        for k, logits in enumerate(heads(hidden[start:].to(next(heads.parameters()).dtype), lm_head)):
            labels = seq[0, start + k + 2 : start + k + 2 + length]
            ranks.append(label_ranks(logits[:length], labels, RANKS).cpu())
        rows.append(torch.stack(ranks, 1))
    return torch.cat(rows) if rows else torch.zeros(0, K, dtype=torch.long)


def medusa_accuracy(ranks: torch.Tensor) -> torch.Tensor:
    """(K, RANKS) from `medusa_ranks`: how often head k's rank-r token is what the target generated."""
    return torch.stack([(ranks == r).double().mean(0) for r in range(RANKS)], 1).nan_to_num()


def tune_medusa(
    model: torch.nn.Module,
    heads: MedusaHeads,
    prompts: Sequence[torch.Tensor],
    latency: dict[int, float] | None = None,
    batch_size: int = 1,
) -> tuple[list[list[int]], list[dict], torch.Tensor]:
    """The static tree with the most expected tokens per second, its acceptance measured path by path on the
    target's own continuations (tree.path_frequencies); `latency` (nodes -> seconds per target forward) is
    measured here, for batches of `batch_size` rows, when not given. Returns the choices, a row per size and
    the per-head accuracy table."""
    from selfspec.infer.measure.bench import forward_latency

    ranks = medusa_ranks(model, heads, prompts)
    if latency is None:
        latency = forward_latency(model, LATENCY_SIZES, batch_size=batch_size)
    accuracy = medusa_accuracy(ranks)
    # no path seen (too few continuations): the product of per-head accuracies
    choices, rows = fit_tree(path_frequencies(ranks, RANKS) or accuracy.clamp(min=1e-6), latency)
    for row in rows:  # every row's tokens per second, as EAGLE's rows count them (the choice is the same)
        row["tokens_per_s"] *= batch_size
    return choices, rows, accuracy


def eagle_grid(
    depths: Sequence[int] = (3, 4, 5, 6, 8),
    top_ks: Sequence[int] = (2, 4, 8),
    totals: Sequence[int] = (16, 32),
) -> list[tuple[int, int, int]]:
    """Every (depth, top_k, total_tokens) combination."""
    return list(itertools.product(depths, top_ks, totals))


def dynamic_grid(config: Any) -> list[tuple[int, int, int]]:
    """`selfspec tune`'s grid for an EAGLE drafter's dynamic tree (its config does not bound it)."""
    return eagle_grid()


def block_grid(config: Any) -> list[tuple[int, int, int]]:
    """`selfspec tune`'s grid for a DFlash drafter, as its training fits it: at half the block and the whole
    block, the chain (top_k 1, what its exports decode) and trees of top_k 2 and 4 of 16 and 32 nodes."""
    depths = sorted({max(1, config.block_size // 2 - 1), config.block_size - 1})
    return [(d, 1, d) for d in depths] + [
        (d, k, t) for d in depths for k in (2, 4) for t in (16, 32) if t > d
    ]


@torch.no_grad()
def tune_eagle(
    model: torch.nn.Module,
    draft: EagleDraft,
    prompts: Sequence[torch.Tensor],
    grid: Sequence[tuple[int, int, int]],
    max_new_tokens: int = 128,
    batch_size: int = 1,
) -> tuple[dict, list[dict]]:
    """Decode `prompts` (1-D token tensors), `batch_size` at a time (left-padded), with every (depth, top_k,
    total_tokens) in `grid`; returns the fastest setting's row and all rows.

    The settings take turns batch by batch, so a busy spell of the machine slows several settings a
    little instead of one a lot. tau is exact (greedy decoding is deterministic); the step time is the
    20th percentile of the setting's decode steps and `spread` how far their median lies above it.
    """
    from selfspec.infer.measure.bench import left_pad

    build = family(draft.config.kind).load("proposer")
    proposers = [
        build(draft, model, None, dynamic=True, depth=depth, top_k=top_k, total_tokens=total)
        for depth, top_k, total in grid
    ]
    device = prompts[0].device
    filled = cycled(prompts, batch_size)
    # a batch of one gets an all-ones mask: the single-prompt path, and no pad id inferred from prompt tokens
    # (a chat prompt holds <|im_end|>, which is SmolLM2's pad id, and the decode passes no EOS to stop at)
    batches = [
        (filled[i][None], torch.ones_like(filled[i][None]))
        if batch_size == 1
        else tuple(t.to(device) for t in left_pad(filled[i : i + batch_size], 0))
        for i in range(0, len(filled), batch_size)
    ]

    def decode(
        proposer: EagleProposer, batch: tuple[torch.Tensor, torch.Tensor | None], new_tokens: int
    ) -> GenerationStats:
        spec = SpeculativeModel(model, proposer)  # per decode: one per setting would hold a KV cache each
        ids, mask = batch
        spec.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=[], do_sample=False)
        return spec.last_stats

    for proposer in proposers:
        decode(proposer, batches[0], 8)  # warm-up, not counted
    steps, tokens = [0] * len(grid), [0] * len(grid)
    times: list[list[float]] = [[] for _ in grid]
    for batch in batches:
        for i, proposer in enumerate(proposers):
            s = decode(proposer, batch, max_new_tokens)
            steps[i], tokens[i] = steps[i] + s.decode_steps, tokens[i] + s.decode_tokens
            times[i] += s.step_times
    rows = []
    for (depth, top_k, total), n, t, ts in zip(grid, steps, tokens, times):
        tau = t / max(n, 1)  # per row and step
        step, spread = low_and_spread(ts) if ts else (float("inf"), 0.0)
        per_forward = t / max(len(ts), 1)  # every row's tokens of one forward (tau at batch size 1)
        rows.append(
            {
                "depth": depth,
                "top_k": top_k,
                "total_tokens": total,
                "tau": tau,
                "ms_per_step": 1e3 * step,
                "tokens_per_s": per_forward / step,
                "spread": spread,
            }
        )
    return max(rows, key=lambda r: r["tokens_per_s"]), rows


def cycled(prompts: Sequence[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    """The prompts, repeated from the first as needed to fill whole batches: every batch is timed at
    `batch_size` rows, also when there are fewer prompts than that or they do not divide evenly."""
    count = -(-len(prompts) // batch_size) * batch_size
    return [prompts[i % len(prompts)] for i in range(count)]


def noise_warning(rows: list[dict], name: str) -> str | None:
    """One line when the noisiest row's timings spread past NOISE_LIMIT (`name` formats that row), else
    None."""
    worst = max(rows, key=lambda r: r["spread"])
    if worst["spread"] <= NOISE_LIMIT:
        return None
    return (
        f"warning: this machine was too busy to trust the fit: at {name.format(**worst)} the median time was "
        f"{worst['spread']:.0%} above the {LOW_QUANTILE:.0%} quantile (trusted up to {NOISE_LIMIT:.0%}); "
        "re-fit when it is quiet: selfspec tune --heads DIR"
    )


def format_rows(rows: list[dict], best: dict) -> str:
    """EAGLE rows from tune_eagle, the chosen one marked, then a noise warning if any."""
    lines = []
    for r in rows:
        mark = " <- chosen" if r is best else ""
        lines.append(
            f"  depth {r['depth']:2d}  top_k {r['top_k']:2d}  total_tokens {r['total_tokens']:3d}: "
            f"tau {r['tau']:.2f}, {r['ms_per_step']:6.2f} ms/step, {r['tokens_per_s']:7.1f} tokens/s{mark}"
        )
    warning = noise_warning(rows, "depth {depth}, top_k {top_k}, total_tokens {total_tokens}")
    return "\n".join(lines + ([warning] if warning else []))


def format_tree_rows(rows: list[dict], choices: list[list[int]]) -> str:
    """Medusa rows from fit_tree, the chosen one marked, sizes the monotone fit lowered noted, then a
    noise warning if any."""
    lines = []
    for r in rows:
        mark = " <- chosen" if r["choices"] == choices else ""
        lowered = (
            f" (measured {r['measured_ms']:.2f}: a bigger tree was faster)"
            if r["measured_ms"] > r["ms"]
            else ""
        )
        lines.append(
            f"  {r['nodes']:3d} nodes: {r['ms']:6.2f} ms/forward, {r['tokens_per_step']:.2f} tokens/step, "
            f"{r['tokens_per_s']:7.1f} tokens/s{mark}{lowered}"
        )
    warning = noise_warning(rows, "{nodes} nodes")
    return "\n".join(lines + ([warning] if warning else []))
