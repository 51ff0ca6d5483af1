"""``attn_backend="flash"``: Raincheck's forwards on flash-attention kernels (the ``flash_attn`` package).

Flash kernels take no boolean mask, only contiguous keys with a used length and bottom-right causal alignment. A
Raincheck forward's keys are the cache's slots, with holes where deferred tokens are still pending, so each forward
gets a layout (`FlashMask`, built once per forward by `flash_mask`, tensors only: no host sync, fixed shapes, so
it traces into compiled steps) and every layer gathers its keys in that order before one kernel call per row block:

* live rows (prompt, tail, decode token; always the forward's last rows, after every cached slot): keys =
  [entries cached before this forward, in slot order | this forward's restored rows | the live rows], bottom-right
  causal. Live row i then sees every present entry up to itself (docs/design.md rule 2).
* restored (deferred) rows, ``visibility="boundary"``: keys = [entries cached before the plan's boundary | the
  restored rows, padding rows last], bottom-right causal: every entry before the boundary except later
  chunk-mates. ``visibility="causal"`` (a row sees only entries up to itself) is not one bottom-right block: those
  rows take SDPA with the dense mask (`FlashMask.dense`); the live rows still take the flash kernel.

Forwards whose visibility is bottom-right causal over contiguous keys (no holes) call the kernel directly.

Kernels, in order of preference (`kernel()`): flash-attn 2/3 ``flash_attn_with_kvcache`` (``cache_seqlens``: the
used key length), flash-attn 4 ``flash_attn.cute.flash_attn_varlen_func`` (``seqused_k``). The call goes through a
``torch.library`` custom op, so compiled steps keep it as one opaque node. `naive.naive_flash_kernel` is the
reference of the kernel contract; the CPU tests run this module on it.

At a fused step's shapes (a few rows over a whole cache) flash-attn's kernels were slower than SDPA with its
grouped path, and the key gather adds a copy of the keys per layer (the benchmarks page has the numbers), so
``attn_backend="auto"`` stays SDPA. The real kernels equal SDPA there
(`tests/test_flash_backend.py::test_real_flash_kernels_equal_sdpa_on_cuda`).
"""

import dataclasses
import functools
import importlib

import torch

from .naive import naive_flash_kernel


@dataclasses.dataclass
class FlashMask:
    """The layout of one forward for the flash backend (see the module docstring). Index tensors are ``[width]``
    slot orders whose first ``*_count`` entries are the keys; ``deferred_rows`` leading query rows restore deferred
    tokens (padding rows included), the rest are live rows."""

    dense: torch.Tensor  # bool [1, 1, q, width]: the rule-2 mask (the fallback for "causal" restored rows)
    deferred_rows: int
    live_index: torch.Tensor
    live_count: torch.Tensor  # int32 [1]
    deferred_index: torch.Tensor | None  # None: restored rows use `dense` (visibility "causal")
    deferred_count: torch.Tensor | None

    def to(self, device) -> "FlashMask":
        """The same layout on `device` (a layer of a device_map on another GPU); itself when already there."""
        if self.live_index.device == torch.device(device):
            return self
        move = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return FlashMask(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in move.items()})


def flash_mask(dense, filled, row_slots, deferred_rows: int, valid, boundary, visibility: str) -> FlashMask:
    """`FlashMask` of a forward whose first `deferred_rows` rows restore deferred tokens (in slot order; rows with
    `valid` False are padding, last, at scratch slots past every real slot) and whose other rows are live rows
    after every cached slot, in slot order.

    Args:
        dense: the forward's boolean mask ``[1, 1, q, width]`` (rule 2), kept for the fallback.
        filled: bool ``[width]``: slots holding an entry before this forward.
        row_slots: ``[q]`` slots of the rows.
        valid: bool ``[deferred_rows]`` or None (all valid).
        boundary: the plan's boundary (int or 0-d tensor; unused without restored rows).
    """
    width = filled.shape[0]
    device = filled.device
    # sort keys: 0 cached, 1 restored rows, 2 live rows, 3 not a key; a stable sort keeps slot order inside a class
    restored = torch.zeros(width, dtype=torch.bool, device=device)
    live = torch.zeros(width, dtype=torch.bool, device=device)
    if deferred_rows:
        slots = row_slots[:deferred_rows]
        real = torch.ones_like(slots, dtype=torch.bool) if valid is None else valid
        restored = restored.index_put((slots,), real)
        padding = torch.zeros(width, dtype=torch.bool, device=device).index_put((slots,), ~real)
    live = live.index_fill(0, row_slots[deferred_rows:], True)
    three = torch.full((width,), 3, dtype=torch.int8, device=device)
    live_class = torch.where(filled, 0, torch.where(restored, 1, torch.where(live, 2, three)))
    live_index, live_count = _order(live_class)
    deferred_index = deferred_count = None
    if deferred_rows and visibility == "boundary":
        before = filled & (torch.arange(width, device=device) < boundary)
        deferred_class = torch.where(before, 0, torch.where(restored | padding, 1, three))
        deferred_index, deferred_count = _order(deferred_class)
    return FlashMask(dense, deferred_rows, live_index, live_count, deferred_index, deferred_count)


def _order(classes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.sort(classes, stable=True).indices
    count = (classes < 3).sum().to(torch.int32).reshape(1)
    return index, count


def flash_attention(query, key, value, mask, scaling: float, causal_lower_right: bool = False) -> torch.Tensor:
    """Same contract as `naive_attention` (``query [B, Hq, q, D]``, ``key/value [B, Hkv, k, D]``; returns
    ``[B, q, Hq, D]``), with `mask` a `FlashMask` (or None with `causal_lower_right`: contiguous keys)."""
    if causal_lower_right:
        return _call(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, scaling)
    if not isinstance(mask, FlashMask):
        raise TypeError(f"the flash backend needs a FlashMask for a masked forward, got {type(mask).__name__}")
    q_rows, split = query.shape[2], mask.deferred_rows
    outs = []
    if split:
        if mask.deferred_index is None:  # visibility "causal": not one bottom-right block (module docstring)
            from .sdpa import sdpa_attention

            outs.append(sdpa_attention(query[:, :, :split], key, value, mask.dense[..., :split, :], scaling))
        else:
            outs.append(_gathered(query[:, :, :split], key, value, mask.deferred_index, mask.deferred_count, scaling))
    if q_rows > split:
        outs.append(_gathered(query[:, :, split:], key, value, mask.live_index, mask.live_count, scaling))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _gathered(query, key, value, index, count, scaling):
    keys = key.index_select(2, index).transpose(1, 2)
    values = value.index_select(2, index).transpose(1, 2)
    return _call(query.transpose(1, 2), keys, values, count.expand(query.shape[0]), scaling)


def _call(q, k, v, used, scaling):
    q, k, v = (t.contiguous() for t in (q, k, v))
    return torch.ops.hf_raincheck.flash_kernel(q, k, v, used, float(scaling))


@torch.library.custom_op("hf_raincheck::flash_kernel", mutates_args=())
def _flash_kernel_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """Bottom-right causal attention of ``q [B, Q, Hq, D]`` over the first ``used[b]`` keys of ``k/v [B, N, Hkv, D]``
    (None: all N). Returns ``[B, Q, Hq, Dv]``."""
    return kernel()(q, k, v, used, scaling)


@_flash_kernel_op.register_fake
def _(q, k, v, used, scaling):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


_KERNEL = None  # the tests set the naive reference here


def kernel():
    """The kernel ``f(q, k, v, used, scale)`` of the installed flash package; raises naming what to install."""
    global _KERNEL
    if _KERNEL is None:
        found = _find_kernel()
        if found is None:
            raise ValueError(
                "attn_backend='flash' needs the flash_attn package (flash-attn 2/3 with flash_attn_with_kvcache, or "
                "flash-attn 4: flash_attn.cute) and a CUDA device; install it (pip install 'hf_raincheck[gpu]' lists "
                "it) or use attn_backend='sdpa'"
            )
        _KERNEL = found
    return _KERNEL


def available() -> bool:
    return _KERNEL is not None or _find_kernel() is not None


def _half_precision(q) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"attn_backend='flash': flash-attention kernels take float16 or bfloat16, this model computes in "
            f"{q.dtype}; load it in bfloat16 or use attn_backend='sdpa'"
        )


@functools.lru_cache(maxsize=None)
def _find_kernel():
    try:
        fa = importlib.import_module("flash_attn")
        with_kvcache = fa.flash_attn_with_kvcache
    except Exception:  # ImportError, or CUDA errors at import
        with_kvcache = None
    if with_kvcache is not None:
        def fa2(q, k, v, used, scale):
            _half_precision(q)
            return with_kvcache(q, k, v, cache_seqlens=used, softmax_scale=scale, causal=True)

        return fa2
    try:
        varlen = importlib.import_module("flash_attn.cute").flash_attn_varlen_func
    except Exception:
        return None

    def fa4(q, k, v, used, scale):
        _half_precision(q)
        out = varlen(q, k, v, seqused_k=used, softmax_scale=scale, causal=True)
        return out[0] if isinstance(out, tuple) else out

    return fa4


__all__ = ["FlashMask", "flash_mask", "flash_attention", "kernel", "available", "naive_flash_kernel"]
