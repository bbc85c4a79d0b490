"""Pretrain the shipped demo models (a small Llama code model and its draft) on stdlib Python source.

    python train/target.py --config configs/target/demo-target.yaml
    python train/target.py --config configs/target/demo-draft.yaml

Trains a byte-level BPE tokenizer on the train split (unless `tokenizer` names one), trains a
`LlamaForCausalLM` from scratch under a wall-clock budget, saves bf16 safetensors, and writes a
model card with the validation curve and test-split bits per byte next to gzip -9 and xz -9e.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import lzma
import math
import platform
import time
from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from selfspec.shipped.models import resolve_model
from selfspec.shipped.stdlib_corpus import stdlib_texts
from selfspec.train.loop.config import ConfigError, check_at_least, check_finite, option

SPECIAL = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}


@dataclasses.dataclass
class TargetConfig:
    """Train the demo target (a small Llama code model) from scratch on the stdlib corpus."""

    output_dir: str = option("models/demo-target", "where the model, tokenizer and card are written")
    tokenizer: str | None = option(None, "a saved tokenizer to reuse; None trains one on the train split")
    vocab_size: int = option(8192, "BPE vocabulary size of a newly trained tokenizer")
    hidden_size: int = option(384, "model width")
    num_layers: int = option(8, "decoder layers")
    num_heads: int = option(6, "attention heads")
    num_kv_heads: int = option(6, "key/value heads (fewer than num_heads: grouped-query attention)")
    intermediate_size: int = option(1024, "MLP width")
    seq_len: int = option(512, "tokens per training window")
    batch_size: int = option(16, "windows per optimizer step")
    learning_rate: float = option(1e-3, "peak AdamW learning rate")
    min_lr_ratio: float = option(0.1, "the cosine ends at this fraction of the peak")
    warmup_steps: int = option(100, "linear warmup steps")
    weight_decay: float = option(0.1, "AdamW weight decay")
    max_steps: int = option(100_000, "optimizer steps at most")
    max_minutes: float = option(
        50.0,
        "> 0: the cosine follows the wall clock and training stops at this budget",
    )
    eval_every: int = option(100, "validate every this many steps")
    eval_batches: int = option(8, "validation windows per evaluation")
    threads: int = option(2, "torch CPU threads")
    seed: int = option(0, "seeds initialisation and data order")

    def __post_init__(self) -> None:
        check_finite(self)
        check_at_least(
            self,
            (
                "vocab_size",
                "hidden_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "intermediate_size",
                "seq_len",
                "batch_size",
                "max_steps",
                "eval_every",
                "eval_batches",
                "threads",
            ),
            1,
        )
        if self.learning_rate <= 0 or self.max_minutes < 0 or self.warmup_steps < 0 or self.weight_decay < 0:
            raise ConfigError(
                "--learning_rate must be > 0 and --max_minutes, --warmup_steps, --weight_decay >= 0"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def build_tokenizer(cfg: TargetConfig) -> PreTrainedTokenizerFast:
    """Reuse the named tokenizer, or train byte-level BPE on the train split."""
    if cfg.tokenizer:
        return PreTrainedTokenizerFast.from_pretrained(resolve_model(cfg.tokenizer))
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        stdlib_texts("train"),
        vocab_size=cfg.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL.values()),
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, **SPECIAL)


def encode_split(tok: PreTrainedTokenizerFast, split: str) -> tuple[torch.Tensor, int]:
    """One stream of token ids for a split, files separated by EOS; also its size in UTF-8 bytes."""
    texts = stdlib_texts(split)
    ids: list[int] = []
    for enc in tok(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long), sum(len(t.encode()) for t in texts)


def lr_at(step: int, progress: float, cfg: TargetConfig) -> float:
    """Linear warm-up over `warmup_steps`, then cosine to `min_lr_ratio` as `progress` goes 0 -> 1."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    floor = cfg.learning_rate * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.learning_rate - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def stream_nll(
    model: LlamaForCausalLM,
    ids: torch.Tensor,
    seq_len: int,
    max_windows: int | None = None,
    autocast: bool = True,
) -> tuple[float, int]:
    """Summed next-token NLL (nats) over consecutive windows of a stream, and the count of predicted tokens.
    With `autocast` the matmuls run in bf16 (fast on CPUs with AMX; very slow on CPUs without bf16 units)."""
    model.eval()
    total, count = 0.0, 0
    starts = list(range(0, len(ids) - 1, seq_len - 1))[:max_windows]
    for s in starts:
        window = ids[s : s + seq_len].unsqueeze(0)  # (1, T); windows overlap by one token
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=window).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], window[0, 1:], reduction="sum")
        total += nll.item()
        count += window.shape[1] - 1
    model.train()
    return total, count


def cpu_name() -> str:
    """The CPU's model name where the OS says it, else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compressor_bpb(data: bytes) -> dict[str, float]:
    return {
        "gzip -9": 8 * len(gzip.compress(data, compresslevel=9)) / len(data),
        "xz -9e": 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / len(data),
    }


def write_card(out: Path, cfg: TargetConfig, info: dict) -> None:
    curve = "\n".join(f"| {s} | {m:.1f} | {v:.3f} |" for s, m, v in info["curve"])
    comp = info["compressors"]
    command = " ".join(["python", "train/target.py", *info["argv"]])
    text = f"""---
library_name: transformers
tags: [code, python, demo, selfspec]
---
# {out.name}

A small `LlamaForCausalLM` trained from scratch on Python standard-library source by
selfspec's own script. It is the default target (or draft) of selfspec's demo, benchmarks
and quality tests: a real model that exists without a model hub.

## Recipe

- Command: `{command}` (config values below; seeded, CPU only)
- Corpus: every `.py` file of the interpreter's standard library (Python {platform.python_version()}),
  site-packages excluded, split by `int(sha1(relative_path), 16) % 100`: < 90 train, 90-94 validation,
  >= 95 test. Only the train split is trained on.
- Tokenizer: byte-level BPE, vocabulary {info["vocab_size"]}, special tokens {", ".join(SPECIAL.values())}.
- Parameters: {info["params"] / 1e6:.2f} M (hidden \
{cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads} heads,
  MLP {cfg.intermediate_size}, tied embeddings); weights stored in bfloat16.
- Training: {info["steps"]} steps x {cfg.batch_size} x \
{cfg.seq_len} tokens = {info["tokens"] / 1e6:.1f} M tokens
  ({info["epochs"]:.2f} epochs of {info["train_tokens"] / 1e6:.1f} \
M train tokens), AdamW (0.9, 0.95) lr {cfg.learning_rate},
  weight decay {cfg.weight_decay}, {cfg.warmup_steps} \
warm-up steps, then cosine to {cfg.min_lr_ratio:g}x over the
  {cfg.max_minutes:g}-minute wall-clock budget; bf16 autocast; \
random {cfg.seq_len}-token windows, seed {cfg.seed}.
  The step count depends on the machine's speed; \
`--max_minutes 0 --max_steps {info["steps"]}` replays the same
  number of steps with a step-based cosine.
- Time and hardware: {info["minutes"]:.1f} minutes on {info["hardware"]} \
({cfg.threads} threads), torch {torch.__version__}.{info.get("note", "")}

## Validation loss (nats per token, {cfg.eval_batches} windows)

| step | minutes | loss |
|---|---|---|
{curve}

## Test split: bits per byte (same bytes, same run)

| model | bits per byte |
|---|---|
| this model | {info["test_bpb"]:.3f} |
| gzip -9 | {comp["gzip -9"]:.3f} |
| xz -9e | {comp["xz -9e"]:.3f} |

Measured on the whole test split ({info["test_bytes"] / 1e6:.2f} MB, {info["test_tokens"]} tokens, windows of
{cfg.seq_len} tokens with no context carried across windows).

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{out.as_posix()}")
tokenizer = AutoTokenizer.from_pretrained("{out.as_posix()}")
```
"""
    (out / "README.md").write_text(text)


def train_target(cfg: TargetConfig, argv: list[str]) -> None:
    """Train the demo target from scratch (see configs/target/); `argv`, its options, goes on the card."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer(cfg)
    train_ids, _ = encode_split(tok, "train")
    val_ids, _ = encode_split(tok, "validation")
    print(
        f"tokenizer: {len(tok)} tokens; train {len(train_ids)} tokens, validation {len(val_ids)}", flush=True
    )

    model_cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(model_cfg)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f} M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.learning_rate,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    curve: list[tuple[int, float, float]] = []
    start = time.time()
    budget = cfg.max_minutes * 60
    step = 0
    model.train()
    done = False
    while not done:
        starts = torch.randint(0, len(train_ids) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
        batch = torch.stack([train_ids[s : s + cfg.seq_len] for s in starts.tolist()])  # (B, T)
        elapsed = time.time() - start
        progress = elapsed / budget if budget > 0 else step / cfg.max_steps
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        elapsed = time.time() - start
        done = step >= cfg.max_steps or (budget > 0 and elapsed >= budget)
        if step % cfg.eval_every == 0 or done:
            nll, n = stream_nll(model, val_ids, cfg.seq_len, cfg.eval_batches)
            curve.append((step, elapsed / 60, nll / n))
            print(
                f"step {step}  train {loss.item():.3f}  val {nll / n:.3f}  {elapsed / 60:.1f} min", flush=True
            )
    minutes = (time.time() - start) / 60

    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    test_ids, _ = encode_split(tok, "test")
    test_bytes = "".join(stdlib_texts("test")).encode()
    nll, n = stream_nll(model.float(), test_ids, cfg.seq_len)
    info = {
        "argv": argv,
        "vocab_size": len(tok),
        "params": params,
        "steps": step,
        "tokens": step * cfg.batch_size * cfg.seq_len,
        "train_tokens": len(train_ids),
        "epochs": step * cfg.batch_size * cfg.seq_len / len(train_ids),
        "minutes": minutes,
        "hardware": cpu_name(),
        "curve": curve,
        "test_bpb": nll / math.log(2) / len(test_bytes),
        "test_bytes": len(test_bytes),
        "test_tokens": n,
        "compressors": compressor_bpb(test_bytes),
    }
    (out / "training_info.json").write_text(json.dumps(info, indent=2))
    write_card(out, cfg, info)
    print(
        f"saved to {out}; test bits/byte {info['test_bpb']:.3f} "
        f"(gzip -9 {info['compressors']['gzip -9']:.3f}, xz -9e {info['compressors']['xz -9e']:.3f})"
    )
