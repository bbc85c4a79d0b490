"""Loading what a decoding command runs: the drafters, the target and its tokenizer once, one SpeculativeModel
per drafter; a model that does not load is one line naming it and why."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError

from selfspec.heads.errors import describe
from selfspec.heads.families import dynamic_tree

if TYPE_CHECKING:
    from selfspec.heads.config import HeadsConfig
    from selfspec.heads.io import PretrainedHeads
    from selfspec.infer.core.generate import SpeculativeModel

EAGLE_OPTIONS = {
    "draft_depth": "depth",
    "draft_top_k": "draft_top_k",
    "draft_total_tokens": "total_tokens",
}  # kwarg: args dest


def load_pretrained(option: str, name: str, loader: Callable[..., Any], path: str, **kwargs: Any) -> Any:
    """`loader(path, **kwargs)` (a from_pretrained); a model that does not load is one line naming it and
    why."""
    if path.startswith(("/", ".", "~")) and not Path(path).expanduser().exists():  # a path, not a Hub id
        raise ValueError(f"{option} {name}: no such folder")
    try:
        return loader(path, **kwargs)
    except Exception as e:  # a damaged or mismatched file: whatever the library raised, say which and why
        where = name if name == path else f"{name} ({path})"
        weights = sorted(Path(path).glob("*.safetensors")) if isinstance(e, SafetensorError) else []
        if weights:  # the library's message names no file
            where += (
                f": the weights in {weights[0]}"
                if len(weights) == 1
                else f": one of {len(weights)} weight files"
            )
        raise ValueError(f"{option} {where}: cannot load it: {type(e).__name__}: {describe(e)}") from e


def load_drafters(heads_dirs: list[str], device: str, model: str | None) -> list[PretrainedHeads]:
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
            raise ValueError(
                f"--heads {heads}: no config.json there (train heads with train/medusa.py or train/eagle.py)"
            )
        try:
            drafters.append(load_heads(heads, device, base_model=model))
        except ValueError as e:
            raise ValueError(f"--heads {heads}: {e}") from None
    return drafters


def _eagle_options(args: argparse.Namespace, configs: list[HeadsConfig]) -> dict[str, int | None]:
    """The EAGLE dynamic-tree options given on the command line (None: the heads' defaults)."""
    options = {name: getattr(args, dest) for name, dest in EAGLE_OPTIONS.items()}
    given = [
        "--" + dest.replace("_", "-") for name, dest in EAGLE_OPTIONS.items() if options[name] is not None
    ]
    if given and args.tree is not None:
        raise ValueError(
            f"{', '.join(given)} shape EAGLE's dynamic tree and --tree fixes a static one: "
            "give one or the other"
        )
    if given and not any(dynamic_tree(c.kind) for c in configs) and not getattr(args, "mtp", False):
        kinds = sorted({c.kind for c in configs})
        raise ValueError(
            f"{', '.join(given)} shape EAGLE's and DFlash's dynamic trees, but the heads are "
            f"{'/'.join(kinds)} heads; use --tree for a static tree"
        )
    return options


def load_models(
    args: argparse.Namespace, heads_dirs: list[str], before_weights: Callable[[Any, Any], None] | None = None
) -> tuple[Any, Any, list[SpeculativeModel]]:
    """The target (loaded once), its tokenizer, and one SpeculativeModel per drafter on it: each heads
    directory, then the draft model and prompt lookup when asked for. `before_weights(tokenizer, config)`
    checks what it can before the target's weights load."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from selfspec.heads.target import adapted_target_dir, load_target
    from selfspec.infer.core.generate import SpeculativeModel
    from selfspec.shipped.models import resolve_model

    drafters = load_drafters(heads_dirs, args.device, args.model)
    configs = [drafter.config for drafter in drafters]
    options = _eagle_options(args, configs)
    name = args.model or (configs[0].base_model if configs else "demo")
    if not name:
        raise ValueError(
            f"--heads {heads_dirs[0]} names no target model (SafeAILab's EAGLE checkpoints never do): "
            "pass --model, the model it was trained for"
        )
    if not args.model:
        for heads, config in zip(heads_dirs[1:], configs[1:]):
            if config.base_model != name:
                print(
                    f"note: --heads {heads} was trained on {config.base_model or 'an unnamed model'}, "
                    f"benchmarked on {name}",
                    file=sys.stderr,
                )
    adapted = [d for d in drafters if d.config.adapter or d.config.merged_target]
    if adapted and len(drafters) > 1:
        raise ValueError(
            f"--heads {heads_dirs[drafters.index(adapted[0])]} is a Medusa-2 checkpoint, which decodes "
            "with its own adapted target: give it alone (bench the other drafters in another run)"
        )
    option = "--model" if args.model else "the heads' base_model"
    path = resolve_model(name)
    if adapted and adapted[0].config.merged_target and not args.model:
        path = str(adapted_target_dir(adapted[0].config, adapted[0].source_dir))
        option, name = "the heads' merged target", path
    tokenizer = load_pretrained(option, name, AutoTokenizer.from_pretrained, path)
    if before_weights is not None:
        before_weights(tokenizer, load_pretrained(option, name, AutoConfig.from_pretrained, path))
    dtype_name = args.dtype or (configs[0].dtype if configs else None)
    dtype = getattr(torch, dtype_name) if dtype_name else "auto"
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
        kwargs = options if dynamic_tree(drafter.config.kind) else {}
        try:
            specs.append(
                SpeculativeModel.from_pretrained(
                    drafter, model=model, device=args.device, tree=tree, **kwargs
                )
            )
        except ValueError as e:
            raise ValueError(f"--heads {heads}: {e}") from None
        if getattr(args, "lookup_first", False):
            from selfspec.infer.drafters.prompt_lookup import LookupFirst, PromptLookupProposer

            lookup = PromptLookupProposer(args.prompt_lookup_tokens, device=args.device)
            if args.command == "generate":
                specs[-1] = SpeculativeModel(model, LookupFirst(specs[-1].proposer, lookup))
            else:  # bench both ways, each with its own proposer so they share no drafter state
                again = SpeculativeModel.from_pretrained(
                    drafter, model=model, device=args.device, tree=tree, **kwargs
                )
                specs.append(SpeculativeModel(model, LookupFirst(again.proposer, lookup)))
    if getattr(args, "mtp", False):
        specs.append(SpeculativeModel(model, _mtp_proposer(args, model, name, tree, options)))
    if args.draft_model:
        specs.append(SpeculativeModel(model, _draft_proposer(args, model)))
    if args.prompt_lookup:
        from selfspec.infer.drafters.prompt_lookup import PromptLookupProposer

        specs.append(
            SpeculativeModel(model, PromptLookupProposer(args.prompt_lookup_tokens, device=args.device))
        )
    if getattr(args, "compile", None):
        for spec in specs:
            spec.target.compile(args.compile)
    return model, tokenizer, specs


def _mtp_proposer(args: argparse.Namespace, model: Any, name: str, tree: Any, options: dict[str, int | None]):
    """The target's own MTP layers (--mtp), read from its checkpoint, drafting the dynamic tree of --depth /
    --draft-top-k / --total-tokens (default: a chain of 3)."""
    from selfspec.heads.formats.mtp import load_target_mtp
    from selfspec.infer.core.loading import proposer_for
    from selfspec.infer.drafters.proposers import TREE_OPTIONS

    try:
        draft = load_target_mtp(model, name, args.device)
    except ValueError as e:
        raise ValueError(f"--mtp: {e}") from None
    return proposer_for(draft, model, tree, **{TREE_OPTIONS[k]: v for k, v in options.items()})


def _draft_proposer(args: argparse.Namespace, model: Any):
    """The draft-model drafter: `--draft-model` loaded in the target's dtype on its device."""
    from transformers import AutoModelForCausalLM

    from selfspec.infer.drafters.draft_model import DraftModelProposer
    from selfspec.shipped.models import resolve_model

    path = resolve_model(args.draft_model)
    draft = load_pretrained(
        "--draft-model",
        args.draft_model,
        AutoModelForCausalLM.from_pretrained,
        path,
        dtype=next(model.parameters()).dtype,
    )
    try:
        return DraftModelProposer(
            draft.to(args.device).eval(), args.num_draft_tokens, model.get_output_embeddings().weight.shape[0]
        )
    except ValueError as e:
        raise ValueError(f"--draft-model {args.draft_model}: {e}") from None
