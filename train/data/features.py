"""EAGLE's feature cache: the target's features of every example, in safetensors shards on disk.

Shard k (`000007.safetensors`) holds examples [k*S, (k+1)*S) of a dataset, each under its index as an
unpadded (L_i, H) tensor. Every one of `world` ranks writes the shards k with k % world == rank, in
parallel, a batch of examples at a time (the header, from the known lengths, first). A shard gets its
final name only when complete (written to a temporary file, then renamed), so a restarted run keeps the
shards it has and computes only the missing ones. Reading maps one shard and copies out one example: RAM
holds a batch, never a shard or the cache.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from selfspec.heads.io import atomic_write

SHARD_BYTES = 256 * 2**20  # a shard of full-length examples is about this big
MAX_SHARD_EXAMPLES = 4096
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
}


def examples_per_shard(max_length: int, width: int, dtype: torch.dtype) -> int:
    """How many examples a shard holds: about SHARD_BYTES of full-length rows, at least one."""
    row = max_length * width * torch.finfo(dtype).bits // 8
    return max(1, min(MAX_SHARD_EXAMPLES, SHARD_BYTES // row))


def shard_count(n: int, size: int) -> int:
    return -(-n // size)


def shard_path(folder: Path, k: int) -> Path:
    return folder / f"{k:06d}.safetensors"


def missing_shards(folder: Path, n: int, size: int) -> list[int]:
    """The shards of `n` examples not (yet) complete in `folder`."""
    return [k for k in range(shard_count(n, size)) if not shard_path(folder, k).is_file()]


def write_safetensors(
    path: str, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, tensors: Iterable[torch.Tensor]
) -> None:
    """A safetensors file written a tensor at a time: the header (every name's dtype, shape and byte range)
    from `shapes`, then `tensors` in the same order, each checked against its shape."""
    itemsize = torch.finfo(dtype).bits // 8
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = math.prod(shape) * itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        names = iter(shapes.items())
        for tensor in tensors:
            name, shape = next(names)
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(
                    f"tensor {name}: expected {shape} {dtype}, got {tuple(tensor.shape)} {tensor.dtype}"
                )
            f.write(tensor.contiguous().view(torch.uint8).numpy().data)
        if next(names, None) is not None:
            raise ValueError(f"{path}: fewer tensors than the header names")


def write_shards(
    folder: Path,
    lengths: np.ndarray,
    width: int,
    dtype: torch.dtype,
    size: int,
    rank: int,
    world: int,
    compute: Callable[[int, int], Iterator[torch.Tensor]],
    show_progress: bool = True,
) -> list[int]:
    """Write this rank's missing shards of len(lengths) examples; `compute(start, stop)` yields the features
    of examples start..stop-1 in order, (lengths[i], width) each, a batch at a time. A temporary file a crash
    left for one of them is removed first. Returns the shards written."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(lengths)
    mine = [k for k in missing_shards(folder, n, size) if k % world == rank]
    for k in tqdm(mine, desc=f"features (rank {rank})", disable=not show_progress):
        path = shard_path(folder, k)
        for stray in folder.glob(
            f".{path.name}.*"
        ):  # atomic_write's temporary names; only this rank writes k
            stray.unlink(missing_ok=True)
        start, stop = k * size, min(n, (k + 1) * size)
        shapes = {str(i): (int(lengths[i]), width) for i in range(start, stop)}
        atomic_write(
            path, lambda tmp, a=start, b=stop, s=shapes: write_safetensors(tmp, s, dtype, compute(a, b))
        )
    return mine


class FeatureShards:
    """Example i's features (L_i, H), read from its shard when asked for (the loader's batches)."""

    def __init__(self, folder: Path, n: int, size: int) -> None:
        missing = missing_shards(folder, n, size)
        if missing:
            raise RuntimeError(
                f"the feature cache {folder} lacks {len(missing)} shard(s) (first: {missing[0]}): a "
                "rank did not finish writing; run again, and the complete shards are kept"
            )
        self.folder, self.n, self.size = folder, n, size

    def __call__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(f"example {i} of {self.n}")
        with safe_open(str(shard_path(self.folder, i // self.size)), framework="pt") as f:
            return f.get_tensor(str(i))
