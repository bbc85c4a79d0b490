"""Per-step decode timings on a full-size random-weight target: Llama-3.1-8B's shape by default, built on the
device in seconds, nothing downloaded (the demo target is too small to show a GPU's per-step costs).

    python -m selfspec.infer.measure.step_bench --device cuda --dtype bfloat16 [--batch-size 1 8] [--compile]

Each family's drafter gets random weights of its usual size (Medusa: 5 heads, a 64-node tree; EAGLE-3: depth
6, top-k 10, 60 nodes; DFlash: 5 layers, a chain of 15), so its drafts are almost never accepted: every step
is one target forward of its tree plus the drafter's and the loop's work. Its milliseconds per step against
transformers' `generate` milliseconds per token is what speculation costs on top of a plain step on this
device, and the speed-up a trained drafter needs to pay for it: tau > ms per step / ms per token. Each run's
output is checked token-identical to `generate`'s, and its kernel launches per step outside the target's
forward are counted (infer/measure/launches.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfspec.heads.config import HeadsConfig
from selfspec.heads.dflash import DFlashDraft, default_target_layer_ids
from selfspec.heads.draft_layers import layer_fields
from selfspec.heads.eagle3 import Eagle3Draft
from selfspec.heads.fused_draft import default_feature_layers
from selfspec.heads.medusa import MedusaHeads
from selfspec.infer.cli.options import at_least
from selfspec.infer.core.generate import SpeculativeModel
from selfspec.infer.core.loading import proposer_for
from selfspec.infer.drafters.drafter import Drafter
from selfspec.infer.drafters.proposers import MedusaProposer, NoDraft, default_medusa_choices
from selfspec.infer.measure.launches import LaunchCounter

SHAPES = {
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    # the same attention structure, narrow: what the CPU tests run
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=8,
        vocab_size=512,
    ),
}
DRAFTERS = ("plain", "medusa", "eagle3", "dflash")


def random_target(shape: str, device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    """A `LlamaForCausalLM` of `shape` with random weights, made directly on the device in `dtype`."""
    config = LlamaConfig(max_position_embeddings=8192, **SHAPES[shape])
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def _randomised(module: torch.nn.Module, std: float = 0.02) -> torch.nn.Module:
    with torch.no_grad():
        for name, weight in module.named_parameters():
            torch.nn.init.normal_(weight, mean=1.0 if "norm" in name else 0.0, std=std)
    return module


def random_drafter(name: str, model: LlamaForCausalLM) -> Drafter:
    """The family's drafter in the issue's tree, random weights, on the target's device and dtype."""
    config, lm_head = model.config, model.get_output_embeddings()
    param = next(model.parameters())
    common = dict(hidden_size=config.hidden_size, vocab_size=config.vocab_size)
    if name == "plain":
        return NoDraft()
    if name == "medusa":
        heads = MedusaHeads(HeadsConfig(kind="medusa", num_heads=5, share_lm_head=True, **common))
        heads = _randomised(heads).to(param.device, param.dtype)
        return MedusaProposer(heads, lm_head, default_medusa_choices(5, num_nodes=63))
    layer = layer_fields(config)
    if name == "eagle3":
        draft_vocab = min(32000, config.vocab_size // 2)
        draft = Eagle3Draft(
            HeadsConfig(
                kind="eagle3",
                layer=layer,
                draft_vocab_size=draft_vocab,
                feature_layers=default_feature_layers(config.num_hidden_layers),
                **common,
            )
        )
        draft = _randomised(draft).to(param.device, param.dtype)
        draft.set_draft_vocab(torch.randperm(config.vocab_size)[:draft_vocab])
        return proposer_for(draft.eval(), model, depth=6, top_k=10, total_tokens=60)
    draft = DFlashDraft(
        HeadsConfig(
            kind="dflash",
            num_layers=5,
            layer=layer,
            block_size=16,
            mask_token_id=0,
            feature_layers=[i + 1 for i in default_target_layer_ids(config.num_hidden_layers)],
            depth=15,
            top_k=1,
            total_tokens=15,
            **common,
        )
    )
    return proposer_for(_randomised(draft).to(param.device, param.dtype).eval(), model)


def _synced(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_generate(model: LlamaForCausalLM, ids: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    """transformers' greedy `generate`: milliseconds per new token, and its output."""
    options = dict(do_sample=False, eos_token_id=[], pad_token_id=0)
    model.generate(ids, max_new_tokens=4, **options)  # warm-up
    _synced(ids.device)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, **options)
    _synced(ids.device)
    return 1000 * (time.perf_counter() - start) / new_tokens, out


def time_steps(spec: SpeculativeModel, ids: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    """Our loop: milliseconds per step (one target forward), and its output."""
    options = dict(eos_token_id=[], pad_token_id=0)
    spec.generate(ids, max_new_tokens=new_tokens, **options)  # warm-up (and compile) at the timed shapes
    _synced(ids.device)
    start = time.perf_counter()
    out = spec.generate(ids, max_new_tokens=new_tokens, **options)
    _synced(ids.device)
    return 1000 * (time.perf_counter() - start) / spec.last_stats.target_forwards, out


def launches(model: LlamaForCausalLM, spec: SpeculativeModel, ids: torch.Tensor) -> dict[str, float]:
    """Kernel launches per step inside and outside the target's forward, over a 16-token run."""
    with LaunchCounter(model).counting() as counter:
        spec.generate(ids, max_new_tokens=16, eos_token_id=[], pad_token_id=0)
    steps = spec.last_stats.target_forwards
    return {"outside": counter.outside / steps, "inside": counter.inside / steps}


def run(
    shape: str,
    device: str,
    dtype: torch.dtype,
    batch_sizes: list[int],
    new_tokens: int,
    prompt_length: int,
    compile: bool | str,
    drafters: list[str],
) -> dict:
    """Every drafter at every batch size against `generate`; see the module docstring."""
    torch.manual_seed(0)
    model = random_target(shape, device, dtype)
    result: dict = {"shape": shape, "device": str(device), "dtype": str(dtype), "compile": compile}
    result["runs"] = {}
    for batch in batch_sizes:
        ids = torch.randint(1, model.config.vocab_size, (batch, prompt_length), device=device)
        plain_ms, expected = time_generate(model, ids, new_tokens)
        runs = {"generate": {"ms_per_token": plain_ms}}
        for name in drafters:
            spec = SpeculativeModel(model, random_drafter(name, model), compile=compile)
            ms, out = time_steps(spec, ids, new_tokens)
            runs[name] = {
                "ms_per_step": ms,
                "vs_generate": ms / plain_ms,  # the tau a trained drafter needs to break even
                "tau": spec.last_stats.tau,
                "identical": torch.equal(out, expected),
                "launches_per_step": launches(model, spec, ids),
            }
        result["runs"][batch] = runs
    return result


def report(result: dict) -> str:
    lines = [f"{result['shape']} on {result['device']}, {result['dtype']}, compile={result['compile']}"]
    for batch, runs in result["runs"].items():
        lines.append(f"batch {batch}: generate {runs['generate']['ms_per_token']:.2f} ms/token")
        for name, r in runs.items():
            if name != "generate":
                outside, inside = r["launches_per_step"]["outside"], r["launches_per_step"]["inside"]
                lines.append(
                    f"  {name:7s} {r['ms_per_step']:7.2f} ms/step = {r['vs_generate']:.2f}x a plain token; "
                    f"launches outside/inside the forward {outside:.0f}/{inside:.0f}; "
                    f"output identical: {r['identical']}"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--batch-size", type=at_least(1), nargs="+", default=[1, 8])
    p.add_argument("--new-tokens", type=at_least(1), default=64)
    p.add_argument("--prompt-length", type=at_least(1), default=128)
    p.add_argument("--compile", nargs="?", const=True, default=False, help="verify through torch.compile")
    p.add_argument("--drafters", nargs="+", choices=DRAFTERS, default=list(DRAFTERS))
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch sees no CUDA device; use --device cpu")
    result = run(
        args.shape,
        args.device,
        getattr(torch, args.dtype),
        args.batch_size,
        args.new_tokens,
        args.prompt_length,
        args.compile,
        args.drafters,
    )
    print(report(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
