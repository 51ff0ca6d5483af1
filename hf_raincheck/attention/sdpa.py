"""PyTorch SDPA for Raincheck's forwards, with the same boolean visibility mask as the naive reference.

A forward of a few query rows over many keys under a dense mask (a fused step: the decode token and a chunk of
deferred rows over the whole static cache) goes to `grouped_attention` instead: SDPA's kernels (cuDNN flash on the
H200) tile the query rows and do not split the keys, so 32 rows x 32 heads take ~100 us per layer at 4352 keys, 7x
a one-row decode call. Measured per call on the H200 (bf16, as a replayed CUDA graph after ``torch.compile``,
``benchmarks/attention_speed.py --graphs --compile``; 32 rows, 4352 keys): Qwen3-VL-8B layer (32 / 8 heads, dim
128) SDPA 98.4 us, grouped 36.2 us; Qwen3.5-9B layer (16 / 4, dim 256) 234.6 us against 31.5 us. One row stays on
SDPA (13 us against 16). ``HF_RAINCHECK_GROUPED_ROWS`` sets the largest row count that takes the grouped path
(default 64; 0 turns it off). Where Triton runs, the grouped path's masked softmax is one kernel
(`softmax_triton`: 30.9 instead of 44.3 us per Qwen3-VL-8B call at 32 rows, same run). Opt-in
(``HF_RAINCHECK_GROUPED_KERNEL=triton``): the whole path as one split-key Triton kernel pair (`grouped_triton`,
flash-decoding style, tunable tiles); swept on the H200 its best configuration took 30.0 us at 32 rows (Qwen3-VL-8B,
no real gain), 38.1 against 47.8 at 64 rows, and lost on Qwen3.5-9B's head dim 256 (40.9 against 24.0 at 32 rows).
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.nn.functional as F
from torch.nn.attention import bias

from ..pruning.triton_support import interpreted, triton_importable

# The grouped path's softmax kernel (Triton), decided at import: compiled steps trace `grouped_attention`, and an
# import or a cached probe inside it would break the graph. ``HF_RAINCHECK_TRITON=0`` (at import) keeps the torch
# softmax.
_masked_softmax = None
if os.environ.get("HF_RAINCHECK_TRITON", "1") != "0" and triton_importable():
    try:
        from .softmax_triton import masked_softmax as _masked_softmax
    except Exception:  # a Triton too old for `torch.library.triton_op`'s needs, or a broken install: torch softmax
        _masked_softmax = None
_SOFTMAX_KERNEL_ON_CPU = interpreted()  # Triton's interpreter (tests): the kernels run on CPU tensors too
# ``HF_RAINCHECK_GROUPED_KERNEL=triton`` (at import): the whole grouped attention as one split-key Triton kernel
# pair (`grouped_triton`, tile sizes from ``HF_RAINCHECK_GROUPED_KERNEL_CONFIG``); opt-in until it is faster
_grouped_kernel = None
if _masked_softmax is not None and os.environ.get("HF_RAINCHECK_GROUPED_KERNEL", "") == "triton":
    from .grouped_triton import grouped_attention_kernel as _grouped_kernel


def _eager_short() -> bool:
    """Inside an eager short forward (`eager_sdpa_backends`), not while a compiled step is traced."""
    return not torch.compiler.is_compiling() and _EAGER_SHORT.inside


def _softmax_kernel_runs(device: torch.device) -> bool:
    return _masked_softmax is not None and (device.type == "cuda" or (device.type == "cpu" and _SOFTMAX_KERNEL_ON_CPU))

GROUPED_MAX_ROWS = int(os.environ.get("HF_RAINCHECK_GROUPED_ROWS", "64"))
# Two-level softmax over key blocks of this size (0: off; only when the key count is a multiple). In the profile of a
# compiled Qwen3-VL-8B fused step, Inductor split the one-level softmax reduction (1024 rows of 4352 keys: fewer
# rows than it needs to skip splitting), 27 us per layer; per-block max and sum make the reductions 256 long over
# 17x more rows, then 17 long. Measured on the H200 (compiled, CUDA graphs, 4352 keys): 38.3 vs 39.8 us at 32 rows,
# 20.8 vs 17.5 us at 1 row (attention_speed_blocked.json): no real gain, hence off by default.
GROUPED_SOFTMAX_BLOCK = int(os.environ.get("HF_RAINCHECK_GROUPED_SOFTMAX_BLOCK", "0"))


def grouped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scaling: float,
    softmax_block: int | None = None,
) -> torch.Tensor:
    """Same contract as `naive_attention` (a dense `visible`); returns ``[B, q, Hq, D]``.

    The ``g`` query heads that share a KV head are stacked as the rows of one matrix product per KV head
    (``[g q, D] x [D, k]``): keys and values are read once per KV head and never repeated. Precision as
    transformers' eager attention: the scaled query meets the keys in the inputs' dtype (fp32 accumulation), the
    mask and the softmax are fp32, the probabilities meet the values in the values' dtype. (fp32 scores measured
    2.5x slower at the Qwen3-VL-8B shape.) A row that sees nothing returns zeros. `softmax_block`: see
    `GROUPED_SOFTMAX_BLOCK` (None: that default).
    """
    block = GROUPED_SOFTMAX_BLOCK if softmax_block is None else softmax_block
    if _grouped_kernel is not None and not block and _softmax_kernel_runs(query.device):
        return _grouped_kernel(query, key, value, visible, scaling)
    b, hq, q, d = query.shape
    hkv, k = key.shape[1], key.shape[2]
    g = hq // hkv
    rows = query.reshape(b, hkv, g * q, d) * scaling
    scores = torch.matmul(rows, key.transpose(-1, -2)).view(b, hkv, g, q, k)  # the inputs' dtype
    if not (block and k % block == 0 and k > block) and _softmax_kernel_runs(scores.device) and not _eager_short():
        probs = _masked_softmax(scores, visible, value.dtype)  # one Triton kernel: see `softmax_triton`
    else:
        probs = grouped_softmax_torch(scores, visible, value.dtype, block)
    out = torch.matmul(probs, value).view(b, hq, q, d)
    return out.transpose(1, 2).contiguous()


def grouped_softmax_torch(scores: torch.Tensor, visible: torch.Tensor, dtype: torch.dtype,
                          block: int = 0) -> torch.Tensor:
    """The grouped path's softmax in torch (the reference of `softmax_triton.masked_softmax`): ``scores [b, hkv,
    g, q, k]`` upcast to fp32, keys `visible` (broadcasting to ``[b, hkv, q, k]``) hides at -inf, softmax over k
    (two-level over blocks of `block` keys when it divides k), a row that sees nothing -> 0, cast to `dtype`:
    ``[b, hkv, g q, k]``."""
    b, hkv, g, q, k = scores.shape
    # hidden keys at -inf in the scores' own dtype (exact), then the softmax upcasts to fp32 itself: the same
    # values as upcasting first, in one operator instead of three (eager steps are host-bound: ~25 us per op on
    # the H200 host, per layer)
    scores = torch.where(visible.unsqueeze(2), scores, float("-inf"))
    if block and k % block == 0 and k > block:
        probs = blocked_softmax(scores.float(), block)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return probs.nan_to_num(0.0).to(dtype).view(b, hkv, g * q, k)


def blocked_softmax(scores: torch.Tensor, block: int) -> torch.Tensor:
    """Softmax over the last dim (a multiple of `block`) with the max and the sum taken per block of keys first,
    then over blocks: the same values as `torch.softmax` up to the order of the fp32 sum. A row of only -inf gives
    NaN, as `torch.softmax` does."""
    blocks = scores.unflatten(-1, (scores.shape[-1] // block, block))
    top = blocks.amax(dim=-1, keepdim=True).amax(dim=-2, keepdim=True)
    e = torch.exp(blocks - top)
    total = e.sum(dim=-1, keepdim=True).sum(dim=-2, keepdim=True)
    return (e / total).flatten(-2)


#: forwards of at most this many rows (decode and fused steps) run eagerly on CUDA without cuDNN's SDPA
#: (`eager_sdpa_backends`)
SHAPE_CHANGING_ROWS = 64


class _EagerShortForwards:
    """Inside: SDPA's cuDNN backend is off while any such forward runs (a count under a lock: the flag is
    process-wide, and a background completion can run a forward while the user's thread runs another); the user's
    setting comes back when the last one leaves. The other SDPA backends keep their flags. The grouped path reads
    `inside` too (`grouped_attention`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inside = 0
        self._saved = True

    @property
    def inside(self) -> bool:
        return self._inside > 0

    def __enter__(self):
        with self._lock:
            if self._inside == 0:
                self._saved = torch.backends.cuda.cudnn_sdp_enabled()
                torch.backends.cuda.enable_cudnn_sdp(False)
            self._inside += 1
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._inside -= 1
            if self._inside == 0:
                torch.backends.cuda.enable_cudnn_sdp(self._saved)
        return False


_EAGER_SHORT = _EagerShortForwards()


def eager_sdpa_backends(device: torch.device, rows: int):
    """A context for one eager forward of `rows` rows on `device`: for short forwards on CUDA, SDPA without its
    cuDNN backend (SDPA then picks flash, memory-efficient or math attention as usual), and the grouped path with
    its torch softmax (`grouped_attention`); otherwise nothing.

    cuDNN's SDPA builds an execution plan per shape and strides and caches it (per thread); an eager decode step's
    key length is one more than the last step's, so a step of a new length builds a plan in every layer. On the
    H200 (Qwen3-VL-8B, dynamic cache) Raincheck's decode steps after restoration spent 1.06 ms of host time per
    cuDNN call there (37 ms per step, against 63 us per call for Full's steps of the same run, whose plans were
    cached; `benchmarks/results/latency_profile_dynamic_cudnn.txt`). Flash and memory-efficient attention have no
    per-shape build. Set once per forward, not per layer; compiled steps (fixed shapes, CUDA graphs) and long
    forwards (a prefill: one new shape per turn) keep SDPA's own choice.

    The grouped path's Triton softmax is a `torch.library.triton_op`: one node inside a compiled graph, but called
    eagerly its launch took 136 us of host time per call in the same profile (4.9 ms per fused step, where the
    torch softmax is a few launches of ~10 us each): eager forwards take the torch softmax."""
    if device.type == "cuda" and rows <= SHAPE_CHANGING_ROWS:
        return _EAGER_SHORT
    return contextlib.nullcontext()


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None,
    scaling: float,
    causal_lower_right: bool = False,
) -> torch.Tensor:
    """Same contract as `naive_attention`; returns ``[B, q, Hq, D]``."""
    enable_gqa = query.shape[1] != key.shape[1]
    if causal_lower_right:
        if query.shape[2] == 1:  # one row that sees every key: no mask at all
            mask = None
        else:
            mask = bias.causal_lower_right(query.shape[2], key.shape[2])
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=enable_gqa)
        return out.transpose(1, 2).contiguous()
    rows = query.shape[2]
    if visible is not None and (1 < rows <= GROUPED_MAX_ROWS or (rows == 1 and GROUPED_MAX_ROWS and _eager_short())):
        # (one masked row of an eager short forward, e.g. a decode step while deferred slots are pending: SDPA
        # without cuDNN has no masked GQA kernel and fell back to its math path, which repeats K and V per query
        # head: 8.6 of 16.1 GPU ms and 15.5 ms of host time per Qwen3-VL-8B decode step on the H200,
        # `benchmarks/results/latency_profile_dynamic_no_cudnn.txt`)
        return grouped_attention(query, key, value, visible, scaling)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=visible, scale=scaling, enable_gqa=enable_gqa
    )
    return out.transpose(1, 2).contiguous()
