"""Tensor bytes held by this process during one training step: what tests/training/test_memory_plan.py and
tests/helpers/rank_peak.py measure against the memory plan (train/parallel/memory_plan.py).

At the measured step: the bytes of every live tensor storage before it (found through the garbage collector,
each storage once) plus the peak of the bytes allocated and not yet freed during the step, counted by a
TorchDispatchMode that sees every tensor an op makes and a weak reference that sees its storage freed. That
counts tensors, not the allocator's or the libraries' overhead that RSS would add (docs/memory.md). A
distributed tensor (FSDP2's DTensor) counts by its local shard: the bytes this rank holds.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import selfspec.train.loop.training as loop


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage this rank holds: a DTensor's local shard, else the tensor itself."""
    return getattr(t, "_local_tensor", t)


class LiveBytes(TorchDispatchMode):
    """Bytes of the CPU tensor storages made while active and still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.refs: dict[int, weakref.ref] = {}

    def _freed(self, key: int, size: int) -> None:
        self.refs.pop(key, None)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            local(t).untyped_storage()._cdata
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = local(t).untyped_storage()
                key = storage._cdata
                # a view or an in-place result is an input's storage (perhaps one made before the step): not
                # new
                if key not in self.refs and key not in inputs:
                    size = storage.nbytes()
                    self.refs[key] = weakref.ref(storage, lambda _, k=key, s=size: self._freed(k, s))
                    self.live += size
        self.peak = max(self.peak, self.live)
        return out


def live_tensor_bytes() -> int:
    """Bytes of every CPU tensor storage alive now, each once."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = local(obj).untyped_storage()
            storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def measuring_step(found: dict, step: int = 1) -> Callable:
    """A stand-in for loop.batches_keeping_rng that puts the tensor bytes at the peak of training step `step`
    (0-based: the second, when AdamW's states exist) into found["peak"]."""
    batches = loop.batches_keeping_rng

    def measuring(loader) -> Iterator:
        for i, batch in enumerate(batches(loader)):
            if i != step:
                yield batch
                continue
            before = live_tensor_bytes()
            with LiveBytes() as mode:
                yield batch  # the loop's whole step runs here, until it asks for the next batch
            found["peak"] = before + mode.peak

    return measuring
