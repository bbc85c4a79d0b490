"""`python -m infer generate | bench`: speculative decoding from the command line.

Drafters: trained heads directories (`--heads`, Medusa or EAGLE), a separate small draft model
(`--draft-model`, the seed paper's algorithm) or prompt lookup (`--prompt-lookup`).
"""

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
    from heads.hub import resolve_heads

    configs = []
    for heads in heads_dirs:
        try:
            heads = resolve_heads(heads)
        except FileNotFoundError as e:
            raise SystemExit(f"error: --heads {e}") from None
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
    """The target (loaded once), its tokenizer, and one SpeculativeModel per drafter on it: each heads
    directory, then the draft model and prompt lookup when asked for."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infer.generate import SpeculativeModel
    from shipped.models import resolve_model

    configs = _configs(heads_dirs)
    options = _eagle_options(args, configs)
    name = args.model or (configs[0].base_model if configs else "demo")
    if not name:
        raise SystemExit("error: the heads name no base model; pass --model")
    if not args.model:
        for heads, config in zip(heads_dirs[1:], configs[1:]):
            if config.base_model != name:
                print(f"note: --heads {heads} was trained on {config.base_model or 'an unnamed model'}, "
                      f"benchmarked on {name}", file=sys.stderr)
    path = resolve_model(name)
    dtype = DTYPES[args.dtype] if args.dtype else DTYPES[configs[0].dtype] if configs else "auto"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
    args.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
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
        if getattr(args, "lookup_first", False):
            from infer.prompt_lookup import LookupFirst, PromptLookupProposer

            lookup = PromptLookupProposer(args.prompt_lookup_tokens, device=args.device)
            if args.command == "generate":
                specs[-1] = SpeculativeModel(model, LookupFirst(specs[-1].proposer, lookup))
            else:  # bench both ways, each with its own proposer so they share no drafter state
                again = SpeculativeModel.from_pretrained(heads, model=model, device=args.device, tree=tree, **kwargs)
                specs.append(SpeculativeModel(model, LookupFirst(again.proposer, lookup)))
    if args.draft_model:
        specs.append(SpeculativeModel(model, _draft_proposer(args, model)))
    if args.prompt_lookup:
        from infer.prompt_lookup import PromptLookupProposer

        specs.append(SpeculativeModel(model, PromptLookupProposer(args.prompt_lookup_tokens, device=args.device)))
    return model, tokenizer, specs


def _draft_proposer(args: argparse.Namespace, model: Any):
    """The draft-model drafter: `--draft-model` loaded in the target's dtype on its device."""
    from transformers import AutoModelForCausalLM

    from infer.draft_model import DraftModelProposer
    from shipped.models import resolve_model

    try:
        path = resolve_model(args.draft_model)
        draft = AutoModelForCausalLM.from_pretrained(path, dtype=next(model.parameters()).dtype).to(args.device).eval()
        return DraftModelProposer(draft, args.num_draft_tokens, model.get_output_embeddings().weight.shape[0])
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --draft-model {args.draft_model}: {e}") from None


def method_names(specs: list[SpeculativeModel]) -> list[str]:
    """Each drafter's method name: its proposer's name, numbered from the second of a kind (medusa, medusa-2)."""
    names, seen = [], {}
    for spec in specs:
        base = spec.proposer.name
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}-{seen[base]}")
    return names


def cmd_generate(args: argparse.Namespace) -> None:
    given = sum(map(bool, (args.heads, args.draft_model, args.prompt_lookup)))
    if given != 1:
        raise SystemExit("error: generate takes exactly one drafter: --heads DIR, --draft-model PATH or --prompt-lookup")
    model, tokenizer, (spec,) = _load(args, [args.heads] if args.heads else [])
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
        hf_runner,
        load_prompts,
        plot_bench,
        run_bench,
        speculative_runner,
    )
    from infer.generate import SpeculativeModel
    from infer.proposers import NoDraft

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, specs = _load(args, args.heads or [])
    prompts = load_prompts(args.prompts) if args.prompts else default_prompts(args.num_prompts)
    eos = model.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    n = args.max_new_tokens
    runners = {
        "hf_generate": hf_runner(model, n, eos, pad),
        "plain": speculative_runner(SpeculativeModel(model, NoDraft(args.device)), n, eos),
    }
    # transformers' own speculative decoding next to ours, with the same draft model / lookup length
    draft = next((s.proposer.draft.model for s in specs if s.proposer.name == "draft_model"), None)
    if draft is not None:
        runners["hf_assisted"] = hf_runner(model, n, eos, pad, assistant_model=draft)
    if args.prompt_lookup:
        runners["hf_prompt_lookup"] = hf_runner(model, n, eos, pad, prompt_lookup_num_tokens=args.prompt_lookup_tokens)
    tree_nodes = {}
    for name, spec in zip(method_names(specs), specs):
        runners[name] = speculative_runner(spec, n, eos)
        tree_nodes[name] = spec.proposer.max_nodes
    trees = ", ".join(f"{name} {size}" for name, size in tree_nodes.items())
    print(f"benchmarking {len(prompts)} prompts x {n} new tokens, {args.dtype}, {torch.get_num_threads()} threads, "
          f"trees of at most {trees or 'no'} nodes", file=sys.stderr)
    chains = frozenset(name for name in tree_nodes if name.split("-")[0] in ("draft_model", "prompt_lookup"))
    result = run_bench(model, tokenizer, runners, prompts, chains=chains)
    result |= {"dtype": args.dtype, "max_new_tokens": n, "threads": torch.get_num_threads(), "tree_nodes": tree_nodes}
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot_bench(result, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)


def calibration_prompts(tokenizer, path: str | None, count: int, length: int = 32) -> list[torch.Tensor]:
    """Prompts to measure acceptance on: a .jsonl of {"prompt": ...}, else openings of files from the
    demo corpus's validation split (never trained on)."""
    from infer.bench import load_prompts
    from shipped.stdlib_corpus import stdlib_texts

    if path:
        texts = load_prompts(path)[:count]
    else:
        texts = [t for t in stdlib_texts("validation") if len(t) > 400]
        texts = texts[:: max(1, len(texts) // count)][:count]
    return [tokenizer(t, return_tensors="pt").input_ids[0, :length] for t in texts]


def cmd_tune(args: argparse.Namespace) -> None:
    from heads.io import atomic_write
    from infer.eagle import EagleProposer
    from infer.tune import eagle_grid, format_rows, tune_eagle, tune_medusa

    if not Path(args.heads, "config.json").is_file():
        raise SystemExit(f"error: --heads {args.heads}: tune stores its result in a local heads directory; "
                         "download Hub heads first (huggingface-cli download ID --local-dir DIR)")
    model, tokenizer, (spec,) = _load(args, [args.heads])
    prompts = [p.to(args.device) for p in calibration_prompts(tokenizer, args.prompts, args.num_prompts)]
    proposer = spec.proposer
    config = proposer.draft.config if isinstance(proposer, EagleProposer) else proposer.heads.config
    print(f"measuring on {len(prompts)} calibration prompts, {args.dtype}, {torch.get_num_threads()} threads",
          file=sys.stderr)
    if isinstance(proposer, EagleProposer):
        best, rows = tune_eagle(model, proposer.draft, prompts, eagle_grid(), args.max_new_tokens)
        print("EAGLE dynamic tree, measured by greedy decoding (tau, median step time):")
        print(format_rows(rows, best))
        config.depth, config.top_k, config.total_tokens = best["depth"], best["top_k"], best["total_tokens"]
        chosen = f"depth {config.depth}, top_k {config.top_k}, total_tokens {config.total_tokens}"
    else:
        choices, rows, accuracy = tune_medusa(model, proposer.heads, prompts)
        print("Medusa heads' top-1..3 accuracy on the target's own continuations:")
        for k, row in enumerate(accuracy.tolist()):
            print(f"  head {k}: " + " ".join(f"{a:.3f}" for a in row[:3]))
        print("static tree by size (target forward time here x expected accepted tokens):")
        for r in rows:
            mark = " <- chosen" if r["choices"] == choices else ""
            print(f"  {r['nodes']:3d} nodes: {r['ms']:6.2f} ms/forward, {r['tokens_per_step']:.2f} tokens/step, "
                  f"{r['tokens_per_s']:7.1f} tokens/s{mark}")
        config.tree = choices
        chosen = f"a {len(choices) + 1}-node tree"
    atomic_write(Path(args.heads, "config.json"), lambda tmp: Path(tmp).write_text(config.to_json()))
    print(f"stored {chosen} as the default in {args.heads}/config.json (the most tokens per second measured here)")


def cmd_import(args: argparse.Namespace) -> None:
    from heads.convert import import_heads

    try:
        heads = import_heads(args.src, args.format, base_model=args.base_model)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    heads.save_pretrained(args.out)
    print(f"imported {heads.config.kind} heads from {args.src} into {args.out}")


def cmd_export(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    from heads.config import check_compatible
    from heads.convert import export_heads
    from heads.registry import load_heads
    from shipped.models import resolve_model

    heads = load_heads(args.heads)
    target = None
    name = args.model or heads.config.base_model
    if name:  # the target supplies weights some layouts carry (a shared lm_head, EAGLE-1's embedding)
        target = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=getattr(torch, heads.config.dtype))
        check_compatible(heads.config, target)
    try:
        export_heads(heads, args.format, args.out, target)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"exported {args.heads} as {args.format} into {args.out}")


def cmd_push(args: argparse.Namespace) -> None:
    from heads.hub import push_to_hub

    try:
        url = push_to_hub(args.heads, args.repo_id, private=args.private or None, token=args.token)
    except FileNotFoundError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"pushed {args.heads} to {url}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m infer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, several: bool) -> None:
        if several:
            p.add_argument("--heads", action="append",
                           help="a trained heads directory (Medusa or EAGLE); repeat it to compare several drafters "
                                "of one target in the same run")
        else:
            p.add_argument("--heads", help="a trained heads directory (Medusa or EAGLE)")
        p.add_argument("--draft-model", help="a small causal LM with the target's tokenizer drafts chains (the seed "
                                             "paper's algorithm); `demo-draft` is the shipped one")
        p.add_argument("--num-draft-tokens", type=int, default=4, help="gamma: tokens the draft model proposes per step")
        p.add_argument("--prompt-lookup", action="store_true",
                       help="draft the continuation of the latest earlier match of the context's last n-gram")
        p.add_argument("--prompt-lookup-tokens", type=int, default=10, help="longest prompt-lookup proposal")
        p.add_argument("--lookup-first", action="store_true",
                       help="with --heads: use prompt lookup on steps where it finds 3 or more tokens, the heads "
                            "elsewhere (bench runs each heads drafter both ways)")
        p.add_argument("--model", help="target model name or path (default: the (first) heads' base_model, or `demo`)")
        p.add_argument("--dtype", choices=list(DTYPES),
                       help="default: the dtype the (first) heads were trained with, else the model's own")
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
    bench.add_argument("--plot", help="draw tokens/s, tau and tokens per step per method into this PNG")
    bench.set_defaults(func=cmd_bench)

    tune = sub.add_parser("tune", help="fit the heads' default tree to this machine and store it in their config.json")
    tune.add_argument("--heads", required=True, help="a trained heads directory (Medusa or EAGLE)")
    tune.add_argument("--model", help="target model name or path (default: the heads' base_model)")
    tune.add_argument("--dtype", choices=list(DTYPES), help="default: the dtype the heads were trained with")
    tune.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    tune.add_argument("--prompts", help='calibration .jsonl of {"prompt": ...} (default: the demo validation split)')
    tune.add_argument("--num-prompts", type=int, default=6)
    tune.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded per prompt and EAGLE setting")
    from heads.convert import EXPORT_FORMATS

    imp = sub.add_parser("import", help="convert a published Medusa/EAGLE checkpoint into a selfspec heads directory")
    imp.add_argument("--src", required=True, help="the checkpoint's directory (layout detected from its files)")
    imp.add_argument("--format", choices=EXPORT_FORMATS, help="the layout, when detection should be overridden")
    imp.add_argument("--base-model", help="the target it was trained for (default: what its config names)")
    imp.add_argument("--out", required=True)
    imp.set_defaults(func=cmd_import)

    exp = sub.add_parser("export", help="write heads in the layout a serving engine loads")
    exp.add_argument("--heads", required=True, help="a selfspec heads directory or Hub id")
    exp.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    exp.add_argument("--model", help="the target, when a layout needs its weights (default: the heads' base_model)")
    exp.add_argument("--out", required=True)
    exp.set_defaults(func=cmd_export)

    push = sub.add_parser("push", help="upload a heads directory to the Hugging Face Hub with a model card")
    push.add_argument("--heads", required=True, help="a heads directory (config.json + model.safetensors)")
    push.add_argument("--repo-id", required=True, help="e.g. your-name/llama3-8b-medusa")
    push.add_argument("--private", action="store_true")
    push.add_argument("--token", help="a Hub token (default: HF_TOKEN or the saved login); never printed")
    push.set_defaults(func=cmd_push)

    tune.set_defaults(func=cmd_tune, tree=None, draft_model=None, prompt_lookup=False, depth=None, draft_top_k=None,
                      total_tokens=None)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)
