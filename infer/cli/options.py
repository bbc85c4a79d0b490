"""The command line's options: the parser, and argparse types that check each value as it is read.

Every option is validated here, before any model loads; infer/cli/commands.py runs the commands. Nothing here
imports torch until a value is checked, so `selfspec --help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import selfspec
from selfspec.heads.errors import describe

PROG = "selfspec"
DESCRIPTION = (
    "Speculative decoding from the command line: generate, bench, tune, import, export, push.\n"
    "\n"
    "Drafters: trained drafter directories (--heads: Medusa, EAGLE, EAGLE-3, P-EAGLE, DFlash, fine-tuned MTP "
    "layers), the\n"
    "target's own MTP layers (--mtp), a separate small draft model (--draft-model, the seed paper's "
    "algorithm) or prompt\n"
    "lookup (--prompt-lookup)."
)
NUM_DRAFT_TOKENS = 4  # a draft model's proposal length when --num-draft-tokens is not given
PROMPT_LOOKUP_TOKENS = 10  # prompt lookup's longest proposal when --prompt-lookup-tokens is not given
DEVICE_HELP = "a torch device: cpu, cuda, cuda:1, mps (default: cuda where there is one, else cpu)"
BENCH_PROMPTS = 16  # built-in prompts bench decodes when neither --num-prompts nor --prompts is given
DTYPES = ("float32", "bfloat16", "float16")  # --dtype's choices: names of torch dtypes


class Parser(argparse.ArgumentParser):
    """argparse reporting a usage error in one line, like every other error here (the usage is one --help
    away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class Command(NamedTuple):
    """One command of the command line: `add(subparsers)` adds its parser and options, `run(args)` runs it."""

    add: Callable[[argparse._SubParsersAction], argparse.ArgumentParser]
    run: Callable[[argparse.Namespace], None]


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= low."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    return parse


def sampling(field: str, cast: type) -> Callable[[str], Any]:
    """An argparse type: a value of `field` that SamplingParams accepts (the library's rule, stated once)."""

    def parse(text: str) -> Any:
        from selfspec.infer.core.verify import SamplingParams

        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        try:
            SamplingParams(**{field: value})
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    return parse


def tree_choices(text: str) -> list[list[int]]:
    """An argparse type: a static tree as JSON choices, one path of ranks per node."""
    example = "e.g. --tree '[[0], [1], [0, 0]]'"
    try:
        choices = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}); {example}") from None
    ok = isinstance(choices, list) and all(
        isinstance(path, list) and path and all(type(r) is int and r >= 0 for r in path) for path in choices
    )
    if not ok:
        raise argparse.ArgumentTypeError(f"expected a list of paths of ranks >= 0, got {text!r}; {example}")
    if not choices:
        raise argparse.ArgumentTypeError(f"the tree has no node, so nothing would be drafted; {example}")
    repeated = sorted({str(p) for i, p in enumerate(choices) if p in choices[:i]})
    if repeated:
        raise argparse.ArgumentTypeError(
            f"the tree lists {', '.join(repeated)} more than once; give each path once"
        )
    return choices


def device(text: str) -> str:
    """An argparse type: a torch device that this machine has; `auto` (the default, which argparse passes
    through here only when --device is not given) is cuda where there is one, else cpu."""
    import torch

    from selfspec.infer.core.arguments import unavailable_device

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if (why := unavailable_device(text)) is not None:
        raise argparse.ArgumentTypeError(why.replace("use cpu", "use --device cpu"))
    return text


def output_file(option: str, path: str | None) -> None:
    """Make an output file's folder now, before any work, so a run never ends unable to save its result;
    a path that is a folder, or a folder that cannot be made or written to, is an error now."""
    if path is None:
        return
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{option} {path} is a folder: give a file path in it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{option} {path}: cannot create its folder ({describe(e)})") from None
    if not os.access(out.parent, os.W_OK):
        raise ValueError(f"{option} {path}: the folder {out.parent} is not writable")


def build_parser(commands: dict[str, Command], prog: str = PROG) -> argparse.ArgumentParser:
    """The command line of these commands, listed in this order (each `Command.add` adds its own)."""
    parser = Parser(prog=prog, description=DESCRIPTION)
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an error instead of one line (also: SELFSPEC_DEBUG=1)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {selfspec.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in commands.values():
        command.add(sub)
    return parser


def drafter_options(p: argparse.ArgumentParser, several: bool) -> None:
    """generate's and bench's options: the drafters (`several`: --heads repeats), the target, the run."""
    if several:
        p.add_argument(
            "--heads",
            action="append",
            help="a trained drafter directory (Medusa, EAGLE, EAGLE-3, P-EAGLE, DFlash or MTP); repeat it "
            "to compare several drafters of one target in the same run",
        )
    else:
        p.add_argument(
            "--heads", help="a trained drafter directory (Medusa, EAGLE, EAGLE-3, P-EAGLE, DFlash or MTP)"
        )
    p.add_argument(
        "--mtp",
        action="store_true",
        help="draft with the target's own multi-token-prediction layers (DeepSeek-V3, GLM-4.5 and the "
        "other configs with num_mtp_layers), read from its checkpoint; fine-tuned ones are a --heads "
        "folder (train/mtp.py)",
    )
    p.add_argument(
        "--draft-model",
        help="a small causal LM with the target's tokenizer drafts chains (the seed "
        "paper's algorithm); `demo-draft` is the shipped one",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=at_least(1),
        default=None,
        help=f"with --draft-model: gamma, tokens the draft model proposes per step ({NUM_DRAFT_TOKENS})",
    )
    p.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="draft the continuation of the latest earlier match of the context's last n-gram",
    )
    p.add_argument(
        "--prompt-lookup-tokens",
        type=at_least(1),
        default=None,
        help=f"with --prompt-lookup or --lookup-first: longest proposal ({PROMPT_LOOKUP_TOKENS})",
    )
    p.add_argument(
        "--lookup-first",
        action="store_true",
        help="with --heads: use prompt lookup on steps where it finds 3 or more tokens, the heads "
        "elsewhere (bench runs each heads drafter both ways)",
    )
    p.add_argument(
        "--model", help="target model name or path (default: the (first) heads' base_model, or `demo`)"
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="default: the dtype the (first) heads were trained with, else the model's own",
    )
    p.add_argument("--device", type=device, default="auto", help=DEVICE_HELP)
    p.add_argument(
        "--tree",
        type=tree_choices,
        help='static tree as JSON choices, e.g. "[[0], [1], [0, 0]]" (for EAGLE heads: '
        "EAGLE-1 style instead of the dynamic tree)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=at_least(1),
        default=128,
        help="new tokens per prompt (clipped to the model's positions)",
    )
    p.add_argument("--json", help="write results to this JSON file (its folder is made if missing)")
    p.add_argument(
        "--compile",
        nargs="?",
        const="default",
        default=None,
        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
        help="verify trees through torch.compile in this mode (default: torch.compile's default; "
        "reduce-overhead: CUDA graphs on CUDA); fixed shapes, the first steps pay the compilation",
    )


def refused(why: str) -> Callable[[str], NoReturn]:
    """An argparse type for an option kept only to say, in one line, what to use instead."""

    def check(text: str) -> NoReturn:
        raise argparse.ArgumentTypeError(why)

    return check


def eagle_tree_options(p: argparse.ArgumentParser, top_k_flags: list[str], note: str) -> None:
    """The EAGLE dynamic tree's options, `top_k_flags` naming its width."""
    g = p.add_argument_group(
        "dynamic tree (EAGLE, P-EAGLE, DFlash, MTP)",
        f"override the drafter's defaults (from its config.json); not with --tree; {note}",
    )
    g.add_argument("--depth", type=at_least(1), help="draft steps (the tree's maximum depth)")
    g.add_argument(
        *top_k_flags,
        dest="draft_top_k",
        type=at_least(1),
        help="frontier width and children per expanded node",
    )
    g.add_argument(
        "--total-tokens", type=at_least(1), help="drafted nodes kept for verification (root not counted)"
    )


def generate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    gen = sub.add_parser("generate", help="stream a completion")
    drafter_options(gen, several=False)
    eagle_tree_options(gen, ["--draft-top-k"], "an error with Medusa heads (they take --tree)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument(
        "--temperature",
        type=sampling("temperature", float),
        default=None,
        help="0: greedy; otherwise sample at this temperature (default: as the model's generation_config "
        "says, like model.generate; greedy when it says nothing)",
    )
    gen.add_argument(
        "--top-k",
        type=at_least(0),
        default=None,
        help="sampling: keep the k likeliest tokens, 0: all (default: the generation_config's, else 50)",
    )
    gen.add_argument(
        "--top-p",
        type=sampling("top_p", float),
        default=None,
        help="sampling: keep the likeliest tokens holding this much probability, in (0, 1] "
        "(default: the generation_config's, else 1)",
    )
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument(
        "--quiet",
        action="store_true",
        help="print nothing: no text, no statistics, no loading bars (with --json, the record holds them)",
    )
    return gen


def bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    bench = sub.add_parser(
        "bench", help="compare drafters with model.generate and plain decoding on the same prompts"
    )
    drafter_options(bench, several=True)
    eagle_tree_options(
        bench,
        ["--draft-top-k"],
        "applied to the EAGLE, P-EAGLE, DFlash and MTP drafters only, an error when none is one",
    )
    bench.add_argument(
        "--top-k",
        type=refused(
            "--top-k is sampling's top-k in selfspec generate; bench decodes "
            "greedily, and the tree's width is --draft-top-k"
        ),
        help=argparse.SUPPRESS,
    )
    bench.add_argument(
        "--prompts",
        help='a .jsonl file of {"prompt": ...} texts or {"messages": [...]} chats, '
        "rendered with the chat template (default: demo test-split functions)",
    )
    bench.add_argument(
        "--num-prompts",
        type=at_least(1),
        default=None,
        help=f"the first N prompts (default: {BENCH_PROMPTS} built-in ones, or all of a --prompts file)",
    )
    bench.add_argument("--threads", type=at_least(0), default=0, help="torch threads (0: torch's choice)")
    bench.add_argument(
        "--batch-size",
        type=at_least(1),
        nargs="+",
        default=[1],
        metavar="B",
        help="prompts decoded together, left-padded; several values run one after another, e.g. "
        "--batch-size 1 4 16 (hf_assisted and hf_prompt_lookup run at batch size 1 only)",
    )
    bench.add_argument(
        "--latency",
        action="store_true",
        help="also time the target's forward of n tokens, t(n)/t(1), and each drafter's efficiency "
        "against the limit tau * t(1) / t(its tree)",
    )
    bench.add_argument(
        "--plot",
        help="draw tokens/s, tau and tokens per step per method into this PNG (needs "
        "matplotlib; its folder is made if missing)",
    )
    return bench


def tune_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    tune = sub.add_parser(
        "tune", help="fit the heads' default tree to this machine and store it in their config.json"
    )
    tune.add_argument(
        "--heads", help="a trained drafter directory (Medusa, EAGLE, EAGLE-3, P-EAGLE, DFlash or MTP)"
    )
    tune.add_argument(
        "--mtp",
        action="store_true",
        help="instead of --heads: measure the trees of the target's own MTP layers (--model) and print "
        "the best as options for generate and bench (nothing is stored)",
    )
    tune.add_argument("--model", help="target model name or path (default: the heads' base_model)")
    tune.add_argument("--dtype", choices=list(DTYPES), help="default: the dtype the heads were trained with")
    tune.add_argument("--device", type=device, default="auto", help=DEVICE_HELP)
    tune.add_argument(
        "--prompts", help='calibration .jsonl of {"prompt": ...} (default: the demo validation split)'
    )
    tune.add_argument("--num-prompts", type=at_least(1), default=6)
    tune.add_argument(
        "--max-new-tokens", type=at_least(1), default=128, help="tokens decoded per prompt and EAGLE setting"
    )
    tune.add_argument(
        "--batch-size",
        type=at_least(1),
        default=1,
        help="fit the tree for batches of this many prompts (a batch makes wide trees dearer); the "
        "fitted tree becomes the default for every batch size",
    )
    tune.set_defaults(
        tree=None, draft_model=None, prompt_lookup=False, depth=None, draft_top_k=None, total_tokens=None
    )
    return tune


def import_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from selfspec.heads.families import export_formats

    imp = sub.add_parser(
        "import", help="convert a published Medusa/EAGLE/DFlash checkpoint into a selfspec heads directory"
    )
    imp.add_argument(
        "--src", required=True, help="the checkpoint's directory (layout detected from its files)"
    )
    imp.add_argument(
        "--format", choices=export_formats(), help="the layout, when detection should be overridden"
    )
    imp.add_argument(
        "--base-model",
        help="the target it was trained for (default: what its config names); "
        "EAGLE-3 checkpoints naming no fused layers need it to find them",
    )
    imp.add_argument(
        "--vocab-size",
        type=int,
        help="Medusa 'version 2' heads (no projections of their own) only: the target's vocabulary "
        "size, when neither config.json nor the base model gives it",
    )
    imp.add_argument("--out", required=True, help="the selfspec heads directory to write")
    return imp


def export_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from selfspec.heads.families import export_formats

    exp = sub.add_parser("export", help="write heads in the layout a serving engine loads")
    exp.add_argument("--heads", required=True, help="a selfspec drafter directory or Hub id")
    exp.add_argument(
        "--format",
        required=True,
        choices=export_formats(),
        help="fastdecoding-medusa (FasterDecoding, TGI, TensorRT-LLM), vllm-medusa, eagle1 (SafeAILab, "
        "vLLM), sglang-eagle, eagle3 (EAGLE-3: SafeAILab, SGLang, vLLM), speculators-eagle3 "
        "(vllm-project/speculators, vLLM), peagle and speculators-peagle (P-EAGLE: vLLM with "
        "parallel_drafting), dflash (z-lab's DFlashDraftModel: vLLM, SGLang) or speculators-dflash",
    )
    exp.add_argument(
        "--model",
        help="the target whose weights a layout carries: the lm_head copied into heads that "
        "share it, the EAGLE and P-EAGLE embedding, the speculators layouts' embedding and lm_head "
        "(default: --base-model, else the heads' base_model)",
    )
    exp.add_argument(
        "--base-model",
        help="Medusa and speculators layouts: the target config.json names, "
        "which FasterDecoding, TGI and vLLM load (default: the heads' "
        "base_model; `demo` is written as the shipped model's path); a local "
        "model directory or a Hub id",
    )
    exp.add_argument(
        "--weights",
        choices=["safetensors", "bin"],
        help="EAGLE and DFlash layouts: model.safetensors (default; vLLM, SGLang, SafeAILab's current "
        "code) or pytorch_model.bin (SafeAILab's original EAGLE-1 code)",
    )
    exp.add_argument("--out", required=True, help="the directory to write (config.json and the weights)")
    return exp


def push_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    push = sub.add_parser("push", help="upload a drafter directory to the Hugging Face Hub with a model card")
    push.add_argument("--heads", required=True, help="a drafter directory (config.json + model.safetensors)")
    push.add_argument("--repo-id", required=True, help="e.g. your-name/llama3-8b-medusa")
    push.add_argument("--private", action="store_true")
    push.add_argument("--token", help="a Hub token (default: HF_TOKEN or the saved login); never printed")
    return push


def recipes_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    recipes = sub.add_parser(
        "recipes",
        help="print the folder of the run configs that ship with selfspec "
        "(configs/: recipes, accelerate and DeepSpeed configs)",
    )
    recipes.add_argument("--copy", metavar="DIR", help="copy them into DIR (e.g. ./configs) to edit them")
    return recipes
