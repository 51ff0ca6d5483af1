"""Static-cache buffers handed from a finished conversation to the next one (`StaticBufferPool`).

Compiled static steps run as CUDA graphs, which read the cache's buffers (KV layers, the filled-slot mask, the
scratch slots, the deferred store) at the addresses they were recorded with. With new buffers for every
conversation, every conversation would record its graphs again: its first decode step and, under Raincheck, its
first fused step would each take several times as long as a replayed one.
transformers reuses one static cache per model for the same reason (``model._cache``), resetting it for each call,
which would wipe a conversation that the user still holds; here a cache's buffers go to the pool only once the
cache itself is freed, and the next static cache takes them by name (the same role: layer 3's keys, the store's
embeddings...) when shape, dtype and device match, zeroed (a GDN layer's persistent copy of its state is not:
the copy overwrites all of it).

The pool keeps at most one tensor per name, the latest one given back, so it holds at most one conversation's
buffers (its KV cache, store and GDN states: the size of one static cache), and the scratch slots of each chunk size
used (their name carries it: a few longs each). `release_static_buffers()` empties it.
A tensor taken out of a static cache and kept after the cache is freed (``cache.layers[0].keys``) is one of those
buffers: the next conversation overwrites it, so clone what you keep.
"""

from __future__ import annotations

import threading

import torch


class StaticBufferPool:
    """Free static-cache buffers by role name (at most one per name)."""

    def __init__(self):
        self._free: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def take(self, name: str, shape, dtype: torch.dtype, device, zero: bool = True) -> torch.Tensor | None:
        """A free buffer of this role and layout, zeroed unless `zero` is False, or None (a buffer of another
        layout is dropped)."""
        with self._lock: tensor = self._free.pop(name, None)  # noqa: E701  (one line: see `give`)
        if tensor is None or not _fits(tensor, shape, dtype, device):
            return None
        return tensor.zero_() if zero else tensor

    def give(self, buffers: dict[str, torch.Tensor]) -> None:
        """Takes back a freed cache's buffers (replacing older ones of the same roles)."""
        # one-line `with` statements: no line event between the body and the release, so a trace function
        # raising there (the fault-injection tests) cannot leave the lock held
        with self._lock: self._free.update(buffers)  # noqa: E701

    def clear(self) -> None:
        with self._lock: self._free.clear()  # noqa: E701

    def nbytes(self) -> int:
        with self._lock: return sum(t.numel() * t.element_size() for t in self._free.values())  # noqa: E701


def _fits(tensor: torch.Tensor, shape, dtype: torch.dtype, device) -> bool:
    """Whether `tensor` has this layout (shape, dtype, device)."""
    return tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype and tensor.device == torch.device(device)


POOL = StaticBufferPool()


def release_static_buffers() -> int:
    """Frees the buffers that finished static-cache conversations left for the next one (see the module
    docstring); returns the bytes released. Call ``torch.cuda.empty_cache()`` after it to return them to the
    driver."""
    released = POOL.nbytes()
    POOL.clear()
    return released


class CacheBuffers:
    """One static cache's pooled buffers by role name; given back to `pool` when the cache is freed."""

    def __init__(self, pool: StaticBufferPool):
        self.pool = pool
        self.buffers: dict[str, torch.Tensor] = {}

    def zeros(self, name: str, shape, dtype: torch.dtype, device, zero: bool = True) -> torch.Tensor:
        """A zero tensor for role `name` (uninitialised when `zero` is False: the caller overwrites all of it): a
        pooled one when the layout matches, else a new one. Marked as an unguarded static address (compiled steps
        read it in place; dynamo does not guard on its identity)."""
        tensor = self.pool.take(name, shape, dtype, device, zero=zero)
        if tensor is None:
            tensor = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
        torch._dynamo.mark_static_address(tensor, guard=False)
        self.buffers[name] = tensor
        return tensor

    def persistent(self, name: str, tensor: torch.Tensor, copies: list | None = None) -> torch.Tensor:
        """`tensor`'s values in the persistent buffer of role `name` (taken as in `zeros` the first time, or when
        the layout changed); returns that buffer (`tensor` itself when it already is). With `copies`, the copy is
        not made here but appended to it as ``(buffer, tensor)``, for `copy_pairs`."""
        buffer = self.buffers.get(name)
        if buffer is tensor:
            return tensor
        if buffer is None or not _fits(buffer, tensor.shape, tensor.dtype, tensor.device):
            buffer = self.zeros(name, tensor.shape, tensor.dtype, tensor.device, zero=False)
        if copies is None:
            return buffer.copy_(tensor)
        copies.append((buffer, tensor))
        return buffer


def copy_pairs(pairs: list) -> None:
    """``dst.copy_(src)`` for every ``(dst, src)`` of `pairs`, in one ``torch._foreach_copy_`` per dtype and device
    for the pairs of contiguous tensors (a launch or a few instead of one per pair: the copies after an eager
    forward run while the host is the bottleneck) and one copy each for the others. In order, one by one, when a
    source shares memory with a destination (a batched copy would not keep their order)."""
    targets = {dst.untyped_storage().data_ptr() for dst, _ in pairs}
    if any(src.untyped_storage().data_ptr() in targets for _, src in pairs):
        for dst, src in pairs:
            dst.copy_(src)
        return
    groups: dict = {}
    for dst, src in pairs:
        if dst.dtype == src.dtype and dst.device == src.device and dst.is_contiguous() and src.is_contiguous():
            groups.setdefault((dst.dtype, dst.device), []).append((dst, src))
        else:
            dst.copy_(src)
    for group in groups.values():
        torch._foreach_copy_([dst for dst, _ in group], [src for _, src in group])
