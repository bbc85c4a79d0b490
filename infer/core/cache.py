"""The target's KV cache during speculative decoding: allocated once, written and compacted in place.

Each layer holds buffers for every position the generation can reach (prompt + budget + the largest
tree), allocated at the first forward. A forward writes its keys and values into the next free slots
and attends to a view of the filled part; accepting a path moves the accepted entries down in place.
Nothing is reallocated or copied per step (a growing `torch.cat` cache copies itself every step:
O(T^2) over a generation). The layers' buffers are views of two tensors holding every layer's keys and values
(`LayerStorage`, where all layers have one shape), so that keeping the accepted path is one gather and one
scatter for all layers together, not four kernel launches per layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers.cache_utils import Cache, DynamicLayer

from selfspec.infer.core.exactness import check_length


class LayerStorage:
    """Every layer's keys and values in one tensor each, (L, B, H, max_length, D), handed out a layer at a
    time; a layer whose shapes differ from the first layer's (a heterogeneous model) allocates its own
    instead."""

    def __init__(self, num_layers: int | None) -> None:
        self.num_layers = num_layers
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def slot(
        self, index: int, key_states: torch.Tensor, value_states: torch.Tensor, max_length: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `index`'s (B, H, max_length, D) key and value buffers, zeroed when new; None where it must
        hold its own (no layer count given, past it, or shapes unlike layer 0's). Layer 0 (re)allocates."""
        if self.num_layers is None or index >= self.num_layers:
            return None
        B, H, _, D = key_states.shape
        keys = (self.num_layers, B, H, max_length, D)
        values = (self.num_layers, B, value_states.shape[1], max_length, value_states.shape[-1])
        if index == 0:
            # zeros, not empty: a fixed-shape forward attends over the whole buffer (masked), and masked
            # garbage that happens to be NaN would still poison the attention's weighted sum
            self.keys, self.values = key_states.new_zeros(keys), value_states.new_zeros(values)
        if (
            self.keys is None
            or self.keys.shape != keys
            or self.values.shape != values
            or self.keys.dtype != key_states.dtype
            or self.keys.device != key_states.device
        ):
            return None
        return self.keys[index], self.values[index]

    def holds(self, layers: list[PreallocatedLayer]) -> bool:
        """Whether every layer's buffers are its slot here, with the same rows in use: then one op over the
        stacked tensor acts on all of them (a comparison of addresses: no kernel)."""
        if self.keys is None or len(layers) > self.keys.shape[0]:
            return False
        rows = layers[0].key_buffer.shape[0] if layers and layers[0].is_initialized else None
        return all(
            layer.is_initialized
            and layer.key_buffer.shape[0] == rows
            and layer.key_storage.data_ptr() == self.keys[i].data_ptr()
            and layer.value_storage.data_ptr() == self.values[i].data_ptr()
            for i, layer in enumerate(layers)
        )


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values (B, H, max_length, D), filled up to `length`; `keys`/`values` are views of
    the filled part (what the attention reads), never copies."""

    def __init__(self, max_length: int, storage: LayerStorage | None = None, index: int = 0) -> None:
        super().__init__()
        self.max_length = max_length
        self.storage, self.index = storage, index
        self.length = 0
        self.key_storage: torch.Tensor | None = None  # every row's buffers; key/value_buffer: the rows in use
        self.value_storage: torch.Tensor | None = None
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        B, H, _, D = key_states.shape
        slot = (
            self.storage.slot(self.index, key_states, value_states, self.max_length) if self.storage else None
        )
        if slot is not None:
            self.key_storage, self.value_storage = slot
        else:  # zeroed, as LayerStorage.slot's
            self.key_storage = key_states.new_zeros(B, H, self.max_length, D)
            self.value_storage = value_states.new_zeros(
                B, value_states.shape[1], self.max_length, value_states.shape[-1]
            )
        # fixed addresses for a compiled verify: CUDA graphs read them in place instead of copying them per
        # replay
        torch._dynamo.mark_static_address(self.key_storage)
        torch._dynamo.mark_static_address(self.value_storage)
        self.key_buffer, self.value_buffer = (
            self.key_storage,
            self.value_storage,
        )  # all rows until `select_rows`
        self.is_initialized = True
        self._set_length(0)

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys = self.key_buffer[:, :, :length]
        self.values = self.value_buffer[:, :, :length]

    write_at: torch.Tensor | None = None  # fixed-shape mode (a compiled verify): where to write, as a tensor

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions after the filled part; return views of everything filled (the attention's
        keys). In fixed-shape mode (`PreallocatedCache.fixed`): write at `write_at` and return the whole
        buffers, so every call has the same shapes (the mask hides what is not filled)."""
        if self.write_at is not None:
            at = self.write_at + torch.arange(key_states.shape[-2], device=self.write_at.device)
            self.key_buffer.index_copy_(2, at, key_states)
            self.value_buffer.index_copy_(2, at, value_states)
            return self.key_buffer, self.value_buffer
        if not self.is_initialized or (self.length == 0 and not self._fits(key_states, value_states)):
            self.lazy_initialization(key_states, value_states)  # first use, or reused for another batch/dtype
        end = self.length + key_states.shape[-2]
        if end > self.max_length:
            raise ValueError(
                f"the KV cache holds {self.max_length} positions but {end} were written: "
                "allocate it for prompt + max_new_tokens + the largest tree"
            )
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self._set_length(end)
        return self.keys, self.values

    def _fits(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether the buffers can take these states (same batch, heads, head size, dtype and device)."""
        k, v = self.key_buffer, self.value_buffer
        return (
            k.shape[:2] == key_states.shape[:2]
            and k.shape[3] == key_states.shape[3]
            and k.dtype == key_states.dtype
            and k.device == key_states.device
            and v.shape[3] == value_states.shape[3]
        )

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        """The capacity: some transformers models (Bloom, Voxtral realtime) still ask a cache for it."""
        return self.max_length

    def keep_rows(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Per row b, move the entries at positions src[b] (B, W) to dst[b] (reads all happen before writes,
        so the two may overlap), then count `length` positions as filled (rows past their own end are
        masked)."""
        if not self.is_initialized:
            return
        device = self.key_buffer.device
        src, dst = src.to(device), dst.to(device)
        for buffer in (self.key_buffer, self.value_buffer):
            B, H, _, D = buffer.shape
            shape = (B, H, src.shape[1], D)
            moved = buffer.gather(2, src[:, None, :, None].expand(shape))
            buffer.scatter_(2, dst[:, None, :, None].expand(shape), moved)
        self._set_length(length)

    def select_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """Keep only the batch rows `keep` (in that order; `index`: the same on the device) as rows
        0 .. n - 1: a batch whose other rows have stopped. Their filled part moves down in place (nothing when
        they are the first rows already); later forwards take the smaller batch."""
        if not self.is_initialized:
            return
        n = len(keep)
        if keep != list(range(n)):
            for storage, buffer in (
                (self.key_storage, self.key_buffer),
                (self.value_storage, self.value_buffer),
            ):
                storage[:n, :, : self.length] = buffer[:, :, : self.length].index_select(0, index)
        self.key_buffer, self.value_buffer = self.key_storage[:n], self.value_storage[:n]
        self._set_length(self.length)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `tokens_to_remove` positions (a negative count, as DynamicLayer.crop takes it)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        if self.is_initialized and tokens_to_remove:
            self._set_length(max(0, self.length + tokens_to_remove))

    def reset(self) -> None:
        """Empty the layer, keeping its buffers (every row of them) for the next generation."""
        if self.is_initialized:
            self.key_buffer, self.value_buffer = self.key_storage, self.value_storage
            self._set_length(0)


class PreallocatedCache(Cache):
    """A cache of PreallocatedLayers, one per attention layer (created as the forward reaches them), whose
    buffers are slots of one LayerStorage when `num_layers` (the model's) is given."""

    def __init__(self, max_length: int, num_layers: int | None = None) -> None:
        super().__init__(layer_class_to_replicate=self._new_layer)
        self.max_length = max_length
        self.storage = LayerStorage(num_layers)

    def _new_layer(self) -> PreallocatedLayer:
        return PreallocatedLayer(self.max_length, self.storage, index=len(self.layers))

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def set_length(self, length: int) -> None:
        """Count `length` positions as filled in every layer: a step whose kept entries already sit where
        they belong (every row's one verified token at its own end) moves nothing."""
        for layer in self.layers:
            if layer.is_initialized:
                layer._set_length(length)

    def keep_rows(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Every layer's `PreallocatedLayer.keep_rows`: one gather and one scatter of the stacked keys and of
        the stacked values for all layers together where they share a LayerStorage, else layer by layer."""
        layers = self.layers
        if not self.storage.holds(layers):
            for layer in layers:
                layer.keep_rows(src, dst, length)
            return
        rows = layers[0].key_buffer.shape[0]
        src, dst = src.to(self.storage.keys.device), dst.to(self.storage.keys.device)
        for stacked in (self.storage.keys, self.storage.values):
            buffer = stacked[: len(layers), :rows]  # (L, B, H, S, D): the layers' rows in use
            L, B, H, _, D = buffer.shape
            shape = (L, B, H, src.shape[1], D)
            moved = buffer.gather(3, src[None, :, None, :, None].expand(shape))  # all reads before the writes
            buffer.scatter_(3, dst[None, :, None, :, None].expand(shape), moved)
        for layer in layers:
            layer._set_length(length)

    def select_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """Keep only the batch rows `keep`, in that order (see `PreallocatedLayer.select_rows`): for all
        layers in one copy of the stacked keys and one of the stacked values where they share a
        LayerStorage."""
        layers = self.layers
        if not self.storage.holds(layers):
            for layer in layers:
                layer.select_rows(keep, index)
            return
        n, length = len(keep), layers[0].length
        if keep != list(range(n)):
            rows = layers[0].key_buffer.shape[0]
            for stacked in (self.storage.keys, self.storage.values):
                stacked[: len(layers), :n, :, :length] = stacked[
                    : len(layers), :rows, :, :length
                ].index_select(1, index)
        for layer in layers:
            layer.key_buffer, layer.value_buffer = layer.key_storage[:n], layer.value_storage[:n]
            layer._set_length(layer.length)

    @contextlib.contextmanager
    def fixed(self, at: torch.Tensor) -> Iterator[None]:
        """Within: every layer writes its new positions at `at` (a 0-dim tensor) and attends over its whole
        buffer, so a forward's shapes never change from step to step (what torch.compile needs to compile
        once). The filled length is left as it was: the caller sets it when it keeps what it accepted."""
        for layer in self.layers:
            layer.write_at = at
        try:
            yield
        finally:
            for layer in self.layers:
                layer.write_at = None


WIDTH_STEP = (
    16  # cache lengths (and so the masks' row strides) in multiples of this: aligned for SDPA's kernels
)


def new_cache(model: torch.nn.Module, max_length: int) -> PreallocatedCache:
    """An empty cache of at least `max_length` positions for `model` (rounded up to a multiple of WIDTH_STEP:
    a mask as wide as the cache then has a row stride SDPA's memory-efficient kernel takes without padding it
    per layer); fails early where the target's attention or RoPE would make tree verification differ from
    plain decoding within that length (infer/core/exactness.py)."""
    check_length(model.config, max_length)
    layers = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    return PreallocatedCache(-(-max_length // WIDTH_STEP) * WIDTH_STEP, layers)


def truncate(cache: PreallocatedCache, length: int) -> None:
    """Keep the first `length` positions of every layer."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.crop(min(0, length - layer.length))
