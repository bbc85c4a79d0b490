"""`python -m infer generate | bench`: speculative decoding from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from heads.config import HeadsConfig
    from infer.generate import SpeculativeModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EAGLE_OPTIONS = {"depth": "depth", "top_k": "draft_top_k", "total_tokens": "total_tokens"}  # kwarg: args dest


def _configs(heads_dirs: list[str]) -> list[HeadsConfig]:
    """Each heads directory's HeadsConfig, or a clear error."""
    from heads.config import HeadsConfig

    configs = []
    for heads in heads_dirs:
        if not Path(heads, "config.json").is_file():
            raise SystemExit(
                f"error: --heads {heads}: no config.json there (train heads with train/medusa.py or train/eagle.py)"
            )
        try:
            configs.append(HeadsConfig.load(heads))
        except ValueError as e:
            raise SystemExit(f"error: --heads {heads}: {e}") from None
    return configs


def _eagle_options(args: argparse.Namespace, configs: list[HeadsConfig]) -> dict[str, int | None]:
    """The EAGLE dynamic-tree options given on the command line (None: the heads' defaults)."""
    options = {name: getattr(args, dest) for name, dest in EAGLE_OPTIONS.items()}
    given = ["--" + dest.replace("_", "-") for name, dest in EAGLE_OPTIONS.items() if options[name] is not None]
    if given and args.tree:
        raise SystemExit(f"error: {', '.join(given)} shape EAGLE's dynamic tree and --tree fixes a static one: "
                         "give one or the other")
    if given and not any(c.kind == "eagle" for c in configs):
        kinds = sorted({c.kind for c in configs})
        raise SystemExit(f"error: {', '.join(given)} shape EAGLE's dynamic tree, but the heads are {'/'.join(kinds)} "
                         "heads; use --tree for a static tree")
    return options


def _load(args: argparse.Namespace, heads_dirs: list[str]) -> tuple[Any, Any, list[SpeculativeModel]]:
    """The target (loaded once), its tokenizer, and one SpeculativeModel per heads directory on it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from heads.demo import resolve_model
    from infer.generate import SpeculativeModel

    configs = _configs(heads_dirs)
    options = _eagle_options(args, configs)
    name = args.model or configs[0].base_model
    if not name:
        raise SystemExit("error: the heads name no base model; pass --model")
    if not args.model:
        for heads, config in zip(heads_dirs[1:], configs[1:]):
            if config.base_model != name:
                print(f"note: --heads {heads} was trained on {config.base_model or 'an unnamed model'}, "
                      f"benchmarked on {name}", file=sys.stderr)
    path = resolve_model(name)
    args.dtype = args.dtype or configs[0].dtype
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype]).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        tree = json.loads(args.tree) if args.tree else None
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: --tree is not JSON ({e}); e.g. --tree '[[0], [1], [0, 0]]'") from None
    specs = []
    for heads, config in zip(heads_dirs, configs):
        kwargs = options if config.kind == "eagle" else {}
        try:
            specs.append(SpeculativeModel.from_pretrained(heads, model=model, device=args.device, tree=tree, **kwargs))
        except ValueError as e:
            raise SystemExit(f"error: --heads {heads}: {e}") from None
    return model, tokenizer, specs


def method_names(specs: list[SpeculativeModel]) -> list[str]:
    """Each drafter's method name: its proposer's name, numbered from the second of a kind (medusa, medusa-2)."""
    names, seen = [], {}
    for spec in specs:
        base = spec.proposer.name
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}-{seen[base]}")
    return names


def cmd_generate(args: argparse.Namespace) -> None:
    model, tokenizer, (spec,) = _load(args, [args.heads])
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(args.device)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, generator=generator)
    pieces = []
    for piece in spec.stream(ids, tokenizer, **kwargs):
        pieces.append(piece)
        if not args.quiet:
            print(piece, end="", flush=True)
    if not args.quiet:
        print()
    stats = spec.last_stats
    token_ids = spec.last_tokens
    print(f"[{stats.new_tokens} tokens, {stats.target_forwards} target forwards, tau {stats.tau:.2f}]", file=sys.stderr)
    if args.json:
        record = {"token_ids": token_ids, "text": "".join(pieces), "stats": stats.as_dict()}
        Path(args.json).write_text(json.dumps(record, indent=2))


def cmd_bench(args: argparse.Namespace) -> None:
    from infer.bench import (
        default_prompts,
        format_table,
        hf_generate_runner,
        load_prompts,
        run_bench,
        speculative_runner,
    )
    from infer.generate import SpeculativeModel
    from infer.proposers import NoDraft

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, specs = _load(args, args.heads)
    prompts = load_prompts(args.prompts) if args.prompts else default_prompts(args.num_prompts)
    eos = model.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    n = args.max_new_tokens
    runners = {
        "hf_generate": hf_generate_runner(model, n, eos, pad),
        "plain": speculative_runner(SpeculativeModel(model, NoDraft(args.device)), n, eos),
    }
    tree_nodes = {}
    for name, spec in zip(method_names(specs), specs):
        runners[name] = speculative_runner(spec, n, eos)
        tree_nodes[name] = spec.proposer.max_nodes
    trees = ", ".join(f"{name} {size}" for name, size in tree_nodes.items())
    print(f"benchmarking {len(prompts)} prompts x {n} new tokens, {args.dtype}, {torch.get_num_threads()} threads, "
          f"trees of at most {trees} nodes", file=sys.stderr)
    result = run_bench(model, tokenizer, runners, prompts)
    result |= {"dtype": args.dtype, "max_new_tokens": n, "threads": torch.get_num_threads(), "tree_nodes": tree_nodes}
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m infer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, several: bool) -> None:
        if several:
            p.add_argument("--heads", required=True, action="append",
                           help="a trained heads directory (Medusa or EAGLE); repeat it to compare several drafters "
                                "of one target in the same run")
        else:
            p.add_argument("--heads", required=True, help="a trained heads directory (Medusa or EAGLE)")
        p.add_argument("--model", help="target model name or path (default: the (first) heads' base_model; "
                                       "`demo` works)")
        p.add_argument("--dtype", choices=list(DTYPES), help="default: the dtype the (first) heads were trained with")
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        p.add_argument("--tree", help='static tree as JSON choices, e.g. "[[0], [1], [0, 0]]" (for EAGLE heads: '
                                      "EAGLE-1 style instead of the dynamic tree)")
        p.add_argument("--max-new-tokens", type=int, default=128)
        p.add_argument("--json", help="write results to this JSON file")

    def eagle_tree(p: argparse.ArgumentParser, top_k_flags: list[str], note: str) -> None:
        g = p.add_argument_group("EAGLE dynamic tree", "override the EAGLE heads' defaults (from their config.json); "
                                 f"not with --tree; {note}")
        g.add_argument("--depth", type=int, help="draft steps (the tree's maximum depth)")
        g.add_argument(*top_k_flags, dest="draft_top_k", type=int,
                       help="frontier width and children per expanded node")
        g.add_argument("--total-tokens", type=int, help="drafted nodes kept for verification (root not counted)")

    gen = sub.add_parser("generate", help="stream a completion")
    common(gen, several=False)
    eagle_tree(gen, ["--draft-top-k"], "an error with Medusa heads")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0, help="sampling: keep the k likeliest tokens (0: all)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--quiet", action="store_true", help="do not print the text")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="compare drafters with model.generate and plain decoding on the same prompts")
    common(bench, several=True)
    # bench does not sample, so --top-k is free to mean the draft's (as --draft-top-k does on both commands)
    eagle_tree(bench, ["--draft-top-k", "--top-k"], "applied to the EAGLE heads only, an error when none is EAGLE")
    bench.add_argument("--prompts", help='a .jsonl file of {"prompt": ...} (default: demo test-split functions)')
    bench.add_argument("--num-prompts", type=int, default=16)
    bench.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)
