"""`selfspec draft-vocab`: restrict an EAGLE-1/2 drafter to a dataset's most frequent trained-on tokens, or to
a published FR-Spec token map, without training.

It counts a dataset's tokens as training reads them (train.data, train.vocabulary, train.eagle's default
size), so it lives in train/, not infer/ (which never imports train); selfspec/cli.py adds it to the
`selfspec` command.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from selfspec.heads.families import family
from selfspec.infer.cli.options import Command, at_least

if TYPE_CHECKING:
    import torch

    from selfspec.heads.config import HeadsConfig


def draft_vocab_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    vocab = sub.add_parser(
        "draft-vocab",
        help="restrict an EAGLE-1/2 drafter (yours or a published one) to the "
        "most frequent tokens of a dataset: cheaper draft calls, no training",
    )
    vocab.add_argument(
        "--heads",
        required=True,
        help="an EAGLE-1/2 drafter: a selfspec heads directory, a published "
        "checkpoint (SafeAILab, SGLang) or a Hub id of either",
    )
    source = vocab.add_mutually_exclusive_group()
    source.add_argument(
        "--dataset",
        help="text or chat data like the target's traffic, as train/eagle.py --dataset takes it "
        "(.jsonl, .txt, a saved dataset, a Hub dataset); its trained-on tokens are counted",
    )
    source.add_argument(
        "--token-map",
        help="instead of counting: a published FR-Spec / SGLang token map (.pt, the "
        "token ids most frequent first) for this target",
    )
    vocab.add_argument(
        "--size",
        type=at_least(1),
        help="tokens to draft among (default: a quarter of the vocabulary, within 2048..32768; with "
        "--token-map: all of its tokens, or its first --size)",
    )
    vocab.add_argument(
        "--model",
        help="the target whose tokenizer reads --dataset (default: the heads' base_model; "
        "needed for published EAGLE checkpoints, which name none)",
    )
    vocab.add_argument(
        "--max-length",
        type=at_least(8),
        default=512,
        help="tokens per example when tokenising (plain text is cut into blocks of this many, the "
        "last partial block left out; the tokenised copy is cached under SELFSPEC_CACHE)",
    )
    vocab.add_argument("--out", required=True, help="the heads directory to write")
    return vocab


def cmd_draft_vocab(args: argparse.Namespace) -> None:
    """Restrict an EAGLE-1/2 drafter to a dataset's most frequent tokens, or to a published FR-Spec token map
    (frequency-ranked drafting): each draft call then reads only those rows of the lm_head. No training; the
    drafter's weights are unchanged and verification keeps the output exact."""
    from selfspec.infer.cli.formats import refuse_to_overwrite
    from selfspec.infer.cli.loading import load_drafters

    refuse_to_overwrite(args.out)
    [heads] = load_drafters([args.heads], "cpu", args.model)
    config = heads.config
    vocabulary = family(config.kind).vocabulary
    if vocabulary != "rows":
        why = (
            "they learn their vocabulary's projection in training: set it with --draft_vocab_size there"
            if vocabulary == "learned"
            else "they draft over the target's whole vocabulary"
        )
        raise ValueError(
            f"--heads {args.heads} are {config.kind} heads; draft-vocab restricts drafters that read "
            f"rows of the target's lm_head, such as EAGLE-1/2 ({why})"
        )
    from selfspec.infer.core.tree import choices_width

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
    """The target ids of an FR-Spec / SGLang token map (a torch-saved list or tensor of token ids, most
    frequent first), its first `size` when given; at least `widest`, the tokens the drafter's tree takes per
    node."""
    from selfspec.heads.formats.eagle import read_token_map

    ids = read_token_map(path, vocab)[:size]
    if ids.numel() < widest:
        raise ValueError(
            f"--token-map {path} holds {ids.numel()} tokens, fewer than the drafter's tree takes per "
            f"node ({widest}, its top_k or static tree)"
        )
    return ids, f"from {path}"


def _frequent_ids(args: argparse.Namespace, config: HeadsConfig, widest: int) -> tuple[torch.Tensor, str]:
    """The `--size` most frequent trained-on tokens of `--dataset`, read with the target's tokenizer (checked
    to fit the drafter before any counting), and what share of the dataset's tokens they cover."""
    from transformers import AutoConfig, AutoTokenizer

    from selfspec.infer.cli.loading import load_pretrained
    from selfspec.shipped.models import resolve_model
    from selfspec.train.data.examples import load_examples
    from selfspec.train.data.records import DataError
    from selfspec.train.data.vocabulary import most_frequent, token_counts
    from selfspec.train.recipes.draft_shape import default_draft_vocab_size

    if not args.dataset:
        raise ValueError(
            "give --dataset (data like the target's traffic, whose most frequent tokens are kept) or "
            "--token-map (a published FR-Spec token map)"
        )
    vocab = config.vocab_size
    size = args.size or default_draft_vocab_size(vocab)
    if size >= vocab:
        raise ValueError(
            f"--size {size} must be below the target's vocabulary size ({vocab})"
            if args.size
            else f"the target's vocabulary has only {vocab} tokens, at most the default size {size}: "
            f"give a --size below {vocab}"
        )
    if size < widest:
        raise ValueError(
            f"--size {size} is fewer tokens than the drafter's tree takes per node ({widest}, its top_k "
            "or static tree): give a --size of at least that"
        )
    name = args.model or config.base_model
    if not name:
        raise ValueError(
            f"--heads {args.heads} names no target model: pass --model, whose tokenizer reads --dataset"
        )
    option = "--model" if args.model else "the heads' base_model"
    target = load_pretrained(option, name, AutoConfig.from_pretrained, resolve_model(name)).get_text_config()
    tokenizer = load_pretrained(option, name, AutoTokenizer.from_pretrained, resolve_model(name))
    if target.hidden_size != config.hidden_size or len(tokenizer) > vocab:
        raise ValueError(
            f"{option} {name} does not fit the drafter (hidden size {target.hidden_size} vs "
            f"{config.hidden_size}, {len(tokenizer)} tokenizer tokens vs {vocab}): give the model it "
            "was trained for"
        )
    try:
        examples = load_examples(args.dataset, tokenizer, args.max_length)
    except DataError as e:
        raise ValueError(
            f"--dataset {args.dataset}: {str(e).replace('--max_length', '--max-length')}"
        ) from None
    counts = token_counts(examples.token_batches(), vocab)
    seen = int((counts > 0).sum())
    if seen < size:  # the rest would be arbitrary ids, not frequent ones
        raise ValueError(
            f"--dataset {args.dataset} holds only {seen} distinct trained-on tokens, fewer than --size "
            f"{size}: give more data like the target's traffic, or a --size of at most {seen}"
        )
    ids = most_frequent(counts, size)
    covered = counts[ids].sum().item() / counts.sum().item()
    return (
        ids,
        f"which are {100 * covered:.2f}% of the {counts.sum().item()} trained-on tokens in {args.dataset}",
    )


DRAFT_VOCAB = Command(draft_vocab_parser, cmd_draft_vocab)
