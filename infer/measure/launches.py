"""Count the kernels a decode step launches outside the target's forward (issue: host work is a cost on
a GPU).

Every aten op that computes launches a kernel on a GPU: 5-10 us of host time each, whatever its size. A
TorchDispatchMode sees every op on any device, so the count is exact on the CPU too. Views, allocations and
host reads (`_local_scalar_dense`) launch nothing and are not counted. Forward hooks on the target mark what
runs inside its forward, so the two are counted apart: inside is the model's own business; outside is ours.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
NO_KERNEL = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten._local_scalar_dense.default,
    aten.lift_fresh.default,
    aten.detach.default,
    aten.set_.source_Storage_storage_offset,
    aten.resize_.default,
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
    aten.is_same_size.default,
    aten._unsafe_view.default,  # a view autograd does not track as one (matmul reshapes its output by it)
}


class LaunchCounter(TorchDispatchMode):
    """Within: `inside` and `outside` count the kernel-launching ops run inside / outside `model`'s forward;
    `ops` names the outside ones."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.depth = model, 0
        self.inside = self.outside = 0
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in NO_KERNEL and not func.is_view:
            if self.depth:
                self.inside += 1
            else:
                self.outside += 1
                self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(self) -> Iterator[LaunchCounter]:
        def enter(*args) -> None:
            self.depth += 1

        def leave(*args) -> None:
            self.depth -= 1

        hooks = [self.model.register_forward_pre_hook(enter), self.model.register_forward_hook(leave)]
        try:
            with self:
                yield self
        finally:
            for hook in hooks:
                hook.remove()
