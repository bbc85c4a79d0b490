"""Bits per byte of a target on the demo corpus's test split (or any texts): how well it models the text.

    python train/data/bits_per_byte.py --model demo
    python train/data/bits_per_byte.py --heads outputs/medusa2-demo
        # the adapted target Medusa-2 heads decode with

Medusa-2 changes the target; this is the check that it still predicts text as well as the original did.
The model reads the texts as one stream (EOS between files) in windows of `seq_len` tokens, in float32
(train/target.py scores the demo target for its card the same way, under bf16 autocast).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfspec.heads.errors import run_main
from selfspec.shipped.models import resolve_model
from selfspec.shipped.stdlib_corpus import stdlib_texts
from selfspec.train.recipes.demo_models import stream_nll


def bits_per_byte(model: torch.nn.Module, tokenizer, texts: list[str], seq_len: int = 512) -> float:
    """Summed next-token NLL of the texts' token stream in bits, over their UTF-8 bytes."""
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc + [tokenizer.eos_token_id])
    nll, _ = stream_nll(model.float(), torch.tensor(ids), seq_len, autocast=False)
    return nll / math.log(2) / len("".join(texts).encode())


def main(argv: list[str] | None = None) -> None:
    def run(args: list[str]) -> None:
        parser = argparse.ArgumentParser(
            prog="train/data/bits_per_byte.py", description=__doc__.split("\n")[0]
        )
        parser.add_argument("--model", help="a model name or path (default: the heads' target, else demo)")
        parser.add_argument(
            "--heads", help="score the target these heads decode with (Medusa-2: the adapted one)"
        )
        parser.add_argument("--split", default="test", choices=["train", "validation", "test"])
        parser.add_argument("--seq-len", type=int, default=512)
        opts = parser.parse_args(args)
        if opts.heads:
            from selfspec.heads.registry import load_heads
            from selfspec.heads.target import load_target

            heads = load_heads(opts.heads)
            model = load_target(heads, opts.model, dtype=torch.float32)
            name = opts.model or heads.config.base_model
        else:
            name = opts.model or "demo"
            model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(name))
        bpb = bits_per_byte(model.eval(), tokenizer, stdlib_texts(opts.split), opts.seq_len)
        print(
            json.dumps(
                {"model": name, "heads": opts.heads, "split": opts.split, "bits_per_byte": round(bpb, 4)}
            )
        )

    run_main(run, argv, prog="train/data/bits_per_byte.py")


if __name__ == "__main__":
    main()
