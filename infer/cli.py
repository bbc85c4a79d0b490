"""`python -m infer generate | bench`: speculative decoding from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _load(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from heads.config import HeadsConfig
    from heads.demo import resolve_model
    from infer.generate import SpeculativeModel

    if not Path(args.heads, "config.json").is_file():
        raise SystemExit(f"error: --heads {args.heads}: no config.json there (train heads with train/medusa.py)")
    config = HeadsConfig.load(args.heads)
    name = args.model or config.base_model
    if not name:
        raise SystemExit("error: the heads name no base model; pass --model")
    path = resolve_model(name)
    args.dtype = args.dtype or config.dtype
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype]).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tree = json.loads(args.tree) if args.tree else None
    spec = SpeculativeModel.from_pretrained(args.heads, model=model, device=args.device, tree=tree)
    return model, tokenizer, spec


def cmd_generate(args: argparse.Namespace) -> None:
    model, tokenizer, spec = _load(args)
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
    model, tokenizer, spec = _load(args)
    prompts = load_prompts(args.prompts) if args.prompts else default_prompts(args.num_prompts)
    eos = model.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    n = args.max_new_tokens
    runners = {
        "hf_generate": hf_generate_runner(model, n, eos, pad),
        "plain": speculative_runner(SpeculativeModel(model, NoDraft(args.device)), n, eos),
        spec.proposer.name: speculative_runner(spec, n, eos),
    }
    print(f"benchmarking {len(prompts)} prompts x {n} new tokens, {args.dtype}, {torch.get_num_threads()} threads, "
          f"tree of {spec.proposer.tree.size} nodes", file=sys.stderr)
    result = run_bench(model, tokenizer, runners, prompts)
    result |= {"dtype": args.dtype, "max_new_tokens": n, "threads": torch.get_num_threads(),
               "tree_nodes": spec.proposer.tree.size}
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m infer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--heads", required=True, help="a trained heads directory")
        p.add_argument("--model", help="target model name or path (default: the heads' base_model; `demo` works)")
        p.add_argument("--dtype", choices=list(DTYPES), help="default: the dtype the heads were trained with")
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        p.add_argument("--tree", help='static tree as JSON choices, e.g. "[[0], [1], [0, 0]]"')
        p.add_argument("--max-new-tokens", type=int, default=128)
        p.add_argument("--json", help="write results to this JSON file")

    gen = sub.add_parser("generate", help="stream a completion")
    common(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--quiet", action="store_true", help="do not print the text")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="compare with model.generate on the same prompts")
    common(bench)
    bench.add_argument("--prompts", help='a .jsonl file of {"prompt": ...} (default: demo test-split functions)')
    bench.add_argument("--num-prompts", type=int, default=16)
    bench.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)
