"""Bytes of the KV cache copied per verify forward, with and without the grouped attention
(`infer.attention`).

    python -m selfspec.infer.measure.kv_bytes [--context 4096] [--tree 64] [--layers 4] [--out result.json]

A random grouped-query Llama target (16 query heads over 4 key/value heads; a real model's path: a target
given with --model) is prefilled to `context` tokens, then one tree of `tree` nodes is verified twice: through
transformers' "sdpa" as it is, through "selfspec_sdpa", and through "selfspec_sdpa" folding the query groups
as it does on CUDA (`heads.gqa`; forced here). Two counts per forward:

- `kv_copied`: bytes written by copying ops (clone, copy_, cat, index_select, ...) that read the cache's
  buffers, seen op by op with a TorchDispatchMode (repeat_kv's expand + reshape is a clone of each layer's
  keys and values);
- `allocated`: bytes allocated during the forward, summed over torch.profiler's per-op memory records (the
  fold's mask copy, G*T*S per layer, is here).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from selfspec.heads import gqa
from selfspec.infer.core.cache import PreallocatedCache, new_cache
from selfspec.infer.core.mask import RowMask
from selfspec.infer.core.target import Target

aten = torch.ops.aten
COPIES = {
    aten.clone,
    aten.copy_,
    aten._to_copy,
    aten.cat,
    aten.stack,
    aten.index_select,
    aten.gather,
    aten.index,
    aten.repeat,
    aten.repeat_interleave,
    aten.expand_copy,
    aten.contiguous,
}


def storages(cache: PreallocatedCache) -> set[int]:
    """The addresses of every layer's key and value storage."""
    return {
        t.untyped_storage().data_ptr()
        for layer in cache.layers
        if layer.is_initialized
        for t in (layer.key_storage, layer.value_storage)
    }


class CopyCounter(TorchDispatchMode):
    """Counts the bytes that copying ops write, when any of their inputs lies in one of `sources` (storage
    addresses)."""

    def __init__(self, sources: set[int]) -> None:
        super().__init__()
        self.sources, self.bytes, self.ops = sources, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in COPIES:
            inputs = [
                a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
            ]
            if func.overloadpacket is aten.copy_:
                inputs = inputs[1:]  # copy_(dst, src): what it reads is src
            if any(t.untyped_storage().data_ptr() in self.sources for t in inputs):
                written = sum(
                    t.nbytes for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
                )
                self.bytes += written
                name = str(func.overloadpacket)
                self.ops[name] = self.ops.get(name, 0) + written
        return out


def measure(forward: Callable[[], object], cache: PreallocatedCache) -> dict:
    """kv_copied (bytes, and per op) and allocated bytes of one call of `forward`."""
    with CopyCounter(storages(cache)) as counter:
        forward()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        forward()
    allocated = sum(
        max(0, e.self_cpu_memory_usage) + max(0, getattr(e, "self_device_memory_usage", 0))
        for e in prof.key_averages()
    )
    return {"kv_copied": counter.bytes, "kv_copied_by_op": counter.ops, "allocated": allocated}


def gqa_model(layers: int, context: int) -> torch.nn.Module:
    """A random Llama with grouped-query attention: 16 heads of 64 over 4 key/value heads
    (G = 4, as Llama-3-8B)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=context + 256,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


# (name, grouped attention, whether the kernels take grouped heads: None = as the device does): the third is
# CUDA's fold, wherever it runs
VARIANTS = (("sdpa", False, None), ("selfspec_sdpa", True, None), ("selfspec_sdpa_folded", True, False))


def verify_bytes(model: torch.nn.Module, context: int, tree: int) -> dict:
    """{name: ...} per VARIANTS: `measure` of one verify forward of a `tree`-node chain after a
    prefilled `context`-token prompt, each through its own cache."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    device = next(model.parameters()).device
    prompt = torch.randint(3, vocab, (1, context), generator=gen).to(device)
    tokens = torch.randint(3, vocab, (1, tree), generator=gen).to(device)
    result = {}
    for name, grouped, native in VARIANTS:
        target = Target(model, grouped_attention=grouped)
        cache = new_cache(model, context + tree)
        target.prefill_rows(prompt, cache, hidden=False)
        mask = RowMask(1, tree, cache.max_length, target.dtype, target.device)
        mask.open(torch.zeros(1, dtype=torch.long, device=device), context)
        block = mask.at(context, torch.ones(tree, tree, dtype=torch.bool, device=device).tril()[None])
        positions = torch.arange(context, context + tree, device=device)[None]

        def forward(target=target, cache=cache, block=block, positions=positions):
            target.verify_rows(tokens, positions, block, cache)
            for layer in cache.layers:  # forget the tree: every call writes it at the same columns
                layer.crop(-tree)

        kernels = gqa.native_gqa if native is None else (lambda *device, native=native: native)
        with mock.patch.object(gqa, "native_gqa", kernels):
            result[name] = measure(forward, cache)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=4096, help="prompt tokens in the cache before the tree")
    p.add_argument("--tree", type=int, default=64, help="tree nodes verified in the forward")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the random GQA model")
    p.add_argument(
        "--model", default=None, help="a local causal LM folder to measure instead (loaded with sdpa)"
    )
    p.add_argument(
        "--device", default="cpu", help="where the model runs (cuda: the fold is the device's own path)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", type=Path, default=None, help="also write the result here as JSON")
    args = p.parse_args(argv)
    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").eval()
    else:
        model = gqa_model(args.layers, args.context)
    model = model.to(args.device, getattr(torch, args.dtype))
    with torch.no_grad():
        result = {"context": args.context, "tree": args.tree, **verify_bytes(model, args.context, args.tree)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
