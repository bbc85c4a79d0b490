"""`selfspec generate | bench | tune | recipes`, and the command table of infer's commands: speculative
decoding from the command line (import, export and push are infer/cli/formats.py's).

Drafters: trained heads directories (`--heads`, Medusa or EAGLE), a separate small draft model
(`--draft-model`, the seed paper's algorithm) or prompt lookup (`--prompt-lookup`). The `selfspec` command
(selfspec/cli.py) adds train's draft-vocab to these.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from selfspec.heads.errors import run_main
from selfspec.infer.cli.options import (
    BENCH_PROMPTS,
    NUM_DRAFT_TOKENS,
    PROG,
    PROMPT_LOOKUP_TOKENS,
    Command,
    bench_parser,
    build_parser,
    export_parser,
    generate_parser,
    import_parser,
    output_file,
    push_parser,
    recipes_parser,
    tune_parser,
)

if TYPE_CHECKING:
    import torch

    from selfspec.infer.core.generate import SpeculativeModel


def method_names(specs: list[SpeculativeModel]) -> list[str]:
    """Each drafter's method name (`medusa2` for Medusa-2 heads, which decode an adapted target), numbered
    from the second of a kind (medusa, medusa#2)."""
    names, seen = [], {}
    for spec in specs:
        base = spec.drafter.name
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return names


def check_drafter_options(args: argparse.Namespace) -> None:
    """Refuse a drafter's option without that drafter (it would be silently ignored), then fill the defaults:
    --lookup-first runs prompt lookup in front of heads, --num-draft-tokens is the draft model's."""
    if getattr(args, "mtp", False) and not args.model:
        raise ValueError("--mtp drafts with the target's own MTP layers: name the target with --model")
    if args.lookup_first and not args.heads:
        raise ValueError(
            "--lookup-first puts prompt lookup in front of heads: give --heads DIR as well, or use "
            "--prompt-lookup alone"
        )
    if args.num_draft_tokens is not None and not args.draft_model:
        raise ValueError(
            "--num-draft-tokens is the draft model's proposal length: give --draft-model as well, or drop it"
        )
    if args.prompt_lookup_tokens is not None and not (args.prompt_lookup or args.lookup_first):
        raise ValueError(
            "--prompt-lookup-tokens applies to prompt lookup: add --prompt-lookup (or --lookup-first "
            "with --heads), or drop it"
        )
    args.num_draft_tokens = args.num_draft_tokens or NUM_DRAFT_TOKENS
    args.prompt_lookup_tokens = args.prompt_lookup_tokens or PROMPT_LOOKUP_TOKENS


def cmd_generate(args: argparse.Namespace) -> None:
    import torch

    from selfspec.infer.cli.loading import load_models
    from selfspec.infer.core.arguments import fit_budget, max_positions
    from selfspec.infer.core.generation_config import resolve
    from selfspec.infer.measure.bench import encode_prompt

    check_drafter_options(args)
    given = sum(map(bool, (args.heads, args.mtp, args.draft_model, args.prompt_lookup)))
    if given != 1:
        raise ValueError(
            "generate takes exactly one drafter: --heads DIR, --mtp, --draft-model PATH or --prompt-lookup"
        )
    output_file("--json", args.json)

    def fit(tokenizer: Any, config: Any) -> None:
        """Clip --max-new-tokens to the model's positions (a note), or refuse a prompt that fills them."""
        length = encode_prompt(tokenizer, args.prompt).shape[1]
        limit = max_positions(config)
        try:
            budget = fit_budget(length, args.max_new_tokens, limit)
        except ValueError as e:
            raise ValueError(f"--prompt: {e}") from None
        if budget < args.max_new_tokens:
            print(
                f"note: --max-new-tokens {args.max_new_tokens} clipped to {budget}: the prompt is "
                f"{length} tokens and the model takes at most {limit} positions",
                file=sys.stderr,
            )
            args.max_new_tokens = budget

    model, tokenizer, (spec,) = load_models(args, [args.heads] if args.heads else [], fit)
    truncating = [
        flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p)) if value is not None
    ]
    # the command line's rule: --temperature above 0 samples, 0 is greedy, none leaves it to the generation
    # config
    do_sample = None if args.temperature is None else args.temperature > 0
    sampling = {
        k: v
        for k, v in (
            ("do_sample", do_sample),
            ("temperature", args.temperature or None),
            ("top_k", args.top_k),
            ("top_p", args.top_p),
        )
        if v is not None
    }
    if truncating and resolve(model.generation_config, **sampling).params.temperature == 0:
        why = (
            "--temperature 0"
            if args.temperature == 0
            else "no --temperature, and the model's generation_config does not sample"
        )
        raise ValueError(
            f"{' and '.join(truncating)} only apply when sampling, but this run is greedy ({why}): add "
            "--temperature T above 0, or drop them"
        )
    ids = encode_prompt(tokenizer, args.prompt).to(args.device)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    kwargs = dict(max_new_tokens=args.max_new_tokens, generator=generator, **sampling)
    pieces = []
    for piece in spec.stream(ids, tokenizer, **kwargs):
        pieces.append(piece)
        if not args.quiet:
            print(piece, end="", flush=True)
    if not args.quiet:
        print()
    stats = spec.last_stats
    token_ids = spec.last_tokens
    if not args.quiet:
        print(
            f"[{stats.new_tokens} tokens, {stats.target_forwards} target forwards, tau {stats.tau:.2f}]",
            file=sys.stderr,
        )
    if args.json:
        record = {"token_ids": token_ids, "text": "".join(pieces), "stats": stats.as_dict()}
        Path(args.json).write_text(json.dumps(record, indent=2))


def cmd_bench(args: argparse.Namespace) -> None:
    import torch

    from selfspec.infer.cli.loading import load_models
    from selfspec.infer.core.arguments import max_positions
    from selfspec.infer.core.generate import SpeculativeModel
    from selfspec.infer.drafters.proposers import NoDraft
    from selfspec.infer.measure.bench import (
        default_prompts,
        encode_prompt,
        hf_runner,
        load_prompts,
        render_prompts,
        run_bench,
        speculative_runner,
    )
    from selfspec.infer.measure.bench_report import add_agreement, check_plot_file, format_tables, plot_bench

    # everything that can fail without the model fails before it loads
    check_drafter_options(args)
    if args.plot:
        check_plot_file(args.plot)
    output_file("--json", args.json)
    output_file("--plot", args.plot)
    prompts = (
        load_prompts(args.prompts)[: args.num_prompts]
        if args.prompts
        else default_prompts(args.num_prompts or BENCH_PROMPTS)
    )
    n = args.max_new_tokens
    sizes = args.batch_size
    if len(set(sizes)) < len(sizes):
        raise ValueError(f"--batch-size {' '.join(map(str, sizes))}: give each batch size once")
    if max(sizes) > len(prompts):
        raise ValueError(
            f"--batch-size {max(sizes)} is more than the {len(prompts)} prompts: give at least "
            f"{max(sizes)} prompts (--num-prompts or --prompts) or a smaller batch size"
        )
    if args.plot and len(sizes) > 1:
        raise ValueError(
            f"--plot draws the run of one batch size, and --batch-size gives {len(sizes)}: give one "
            "--batch-size, or leave out --plot"
        )

    def fit(tokenizer: Any, config: Any) -> None:
        """Every prompt + --max-new-tokens must fit the model's positions: a benchmark compares equal work."""
        prompts[:] = render_prompts(prompts, tokenizer)
        limit = max_positions(config)
        lengths = [encode_prompt(tokenizer, p).shape[1] for p in prompts]
        over = [length for length in lengths if length + n > limit] if limit else []
        if over:
            fix = (
                f"lower --max-new-tokens to {limit - max(lengths)} or use" if max(lengths) < limit else "use"
            )
            raise ValueError(
                f"{len(over)} of {len(prompts)} prompts (the longest {max(over)} tokens) + "
                f"--max-new-tokens {n} exceed the model's {limit} positions: {fix} shorter prompts"
            )

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, specs = load_models(args, args.heads or [], fit)
    eos = model.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    runners = {
        "hf_generate": hf_runner(model, n, eos, pad),
        "plain": speculative_runner(SpeculativeModel(model, NoDraft(), compile=args.compile), n, eos, pad),
    }
    # transformers' own speculative decoding next to ours, with the same draft model / lookup length
    draft = next((s.proposer.draft.model for s in specs if s.proposer.name == "draft_model"), None)
    if draft is not None:
        runners["hf_assisted"] = hf_runner(model, n, eos, pad, assistant_model=draft)
    if args.prompt_lookup:
        runners["hf_prompt_lookup"] = hf_runner(
            model, n, eos, pad, prompt_lookup_num_tokens=args.prompt_lookup_tokens
        )
    if args.mtp:  # transformers' MTP chain (MTPCandidateGenerator: one token per MTP layer a step)
        from selfspec.heads.formats.mtp import own_mtp_keys

        runners["hf_mtp"] = own_mtp_keys(model, hf_runner(model, n, eos, pad, use_mtp=True))
    tree_nodes = {}
    for name, spec in zip(method_names(specs), specs):
        runners[name] = speculative_runner(spec, n, eos, pad)
        tree_nodes[name] = spec.proposer.max_nodes
    trees = ", ".join(f"{name} {size}" for name, size in tree_nodes.items())
    batches = f"batch size{'s' if len(sizes) > 1 else ''} {', '.join(map(str, sizes))}"
    print(
        f"benchmarking {len(prompts)} prompts x {n} new tokens, {batches}, {args.dtype}, "
        f"{torch.get_num_threads()} threads, trees of at most {trees or 'no'} nodes",
        file=sys.stderr,
    )
    batch_one = [name for name in ("hf_assisted", "hf_prompt_lookup", "hf_mtp") if name in runners]
    larger = [size for size in sizes if size > 1]
    if batch_one and larger:
        sizes_s = f"size{'s' if len(larger) > 1 else ''} {', '.join(map(str, larger))}"
        print(
            f"note: {' and '.join(batch_one)} skipped at batch {sizes_s}: transformers' assisted generation "
            "takes one prompt at a time",
            file=sys.stderr,
        )
    chains = frozenset(name for name in tree_nodes if name.split("-")[0] in ("draft_model", "prompt_lookup"))
    results = {}
    for size in sizes:
        chosen = {name: run for name, run in runners.items() if size == 1 or name not in batch_one}
        results[size] = add_agreement(
            run_bench(model, tokenizer, chosen, prompts, chains=chains, batch_size=size, pad_token_id=pad)
        )
    print(format_tables(results))
    if args.latency:
        from selfspec.infer.measure.bench import latency_report
        from selfspec.infer.measure.bench_report import format_latency

        for size in sizes:  # after the decoding: its timings are not disturbed by these
            report = latency_report(model, results[size], tree_nodes, batch_size=size)
            results[size]["latency"] = report
            print(f"\nbatch size {size}: " + format_latency(report))
    shared = {
        "dtype": args.dtype,
        "max_new_tokens": n,
        "threads": torch.get_num_threads(),
        "tree_nodes": tree_nodes,
    }
    if len(sizes) == 1:
        result = results[sizes[0]] | shared
    else:
        result = {"by_batch_size": {str(size): r for size, r in results.items()}} | shared
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot_bench(result, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)


def calibration_texts(path: str | None, count: int) -> list[Any]:
    """Prompts to measure acceptance on: a .jsonl of {"prompt": ...} or {"messages": ...}, else files from the
    demo corpus's validation split (never trained on)."""
    from selfspec.infer.measure.bench import load_prompts
    from selfspec.shipped.stdlib_corpus import stdlib_texts

    if path:
        return load_prompts(path)[:count]
    texts = [t for t in stdlib_texts("validation") if len(t) > 400]
    return texts[:: max(1, len(texts) // count)][:count]


def calibration_prompts(tokenizer, texts: list[Any], length: int | None = 32) -> list[torch.Tensor]:
    """The first `length` tokens of each calibration text (all of them with None, as for a prompts file: a
    chat rendered by its template is mostly system prompt in its first 32 tokens)."""
    from selfspec.infer.measure.bench import encode_prompt, render_prompts

    return [encode_prompt(tokenizer, t)[0, :length] for t in render_prompts(texts, tokenizer)]


def cmd_tune(args: argparse.Namespace) -> None:
    import torch

    from selfspec.heads.families import dynamic_tree, family
    from selfspec.heads.io import atomic_write
    from selfspec.heads.registry import is_published
    from selfspec.infer.cli.loading import load_models
    from selfspec.infer.measure.tune import format_rows, format_tree_rows, tune_eagle, tune_medusa

    if bool(args.heads) == bool(args.mtp):
        raise ValueError("tune fits one drafter: give --heads DIR, or --mtp with --model TARGET")
    if args.mtp and not args.model:
        raise ValueError("--mtp drafts with the target's own MTP layers: name the target with --model")
    if args.heads and not Path(args.heads, "config.json").is_file():
        raise ValueError(
            f"--heads {args.heads}: tune stores its result in a local heads directory; "
            "download Hub heads first (hf download ID --local-dir DIR)"
        )
    if args.heads and is_published(args.heads):
        raise ValueError(
            f"--heads {args.heads}: tune stores its result in the heads' config.json, and this one is "
            f"a published checkpoint's: write it in selfspec's layout first (selfspec import "
            f"--src {args.heads} --out DIR)"
        )
    texts = calibration_texts(
        args.prompts, args.num_prompts
    )  # a bad --prompts file fails before the model loads
    model, tokenizer, (spec,) = load_models(args, [args.heads] if args.heads else [])
    prompts = [p.to(args.device) for p in calibration_prompts(tokenizer, texts, None if args.prompts else 32)]
    drafter = spec.proposer.drafter
    config = drafter.config
    print(
        f"measuring on {len(prompts)} calibration prompts, batch size {args.batch_size}, {args.dtype}, "
        f"{torch.get_num_threads()} threads",
        file=sys.stderr,
    )
    if dynamic_tree(config.kind):
        grid = family(config.kind).load("tune_grid")(config)
        best, rows = tune_eagle(model, drafter, prompts, grid, args.max_new_tokens, args.batch_size)
        print(
            f"{family(config.kind).title} dynamic tree, measured by greedy decoding "
            "(tau, 20th-percentile step time):"
        )
        print(format_rows(rows, best))
        config.depth, config.top_k, config.total_tokens = best["depth"], best["top_k"], best["total_tokens"]
        config.tree = None  # a static tree would win over the dynamic one measured here
        chosen = f"depth {config.depth}, top_k {config.top_k}, total_tokens {config.total_tokens}"
    else:
        choices, rows, accuracy = tune_medusa(model, drafter, prompts, batch_size=args.batch_size)
        print("Medusa heads' top-1..3 accuracy on the target's own continuations:")
        for k, row in enumerate(accuracy.tolist()):
            print(f"  head {k}: " + " ".join(f"{a:.3f}" for a in row[:3]))
        print("static tree by size (target forward time here x expected accepted tokens):")
        print(format_tree_rows(rows, choices))
        config.tree = choices
        chosen = f"a {len(choices) + 1}-node tree"
    if args.mtp:
        print(
            f"the fastest here: --depth {config.depth} --draft-top-k {config.top_k} --total-tokens "
            f"{config.total_tokens} (with --mtp; train/mtp.py saves fine-tuned layers with a tree of their "
            "own)"
        )
        return
    atomic_write(Path(args.heads, "config.json"), lambda tmp: Path(tmp).write_text(config.to_json()))
    print(
        f"stored {chosen} as the default in {args.heads}/config.json (the most tokens per second "
        f"measured here, at batch size {args.batch_size})"
    )


def cmd_recipes(args: argparse.Namespace) -> None:
    """The shipped configs' folder
    (`accelerate launch --config_file "$(selfspec recipes)/accelerate/ddp.yaml"`), or a copy of them
    to edit."""
    import shutil

    from selfspec.shipped.recipes import RECIPES

    if args.copy is None:
        print(RECIPES)
        return
    out = Path(args.copy)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--copy {out}: the folder is not empty; give a new folder")
    shutil.copytree(RECIPES, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    print(f"copied the recipes into {out}")


def lazy(module: str, name: str) -> Callable[[argparse.Namespace], None]:
    """A command's run function, imported when the command runs: `selfspec --help` loads no torch."""

    def run(args: argparse.Namespace) -> None:
        getattr(importlib.import_module(module), name)(args)

    return run


COMMANDS = {
    "generate": Command(generate_parser, cmd_generate),
    "bench": Command(bench_parser, cmd_bench),
    "tune": Command(tune_parser, cmd_tune),
    "import": Command(import_parser, lazy("selfspec.infer.cli.formats", "cmd_import")),
    "export": Command(export_parser, lazy("selfspec.infer.cli.formats", "cmd_export")),
    "push": Command(push_parser, lazy("selfspec.infer.cli.formats", "cmd_push")),
    "recipes": Command(recipes_parser, cmd_recipes),
}


def main(argv: list[str] | None = None, prog: str = PROG, commands: dict[str, Command] = COMMANDS) -> None:
    """The command line of `commands` (default: infer's own; `selfspec` adds draft-vocab): a user error ends
    in one `error: ...` line and exit status 2 (`--debug`: the traceback)."""

    def run(args: list[str]) -> None:
        parsed = build_parser(commands, prog).parse_args(args)
        with plain_warnings(prog), quiet_libraries(getattr(parsed, "quiet", False)):
            commands[parsed.command].run(parsed)

    run_main(run, argv, prog=prog)


@contextlib.contextmanager
def plain_warnings(prog: str) -> Iterator[None]:
    """Within: a warning prints as one `prog: warning: ...` line, not Python's file:line and source-line
    form."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"{prog}: warning: {' '.join(str(message).split())}", file=file or sys.stderr, flush=True)

    saved, warnings.showwarning = warnings.showwarning, show
    try:
        yield
    finally:
        warnings.showwarning = saved


@contextlib.contextmanager
def quiet_libraries(quiet: bool) -> Iterator[None]:
    """With `quiet`: transformers' and datasets' progress bars ("Loading weights") and info logs off
    within."""
    if not quiet:
        yield
        return
    import datasets
    import transformers

    bars = transformers.utils.logging.is_progress_bar_enabled()
    level = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    datasets_quiet = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(level)
        if bars:
            transformers.utils.logging.enable_progress_bar()
        if not datasets_quiet:
            datasets.enable_progress_bars()
