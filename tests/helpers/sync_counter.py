"""Count, on any device, the calls that make the host wait for an accelerator (`HostSyncs`), and the steps of
a decode with the count of each (`syncs_per_step`).

On CPU nothing waits, but the same calls would on CUDA: reading a value back (`item`, `tolist`, `bool(t)`,
`int(t)`, `numpy`, `cpu`), an op whose output size depends on values (`nonzero`, boolean indexing, `unique`,
`masked_select`, `repeat_interleave` without output_size), and a tensor made from host data straight on a
device (`torch.tensor(..., device=d)`: a blocking copy that first waits for the queued work). A `.to(device)`
cannot be told from a no-op on CPU and is not counted (the decode path copies host data with
non_blocking=True).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.equal.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
}
HOST_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}
FROM_HOST = {torch.tensor, torch.as_tensor}


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


class _Functions(TorchFunctionMode):
    def __init__(self, counts: collections.Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_METHODS:
            self.counts[func.__name__] += 1
        elif func in FROM_HOST and kwargs.get("device") is not None and not isinstance(args[0], torch.Tensor):
            self.counts[f"{func.__name__}(device=)"] += 1
        return func(*args, **kwargs)


class _Ops(TorchDispatchMode):
    def __init__(self, counts: collections.Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS:
            self.counts[func.__name__] += 1
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and _bool_index(
            args[1]
        ):
            self.counts[f"{func.__name__}[bool]"] += 1
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.counts[func.__name__] += 1
        return func(*args, **kwargs)


class HostSyncs:
    """`with HostSyncs() as syncs:` counts the calls above in `syncs.counts` (by name); `syncs.total` sums
    them."""

    def __enter__(self) -> HostSyncs:
        self.counts: collections.Counter = collections.Counter()
        self._modes = [_Functions(self.counts), _Ops(self.counts)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def syncs_per_step(steps: Iterator) -> tuple[list, list[collections.Counter]]:
    """Advance a decode (`SpeculativeModel.decode_batch`'s iterator) to its end, counting each advance on its
    own. Returns what each advance yielded and its counts: entry 0 is the prefill (the set-up of the
    generation), each later one a decode step (what runs from one yield to the next: dropping stopped rows,
    propose, verify, accept, commit)."""
    items, counts = [], []
    while True:
        with HostSyncs() as syncs:
            try:
                items.append(next(steps))
            except StopIteration:
                break
        counts.append(syncs.counts)
    return items, counts
