"""`SlotLayer`: one full-attention layer's KV in the logical-slot layout (the entry of logical index i in slot i)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

_GROWTH = 256


class SlotLayer(DynamicLayer):
    """KV buffers ``[B, H, capacity, D]`` written at arbitrary slots.

    Deferred slots stay empty (zeros) and are masked until restored; a fully restored layer is laid out exactly
    like a plain prefill's. ``static=True`` keeps a fixed capacity (grown only between turns) and returns the
    whole buffer, so that shapes stay fixed for compiled decode steps; otherwise the layer returns the first
    ``kv_len`` slots and grows geometrically.
    """

    is_croppable = False

    def __init__(self, static: bool = False, capacity: int = 0, buffers=None, index: int = 0):
        super().__init__()
        self.static = static
        self.capacity = capacity if static else 0
        self._buffers = buffers  # static: the cache's pooled buffers (`buffer_pool.CacheBuffers`)
        self._index = index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        self.keys = self._zeros("keys", (b, h, self.capacity, dk), key_states)
        self.values = self._zeros("values", (b, h, self.capacity, dv), value_states)
        self.is_initialized = True

    def _zeros(self, role: str, shape, like: torch.Tensor) -> torch.Tensor:
        """Zero KV buffers; static: pooled and marked as static addresses (compiled steps write them in place,
        CUDA graphs keep their addresses)."""
        if self.static and self._buffers is not None:
            return self._buffers.zeros(f"layer{self._index}.{role}", shape, like.dtype, like.device)
        tensor = like.new_zeros(shape)
        if self.static:
            torch._dynamo.mark_static_address(tensor, guard=False)
        return tensor

    def reserve(self, needed: int) -> None:
        """Makes room for slots ``[0, needed)``."""
        if self.is_initialized and needed <= self.keys.shape[2]:
            if self.static:
                self.capacity = self.keys.shape[2]
            return
        new_capacity = needed if self.static else max(needed, 2 * self.capacity, _GROWTH)
        new_capacity = -(-new_capacity // _GROWTH) * _GROWTH if not self.static else new_capacity
        if self.is_initialized:
            old = self.keys.shape[2]
            keys = self._zeros("keys", self.keys.shape[:2] + (new_capacity, self.keys.shape[3]), self.keys)
            values = self._zeros("values", self.values.shape[:2] + (new_capacity, self.values.shape[3]), self.values)
            keys[:, :, :old] = self.keys
            values[:, :, :old] = self.values
            self.keys, self.values, self.capacity = keys, values, new_capacity  # (one line: they always match)
            return
        self.capacity = new_capacity

    def write(
        self, key_states: torch.Tensor, value_states: torch.Tensor, slots: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self.static and kv_len > self.keys.shape[2]:  # static buffers are reserved before each turn
            self.reserve(kv_len)
        self.keys.index_copy_(2, slots, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, slots, value_states.to(self.values.dtype))
        if self.static:
            return self.keys, self.values
        return self.keys[:, :, :kv_len], self.values[:, :, :kv_len]

    def update(self, key_states, value_states, *args, **kwargs):  # pragma: no cover - guarded by the cache
        raise RuntimeError("SlotLayer is written through DeferredPrefillCache.update, which knows the slots")

    def get_seq_length(self) -> int:
        return self.capacity

    def get_max_length(self) -> int:
        return self.capacity if self.static else -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a DeferredPrefillCache cannot be cropped")
