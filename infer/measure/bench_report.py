"""`selfspec bench`'s results for people: one table per batch size (with notes on acceptance, drift, memory
and mismatches), the latency report's lines, and a plot."""

from __future__ import annotations

import importlib
from pathlib import Path


def format_table(result: dict) -> str:
    width = max(14, 1 + max(map(len, result["methods"]), default=0))  # hf_prompt_lookup is 16 characters
    head = (
        f"{'method':<{width}}{'tokens/s':>10}{'speedup':>9}{'median':>8}{'tau':>7}{'fwd':>7}"
        "  identical  ms/step draft/verify/book"
    )
    rows = [head, "-" * len(head)]
    notes = []
    for name, m in result["methods"].items():
        split = m.get("ms_per_step")
        split_s = "/".join(f"{split[k]:.1f}" for k in ("draft", "verify", "bookkeeping")) if split else "-"
        same = (
            "yes" if m["identical_to_baseline"] else ("ties" if m.get("all_mismatches_near_ties") else "NO")
        )
        rows.append(
            f"{name:<{width}}{m['tokens_per_s']:>10.1f}{m['speedup']:>8.2f}x{m['median_speedup']:>7.2f}x"
            f"{m['tau']:>7.2f}{m['target_forwards']:>7d}  {same:<9}  {split_s}"
        )
        if "alpha" in m:
            notes.append(
                f"{name}: acceptance rate alpha {m['alpha']:.3f}; the seed paper's formula predicts tau "
                f"{m['predicted_tau']:.2f}, measured {m['tau']:.2f}"
            )
        if "step_ms_first_100" in m:
            notes.append(
                f"{name}: {m['step_ms_first_100']:.1f} ms per step over the first 100 steps, "
                f"{m['step_ms_last_100']:.1f} over the last 100"
            )
        if "launches_per_step" in m:
            launches = m["launches_per_step"]
            notes.append(
                f"{name}: {launches['outside']:.0f} kernel launches per step outside the target's forward, "
                f"{launches['inside']:.0f} inside"
            )
        if "peak_memory_mb" in m:
            notes.append(f"{name}: peak memory {m['peak_memory_mb']:.0f} MiB")
        if m.get("mismatches"):
            notes.append(f"{name}: " + format_agreement(agreement(m, result["num_prompts"])))
        for mm in m.get("mismatches", []):
            kind = "a near-tie" if mm["near_tie"] else "NOT a near-tie: a bug"
            notes.append(
                f"{name}: prompt {mm['prompt']} differs from the baseline at new token {mm['position']}; "
                f"top-2 logit margin there {mm['top2_logit_margin']}, {kind}"
            )
    return "\n".join(rows + notes)


def agreement(method: dict, num_prompts: int) -> dict:
    """How far a method's greedy output agrees with the baseline's: the prompts identical to it, and for the
    others where they first differ and the target's top-2 logit margin there (a near-tie when within 4 units
    in the last place of the dtype: a tree forward and a one-token forward may round differently and flip such
    an argmax; anything wider is a bug)."""
    mismatches = method.get("mismatches", [])
    margins = [mm["top2_logit_margin"] for mm in mismatches if mm["top2_logit_margin"] is not None]
    return {
        "prompts": num_prompts,
        "identical_prompts": num_prompts - len(mismatches),
        "fraction_identical": (num_prompts - len(mismatches)) / max(1, num_prompts),
        "first_divergence": [mm["position"] for mm in mismatches],
        "top2_margins": margins,
        "largest_margin": max(margins, default=None),
        "all_near_ties": all(mm["near_tie"] for mm in mismatches),
    }


def add_agreement(result: dict) -> dict:
    """`result` (run_bench's) with each method's `agreement` added."""
    for method in result["methods"].values():
        method["agreement"] = agreement(method, result["num_prompts"])
    return result


def format_agreement(a: dict) -> str:
    return (
        f"{a['identical_prompts']}/{a['prompts']} prompts identical to the baseline "
        f"({a['fraction_identical']:.0%}); the others first differ at new token"
        f"{'s' if len(a['first_divergence']) > 1 else ''} {', '.join(map(str, a['first_divergence']))}, "
        f"top-2 logit margin{'s' if len(a['top2_margins']) > 1 else ''} there "
        f"{', '.join(f'{x:g}' for x in a['top2_margins']) or '-'}"
        f"{' (all near-ties)' if a['all_near_ties'] else ' (NOT all near-ties: a bug)'}"
    )


def format_tables(results: dict[int, dict]) -> str:
    """The table of each batch size's run (`run_bench`'s result by batch size): one block each, headed by its
    batch size when there are several."""
    if len(results) == 1:
        return format_table(next(iter(results.values())))
    return "\n\n".join(f"batch size {size}\n{format_table(result)}" for size, result in results.items())


def check_plot_file(path: str | Path) -> None:
    """What `plot_bench` needs, checked before a benchmark runs: matplotlib, and a file type it draws."""
    try:
        importlib.import_module("matplotlib")
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'selfspec[plot]')"
        ) from None
    kinds = FigureCanvasBase.get_supported_filetypes()
    if Path(path).suffix.lower().removeprefix(".") not in kinds:
        raise ValueError(
            f"--plot {path}: name a file ending in one of .{', .'.join(sorted(kinds))} (e.g. bench.png)"
        )


def plot_bench(result: dict, path: str | Path) -> None:
    """tokens/s and tau per method, and each speculative method's distribution of tokens per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = result["methods"]
    names = list(methods)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    axes[0].bar(names, [methods[n]["tokens_per_s"] for n in names], color="tab:blue")
    axes[0].set_ylabel("tokens / s")
    axes[1].bar(names, [methods[n]["tau"] for n in names], color="tab:green")
    axes[1].set_ylabel("tau (tokens per target forward)")
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=45)
    lengths = {n: methods[n]["accept_lengths"] for n in names if methods[n].get("accept_lengths")}
    if lengths:
        top = max(max(v) for v in lengths.values())
        bins = [x - 0.5 for x in range(1, top + 2)]
        for n, v in lengths.items():
            axes[2].hist(v, bins=bins, histtype="step", density=True, linewidth=1.5, label=n)
        axes[2].legend()
    axes[2].set_xlabel("tokens produced per decode step")
    axes[2].set_ylabel("fraction of steps")
    title = f"{result.get('num_prompts', '?')} prompts x {result.get('max_new_tokens', '?')} new tokens, "
    fig.suptitle(title + f"{result.get('dtype', '')}, {result.get('threads', '?')} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_latency(report: dict) -> str:
    rows = [
        "target forward t(n)/t(1): "
        + ", ".join(f"n={n} {r:.2f}" for n, r in report["ratio"].items())
        + f" (t(1) = {report['ms'][1]:.1f} ms)"
    ]
    for name, m in report["methods"].items():
        rows.append(
            f"{name}: {m['nodes']} nodes, limit tau*t(1)/t(tree) = {m['limit_speedup']:.2f}x, "
            f"efficiency {m['efficiency']:.2f}"
        )
    return "\n".join(rows)
