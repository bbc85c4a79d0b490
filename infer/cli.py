"""`selfspec generate | bench | tune | import | export | push | draft-vocab`: speculative decoding and
the checkpoint tools from the command line.

Drafters: trained heads directories (`--heads`, Medusa or EAGLE), a separate small draft model
(`--draft-model`, the seed paper's algorithm) or prompt lookup (`--prompt-lookup`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError

from selfspec.heads.errors import describe, run_main
from selfspec.heads.io import saved_model_files
from selfspec.infer.options import (
    BENCH_PROMPTS,
    DTYPES,
    NUM_DRAFT_TOKENS,
    PROG,
    PROMPT_LOOKUP_TOKENS,
    build_parser,
    output_file,
)

if TYPE_CHECKING:
    from selfspec.heads.config import HeadsConfig
    from selfspec.heads.io import PretrainedHeads
    from selfspec.infer.generate import SpeculativeModel

EAGLE_OPTIONS = {"draft_depth": "depth", "draft_top_k": "draft_top_k", "draft_total_tokens": "total_tokens"}  # kwarg: args dest


def load_pretrained(option: str, name: str, loader: Callable[..., Any], path: str, **kwargs: Any) -> Any:
    """`loader(path, **kwargs)` (a from_pretrained); a model that does not load is one line naming it and why."""
    if path.startswith(("/", ".", "~")) and not Path(path).expanduser().exists():  # a path, not a Hub id
        raise ValueError(f"{option} {name}: no such folder")
    try:
        return loader(path, **kwargs)
    except Exception as e:  # a damaged or mismatched file: whatever the library raised, say which and why
        where = name if name == path else f"{name} ({path})"
        weights = sorted(Path(path).glob("*.safetensors")) if isinstance(e, SafetensorError) else []
        if weights:  # the library's message names no file
            where += f": the weights in {weights[0]}" if len(weights) == 1 else f": one of {len(weights)} weight files"
        raise ValueError(f"{option} {where}: cannot load it: {type(e).__name__}: {describe(e)}") from e


def _drafters(heads_dirs: list[str], device: str, model: str | None) -> list[PretrainedHeads]:
    """Each heads directory or Hub id loaded once (selfspec's layout, or a published checkpoint converted in
    memory for `model` when given), or a clear error."""
    from selfspec.heads.hub import resolve_heads
    from selfspec.heads.registry import load_heads

    drafters = []
    for heads in heads_dirs:
        try:
            heads = resolve_heads(heads)
        except FileNotFoundError as e:
            raise ValueError(f"--heads {e}") from None
        if not Path(heads, "config.json").is_file():
            raise ValueError(f"--heads {heads}: no config.json there (train heads with train/medusa.py or "
                             "train/eagle.py)")
        try:
            drafters.append(load_heads(heads, device, base_model=model))
        except ValueError as e:
            raise ValueError(f"--heads {heads}: {e}") from None
    return drafters


def _eagle_options(args: argparse.Namespace, configs: list[HeadsConfig]) -> dict[str, int | None]:
    """The EAGLE dynamic-tree options given on the command line (None: the heads' defaults)."""
    options = {name: getattr(args, dest) for name, dest in EAGLE_OPTIONS.items()}
    given = ["--" + dest.replace("_", "-") for name, dest in EAGLE_OPTIONS.items() if options[name] is not None]
    if given and args.tree is not None:
        raise ValueError(f"{', '.join(given)} shape EAGLE's dynamic tree and --tree fixes a static one: "
                         "give one or the other")
    if given and not any(c.kind.startswith("eagle") for c in configs):
        kinds = sorted({c.kind for c in configs})
        raise ValueError(f"{', '.join(given)} shape EAGLE's dynamic tree, but the heads are {'/'.join(kinds)} "
                         "heads; use --tree for a static tree")
    return options


def _load(
    args: argparse.Namespace, heads_dirs: list[str], before_weights: Callable[[Any, Any], None] | None = None
) -> tuple[Any, Any, list[SpeculativeModel]]:
    """The target (loaded once), its tokenizer, and one SpeculativeModel per drafter on it: each heads
    directory, then the draft model and prompt lookup when asked for. `before_weights(tokenizer, config)`
    checks what it can before the target's weights load."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from selfspec.heads.target import adapted_target_dir, load_target
    from selfspec.infer.generate import SpeculativeModel
    from selfspec.shipped.models import resolve_model

    drafters = _drafters(heads_dirs, args.device, args.model)
    configs = [drafter.config for drafter in drafters]
    options = _eagle_options(args, configs)
    name = args.model or (configs[0].base_model if configs else "demo")
    if not name:
        raise ValueError(f"--heads {heads_dirs[0]} names no target model (SafeAILab's EAGLE checkpoints never do): "
                         "pass --model, the model it was trained for")
    if not args.model:
        for heads, config in zip(heads_dirs[1:], configs[1:]):
            if config.base_model != name:
                print(f"note: --heads {heads} was trained on {config.base_model or 'an unnamed model'}, "
                      f"benchmarked on {name}", file=sys.stderr)
    adapted = [d for d in drafters if d.config.adapter or d.config.merged_target]
    if adapted and len(drafters) > 1:
        raise ValueError(f"--heads {heads_dirs[drafters.index(adapted[0])]} is a Medusa-2 checkpoint, which decodes "
                         "with its own adapted target: give it alone (bench the other drafters in another run)")
    option = "--model" if args.model else "the heads' base_model"
    path = resolve_model(name)
    if adapted and adapted[0].config.merged_target and not args.model:
        path = str(adapted_target_dir(adapted[0].config, adapted[0].source_dir))
        option, name = "the heads' merged target", path
    tokenizer = load_pretrained(option, name, AutoTokenizer.from_pretrained, path)
    if before_weights is not None:
        before_weights(tokenizer, load_pretrained(option, name, AutoConfig.from_pretrained, path))
    dtype = DTYPES[args.dtype] if args.dtype else DTYPES[configs[0].dtype] if configs else "auto"
    if adapted:
        load = partial(load_pretrained, option, name, AutoModelForCausalLM.from_pretrained)
        model = load_target(adapted[0], args.model, load=load, dtype=dtype)
    else:
        model = load_pretrained(option, name, AutoModelForCausalLM.from_pretrained, path, dtype=dtype)
    model = model.to(args.device).eval()
    args.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    tree = args.tree  # parsed by tree_choices
    specs = []
    for heads, drafter in zip(heads_dirs, drafters):
        kwargs = options if drafter.config.kind.startswith("eagle") else {}
        try:
            specs.append(SpeculativeModel.from_pretrained(drafter, model=model, device=args.device, tree=tree,
                                                          **kwargs))
        except ValueError as e:
            raise ValueError(f"--heads {heads}: {e}") from None
        if getattr(args, "lookup_first", False):
            from selfspec.infer.prompt_lookup import LookupFirst, PromptLookupProposer

            lookup = PromptLookupProposer(args.prompt_lookup_tokens, device=args.device)
            if args.command == "generate":
                specs[-1] = SpeculativeModel(model, LookupFirst(specs[-1].proposer, lookup))
            else:  # bench both ways, each with its own proposer so they share no drafter state
                again = SpeculativeModel.from_pretrained(drafter, model=model, device=args.device, tree=tree,
                                                         **kwargs)
                specs.append(SpeculativeModel(model, LookupFirst(again.proposer, lookup)))
    if args.draft_model:
        specs.append(SpeculativeModel(model, _draft_proposer(args, model)))
    if args.prompt_lookup:
        from selfspec.infer.prompt_lookup import PromptLookupProposer

        specs.append(SpeculativeModel(model, PromptLookupProposer(args.prompt_lookup_tokens, device=args.device)))
    if getattr(args, "compile", False):
        for spec in specs:
            spec.target.compile()
    return model, tokenizer, specs


def _draft_proposer(args: argparse.Namespace, model: Any):
    """The draft-model drafter: `--draft-model` loaded in the target's dtype on its device."""
    from transformers import AutoModelForCausalLM

    from selfspec.infer.draft_model import DraftModelProposer
    from selfspec.shipped.models import resolve_model

    path = resolve_model(args.draft_model)
    draft = load_pretrained("--draft-model", args.draft_model, AutoModelForCausalLM.from_pretrained, path,
                            dtype=next(model.parameters()).dtype)
    try:
        return DraftModelProposer(draft.to(args.device).eval(), args.num_draft_tokens,
                                  model.get_output_embeddings().weight.shape[0])
    except ValueError as e:
        raise ValueError(f"--draft-model {args.draft_model}: {e}") from None


def method_names(specs: list[SpeculativeModel]) -> list[str]:
    """Each drafter's method name: its proposer's name (`medusa2` for Medusa-2 heads, which decode an adapted
    target), numbered from the second of a kind (medusa, medusa#2)."""
    names, seen = [], {}
    for spec in specs:
        config = getattr(getattr(spec.proposer, "heads", None), "config", None)
        adapted = config is not None and (config.adapter or config.merged_target)
        base = "medusa2" if adapted else spec.proposer.name
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return names


def check_drafter_options(args: argparse.Namespace) -> None:
    """Refuse a drafter's option without that drafter (it would be silently ignored), then fill the defaults:
    --lookup-first runs prompt lookup in front of heads, --num-draft-tokens is the draft model's."""
    if args.lookup_first and not args.heads:
        raise ValueError("--lookup-first puts prompt lookup in front of heads: give --heads DIR as well, or use "
                         "--prompt-lookup alone")
    if args.num_draft_tokens is not None and not args.draft_model:
        raise ValueError("--num-draft-tokens is the draft model's proposal length: give --draft-model as well, or "
                         "drop it")
    if args.prompt_lookup_tokens is not None and not (args.prompt_lookup or args.lookup_first):
        raise ValueError("--prompt-lookup-tokens applies to prompt lookup: add --prompt-lookup (or --lookup-first "
                         "with --heads), or drop it")
    args.num_draft_tokens = args.num_draft_tokens or NUM_DRAFT_TOKENS
    args.prompt_lookup_tokens = args.prompt_lookup_tokens or PROMPT_LOOKUP_TOKENS


def cmd_generate(args: argparse.Namespace) -> None:
    from selfspec.infer.arguments import fit_budget, max_positions
    from selfspec.infer.bench import encode_prompt
    from selfspec.infer.generation_config import resolve

    check_drafter_options(args)
    given = sum(map(bool, (args.heads, args.draft_model, args.prompt_lookup)))
    if given != 1:
        raise ValueError("generate takes exactly one drafter: --heads DIR, --draft-model PATH or --prompt-lookup")
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
            print(f"note: --max-new-tokens {args.max_new_tokens} clipped to {budget}: the prompt is {length} tokens "
                  f"and the model takes at most {limit} positions", file=sys.stderr)
            args.max_new_tokens = budget

    model, tokenizer, (spec,) = _load(args, [args.heads] if args.heads else [], fit)
    truncating = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p)) if value is not None]
    # the command line's rule: --temperature above 0 samples, 0 is greedy, none leaves it to the generation config
    do_sample = None if args.temperature is None else args.temperature > 0
    sampling = {k: v for k, v in (("do_sample", do_sample), ("temperature", args.temperature or None),
                                  ("top_k", args.top_k), ("top_p", args.top_p)) if v is not None}
    if truncating and resolve(model.generation_config, **sampling).params.temperature == 0:
        why = "--temperature 0" if args.temperature == 0 else "no --temperature, and the model's generation_config " \
              "does not sample"
        raise ValueError(f"{' and '.join(truncating)} only apply when sampling, but this run is greedy ({why}): add "
                         "--temperature T above 0, or drop them")
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
    print(f"[{stats.new_tokens} tokens, {stats.target_forwards} target forwards, tau {stats.tau:.2f}]", file=sys.stderr)
    if args.json:
        record = {"token_ids": token_ids, "text": "".join(pieces), "stats": stats.as_dict()}
        Path(args.json).write_text(json.dumps(record, indent=2))


def cmd_bench(args: argparse.Namespace) -> None:
    from selfspec.infer.arguments import max_positions
    from selfspec.infer.bench import (
        check_plot_file,
        default_prompts,
        encode_prompt,
        format_tables,
        hf_runner,
        load_prompts,
        plot_bench,
        render_prompts,
        run_bench,
        speculative_runner,
    )
    from selfspec.infer.generate import SpeculativeModel
    from selfspec.infer.proposers import NoDraft

    # everything that can fail without the model fails before it loads
    check_drafter_options(args)
    if args.plot:
        check_plot_file(args.plot)
    output_file("--json", args.json)
    output_file("--plot", args.plot)
    prompts = load_prompts(args.prompts)[: args.num_prompts] if args.prompts else default_prompts(
        args.num_prompts or BENCH_PROMPTS)
    n = args.max_new_tokens
    sizes = args.batch_size
    if len(set(sizes)) < len(sizes):
        raise ValueError(f"--batch-size {' '.join(map(str, sizes))}: give each batch size once")
    if max(sizes) > len(prompts):
        raise ValueError(f"--batch-size {max(sizes)} is more than the {len(prompts)} prompts: give at least "
                         f"{max(sizes)} prompts (--num-prompts or --prompts) or a smaller batch size")
    if args.plot and len(sizes) > 1:
        raise ValueError(f"--plot draws the run of one batch size, and --batch-size gives {len(sizes)}: give one "
                         "--batch-size, or leave out --plot")

    def fit(tokenizer: Any, config: Any) -> None:
        """Every prompt + --max-new-tokens must fit the model's positions: a benchmark compares equal work."""
        prompts[:] = render_prompts(prompts, tokenizer)
        limit = max_positions(config)
        lengths = [encode_prompt(tokenizer, p).shape[1] for p in prompts]
        over = [length for length in lengths if length + n > limit] if limit else []
        if over:
            fix = f"lower --max-new-tokens to {limit - max(lengths)} or use" if max(lengths) < limit else "use"
            raise ValueError(f"{len(over)} of {len(prompts)} prompts (the longest {max(over)} tokens) + "
                             f"--max-new-tokens {n} exceed the model's {limit} positions: {fix} shorter prompts")

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, specs = _load(args, args.heads or [], fit)
    eos = model.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    runners = {
        "hf_generate": hf_runner(model, n, eos, pad),
        "plain": speculative_runner(SpeculativeModel(model, NoDraft(args.device), compile=args.compile), n, eos, pad),
    }
    # transformers' own speculative decoding next to ours, with the same draft model / lookup length
    draft = next((s.proposer.draft.model for s in specs if s.proposer.name == "draft_model"), None)
    if draft is not None:
        runners["hf_assisted"] = hf_runner(model, n, eos, pad, assistant_model=draft)
    if args.prompt_lookup:
        runners["hf_prompt_lookup"] = hf_runner(model, n, eos, pad, prompt_lookup_num_tokens=args.prompt_lookup_tokens)
    tree_nodes = {}
    for name, spec in zip(method_names(specs), specs):
        runners[name] = speculative_runner(spec, n, eos, pad)
        tree_nodes[name] = spec.proposer.max_nodes
    trees = ", ".join(f"{name} {size}" for name, size in tree_nodes.items())
    batches = f"batch size{'s' if len(sizes) > 1 else ''} {', '.join(map(str, sizes))}"
    print(f"benchmarking {len(prompts)} prompts x {n} new tokens, {batches}, {args.dtype}, {torch.get_num_threads()} "
          f"threads, trees of at most {trees or 'no'} nodes", file=sys.stderr)
    batch_one = [name for name in ("hf_assisted", "hf_prompt_lookup") if name in runners]
    larger = [size for size in sizes if size > 1]
    if batch_one and larger:
        sizes_s = f"size{'s' if len(larger) > 1 else ''} {', '.join(map(str, larger))}"
        print(f"note: {' and '.join(batch_one)} skipped at batch {sizes_s}: transformers' assisted generation takes "
              "one prompt at a time", file=sys.stderr)
    chains = frozenset(name for name in tree_nodes if name.split("-")[0] in ("draft_model", "prompt_lookup"))
    results = {}
    for size in sizes:
        chosen = {name: run for name, run in runners.items() if size == 1 or name not in batch_one}
        results[size] = run_bench(model, tokenizer, chosen, prompts, chains=chains, batch_size=size, pad_token_id=pad)
    print(format_tables(results))
    if args.latency:
        from selfspec.infer.bench import format_latency, latency_report

        for size in sizes:  # after the decoding: its timings are not disturbed by these
            report = latency_report(model, results[size], tree_nodes, batch_size=size)
            results[size]["latency"] = report
            print(f"\nbatch size {size}: " + format_latency(report))
    shared = {"dtype": args.dtype, "max_new_tokens": n, "threads": torch.get_num_threads(), "tree_nodes": tree_nodes}
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
    from selfspec.infer.bench import load_prompts
    from selfspec.shipped.stdlib_corpus import stdlib_texts

    if path:
        return load_prompts(path)[:count]
    texts = [t for t in stdlib_texts("validation") if len(t) > 400]
    return texts[:: max(1, len(texts) // count)][:count]


def calibration_prompts(tokenizer, texts: list[Any], length: int | None = 32) -> list[torch.Tensor]:
    """The first `length` tokens of each calibration text (all of them with None, as for a prompts file: a chat
    rendered by its template is mostly system prompt in its first 32 tokens)."""
    from selfspec.infer.bench import encode_prompt, render_prompts

    return [encode_prompt(tokenizer, t)[0, :length] for t in render_prompts(texts, tokenizer)]


def cmd_tune(args: argparse.Namespace) -> None:
    from selfspec.heads.io import atomic_write
    from selfspec.heads.registry import is_published
    from selfspec.infer.eagle import EagleProposer
    from selfspec.infer.tune import eagle_grid, format_rows, format_tree_rows, tune_eagle, tune_medusa

    if not Path(args.heads, "config.json").is_file():
        raise ValueError(f"--heads {args.heads}: tune stores its result in a local heads directory; "
                         "download Hub heads first (huggingface-cli download ID --local-dir DIR)")
    if is_published(args.heads):
        raise ValueError(f"--heads {args.heads}: tune stores its result in the heads' config.json, and this one is "
                         f"a published checkpoint's: write it in selfspec's layout first (selfspec import "
                         f"--src {args.heads} --out DIR)")
    texts = calibration_texts(args.prompts, args.num_prompts)  # a bad --prompts file fails before the model loads
    model, tokenizer, (spec,) = _load(args, [args.heads])
    prompts = [p.to(args.device) for p in calibration_prompts(tokenizer, texts, None if args.prompts else 32)]
    proposer = spec.proposer
    config = proposer.draft.config if isinstance(proposer, EagleProposer) else proposer.heads.config
    print(f"measuring on {len(prompts)} calibration prompts, batch size {args.batch_size}, {args.dtype}, "
          f"{torch.get_num_threads()} threads", file=sys.stderr)
    if isinstance(proposer, EagleProposer):
        best, rows = tune_eagle(model, proposer.draft, prompts, eagle_grid(), args.max_new_tokens, args.batch_size)
        print("EAGLE dynamic tree, measured by greedy decoding (tau, 20th-percentile step time):")
        print(format_rows(rows, best))
        config.depth, config.top_k, config.total_tokens = best["depth"], best["top_k"], best["total_tokens"]
        chosen = f"depth {config.depth}, top_k {config.top_k}, total_tokens {config.total_tokens}"
    else:
        choices, rows, accuracy = tune_medusa(model, proposer.heads, prompts, batch_size=args.batch_size)
        print("Medusa heads' top-1..3 accuracy on the target's own continuations:")
        for k, row in enumerate(accuracy.tolist()):
            print(f"  head {k}: " + " ".join(f"{a:.3f}" for a in row[:3]))
        print("static tree by size (target forward time here x expected accepted tokens):")
        print(format_tree_rows(rows, choices))
        config.tree = choices
        chosen = f"a {len(choices) + 1}-node tree"
    atomic_write(Path(args.heads, "config.json"), lambda tmp: Path(tmp).write_text(config.to_json()))
    print(f"stored {chosen} as the default in {args.heads}/config.json (the most tokens per second measured here, "
          f"at batch size {args.batch_size})")


def refuse_to_overwrite(out: str) -> None:
    """A checkpoint already in `out` (trained heads, an earlier export) is never written over: a mix of two
    checkpoints' files would load as neither. A path that cannot become a folder fails here, before any work."""
    blocked = next((p for p in (Path(out), *Path(out).parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ValueError(f"--out {out}: {blocked} is a file, not a folder: give a folder path")
    held = saved_model_files(Path(out))
    if held:
        raise ValueError(f"--out {out} already holds a checkpoint ({', '.join(held)}): write to a new folder, or "
                         "delete it first")


def cmd_import(args: argparse.Namespace) -> None:
    from selfspec.heads.convert import import_heads

    refuse_to_overwrite(args.out)
    heads = import_heads(args.src, args.format, base_model=args.base_model, vocab_size=args.vocab_size)
    heads.save_pretrained(args.out)
    print(f"imported {heads.config.kind} heads from {args.src} into {args.out}")


def cmd_export(args: argparse.Namespace) -> None:

    from selfspec.heads.config import check_compatible
    from selfspec.heads.convert import export_heads
    from selfspec.heads.registry import load_heads
    from selfspec.heads.target import load_target

    refuse_to_overwrite(args.out)
    heads = load_heads(args.heads, base_model=args.model or args.base_model)
    target = None
    name = args.model or args.base_model or heads.config.base_model
    adapted = heads.config.adapter or heads.config.merged_target
    if adapted:
        print(f"note: {args.heads} are Medusa-2 heads: serve them with their adapted target (train with --merge true "
              "and serve its target/ folder, or merge the adapter into the base with peft), not the original model",
              file=sys.stderr)
    if name or adapted:  # the target supplies weights some layouts carry (a shared lm_head, the EAGLE embedding);
        try:  # a Medusa-2 checkpoint's adapted target supplies its adapted lm_head
            target = load_target(heads, args.model or (None if adapted else args.base_model),
                                 dtype=getattr(torch, heads.config.dtype))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load the target {name!r} ({' '.join(str(e).split())}): pass --model, a "
                             "local model directory or a Hub id (and --base-model for what config.json should "
                             "name)") from None
        check_compatible(heads.config, target)
    export_heads(heads, args.format, args.out, target, base_model=args.base_model, weights=args.weights)
    print(f"exported {args.heads} as {args.format} into {args.out}")


def cmd_draft_vocab(args: argparse.Namespace) -> None:
    """Restrict an EAGLE-1/2 drafter to a dataset's most frequent tokens, or to a published FR-Spec token map
    (frequency-ranked drafting): each draft call then reads only those rows of the lm_head. No training; the
    drafter's weights are unchanged and verification keeps the output exact."""
    refuse_to_overwrite(args.out)
    [heads] = _drafters([args.heads], "cpu", args.model)
    config = heads.config
    if config.kind != "eagle":
        why = ("EAGLE-3 drafters learn their vocabulary's projection in training: set it with train/eagle.py "
               "--draft_vocab_size" if config.kind == "eagle3" else "Medusa heads draft over the whole vocabulary")
        raise ValueError(f"--heads {args.heads} are {config.kind} heads; draft-vocab restricts EAGLE-1/2 "
                         f"drafters ({why})")
    from selfspec.infer.tree import choices_width

    widest = max(config.top_k, choices_width(config.tree))
    if args.token_map:
        ids, summary = _token_map_ids(args.token_map, config.vocab_size, args.size, widest)
    else:
        ids, summary = _frequent_ids(args, config, widest)
    restricted = heads.with_draft_vocab(ids)
    restricted.config.base_model = config.base_model or args.model or ""
    restricted.save_pretrained(args.out)
    print(f"wrote {args.out}: drafting among {ids.numel()} of {config.vocab_size} tokens, {summary}")


def _token_map_ids(path: str, vocab: int, size: int | None, widest: int) -> tuple[torch.Tensor, str]:
    """The target ids of an FR-Spec / SGLang token map (a torch-saved list or tensor of token ids, most frequent
    first), its first `size` when given; at least `widest`, the tokens the drafter's tree takes per node."""
    from selfspec.heads.eagle_formats import read_token_map

    ids = read_token_map(path, vocab)[:size]
    if ids.numel() < widest:
        raise ValueError(f"--token-map {path} holds {ids.numel()} tokens, fewer than the drafter's tree takes per "
                         f"node ({widest}, its top_k or static tree)")
    return ids, f"from {path}"


def _frequent_ids(args: argparse.Namespace, config: HeadsConfig, widest: int) -> tuple[torch.Tensor, str]:
    """The `--size` most frequent trained-on tokens of `--dataset`, read with the target's tokenizer (checked to
    fit the drafter before any counting), and what share of the dataset's tokens they cover."""
    from transformers import AutoConfig, AutoTokenizer

    from selfspec.shipped.models import resolve_model
    from selfspec.train.data import DataError, load_examples
    from selfspec.train.eagle import default_draft_vocab_size
    from selfspec.train.eagle3 import most_frequent, token_counts

    if not args.dataset:
        raise ValueError("give --dataset (data like the target's traffic, whose most frequent tokens are kept) or "
                         "--token-map (a published FR-Spec token map)")
    vocab = config.vocab_size
    size = args.size or default_draft_vocab_size(vocab)
    if size >= vocab:
        raise ValueError(f"--size {size} must be below the target's vocabulary size ({vocab})" if args.size else
                         f"the target's vocabulary has only {vocab} tokens, at most the default size {size}: "
                         f"give a --size below {vocab}")
    if size < widest:
        raise ValueError(f"--size {size} is fewer tokens than the drafter's tree takes per node ({widest}, its top_k "
                         "or static tree): give a --size of at least that")
    name = args.model or config.base_model
    if not name:
        raise ValueError(f"--heads {args.heads} names no target model: pass --model, whose tokenizer reads --dataset")
    option = "--model" if args.model else "the heads' base_model"
    target = load_pretrained(option, name, AutoConfig.from_pretrained, resolve_model(name)).get_text_config()
    tokenizer = load_pretrained(option, name, AutoTokenizer.from_pretrained, resolve_model(name))
    if target.hidden_size != config.hidden_size or len(tokenizer) > vocab:
        raise ValueError(f"{option} {name} does not fit the drafter (hidden size {target.hidden_size} vs "
                         f"{config.hidden_size}, {len(tokenizer)} tokenizer tokens vs {vocab}): give the model it "
                         "was trained for")
    try:
        examples = load_examples(args.dataset, tokenizer, args.max_length)
    except DataError as e:
        raise ValueError(f"--dataset {args.dataset}: {str(e).replace('--max_length', '--max-length')}") from None
    counts = token_counts(examples.token_batches(), vocab)
    seen = int((counts > 0).sum())
    if seen < size:  # the rest would be arbitrary ids, not frequent ones
        raise ValueError(f"--dataset {args.dataset} holds only {seen} distinct trained-on tokens, fewer than --size "
                         f"{size}: give more data like the target's traffic, or a --size of at most {seen}")
    ids = most_frequent(counts, size)
    covered = counts[ids].sum().item() / counts.sum().item()
    return ids, f"which are {100 * covered:.2f}% of the {counts.sum().item()} trained-on tokens in {args.dataset}"


def cmd_push(args: argparse.Namespace) -> None:
    from selfspec.heads.hub import push_to_hub

    url = push_to_hub(args.heads, args.repo_id, private=args.private or None, token=args.token)
    print(f"pushed {args.heads} to {url}")


def cmd_recipes(args: argparse.Namespace) -> None:
    """The shipped configs' folder (`accelerate launch --config_file "$(selfspec recipes)/accelerate/ddp.yaml"`),
    or a copy of them to edit."""
    import shutil

    from selfspec.train.config import RECIPES

    if args.copy is None:
        print(RECIPES)
        return
    out = Path(args.copy)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--copy {out}: the folder is not empty; give a new folder")
    shutil.copytree(RECIPES, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    print(f"copied the recipes into {out}")


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "tune": cmd_tune, "import": cmd_import,
            "export": cmd_export, "push": cmd_push, "draft-vocab": cmd_draft_vocab,
            "recipes": cmd_recipes}


def main(argv: list[str] | None = None, prog: str = PROG) -> None:
    """The command line: a user error ends in one `error: ...` line and exit status 2 (`--debug`: the traceback)."""
    def run(args: list[str]) -> None:
        parsed = build_parser(prog).parse_args(args)
        COMMANDS[parsed.command](parsed)

    run_main(run, argv, prog=prog)

