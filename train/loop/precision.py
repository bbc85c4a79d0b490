"""Which mixed precision a run gets: `--mixed_precision auto` takes bf16 only where bf16 matmuls are fast (a
CUDA GPU with bf16, or a CPU with AMX tiles) and float32 elsewhere. On CPUs without AMX, bf16 matmuls run on
emulated or narrow units: 1.7x slower than float32 on an AVX512-BF16 Xeon and 60x on an AVX2 EPYC
(docs/results/precision.md), so a bf16 default there trains a wall-clock-capped recipe several times less far,
silently."""

from __future__ import annotations

import time
import warnings

import torch


def bf16_is_fast() -> tuple[bool, str]:
    """Whether this machine's training device runs bf16 matmuls faster than float32, and why, in a few
    words."""
    if torch.cuda.is_available():
        if torch.cuda.is_bf16_supported():
            return True, f"the GPU ({torch.cuda.get_device_name()}) has bf16 units"
        return False, f"the GPU ({torch.cuda.get_device_name()}) has no bf16 units"
    capability = torch.backends.cpu.get_cpu_capability()
    if torch.cpu._is_amx_tile_supported():
        return True, f"the CPU ({capability}) has AMX bf16 tiles"
    return False, f"the CPU ({capability}) has no AMX bf16 tiles"


def resolve_precision(requested: str) -> str:
    """`auto` -> "bf16" where bf16 is fast, else "no"; any other value as it is."""
    if requested != "auto":
        return requested
    return "bf16" if bf16_is_fast()[0] else "no"


def bf16_slowdown(size: int = 256, repeats: int = 3) -> float:
    """How many times slower a bf16 matmul of (size, size) runs than float32 on this CPU (best of
    `repeats`)."""
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        a @ b
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
        best[dtype] = min(times)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


def precision_line(requested: str, resolved: str) -> str:
    """The one line a run prints at its start about its precision; an explicit bf16 on a slow CPU also warns
    once, with the slowdown measured here."""
    fast, why = bf16_is_fast()
    if requested == "auto":
        return f"mixed precision: {'bf16' if resolved == 'bf16' else 'float32'} (auto: {why})"
    if resolved == "bf16" and not fast and not torch.cuda.is_available():
        warnings.warn(
            f"--mixed_precision bf16 on a CPU without bf16 matrix units ({why}): a bf16 matmul ran "
            f"{bf16_slowdown():.1f}x slower than float32 here; --mixed_precision auto (or no) trains "
            "faster on this machine",
            UserWarning,
            stacklevel=2,
        )
    return f"mixed precision: {resolved} (as asked)"
