"""PyTorch SDPA for Raincheck's forwards, with the same boolean visibility mask as the naive reference.

A forward of a few query rows over many keys under a dense mask (a fused step: the decode token and a chunk of
deferred rows over the whole static cache) goes to `grouped_attention` instead: SDPA's kernels tile the query rows
and do not split the keys, so a call of a few dozen rows costs several times a one-row decode call, where the
grouped product reads the keys and values once per KV head whatever the row count. One row stays on SDPA (its
decode kernel is as fast as the grouped path there). `GROUPED_MAX_ROWS` is the largest row count that takes the
grouped path. Longer masked forwards (a batch's shared prefill) are split so that no SDPA call covers more than
`MAX_SCORE_ELEMENTS` scores (`_dense_masked_sdpa`: memory, not speed). Where Triton runs, the grouped path's masked
softmax is one kernel (`softmax_triton`), and compiled 16-bit forwards with head dims up to `SPLIT_KEYS_MAX_DIM` take
`split_keys_triton` instead of the grouped path (the keys split over programs; the scores never written). The
timings behind these choices are in the benchmarks page (``benchmarks/attention_speed.py``).
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.nn.functional as F
from torch.nn.attention import bias

from ..triton_support import interpreted, triton_importable

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

# The split-keys kernel (`split_keys_triton`) for the grouped path's shapes, decided at import as the softmax kernel
_split_keys = None
if _masked_softmax is not None:
    try:
        from .split_keys_triton import split_keys_attention as _split_keys
    except Exception:
        _split_keys = None

#: the largest head dim that takes the split-keys kernel: at Qwen3.5-9B's 256 a fused step's 64 rows gained 1.2 us
#: of 31.9 per layer (benchmarks page, "The split-keys kernel")
SPLIT_KEYS_MAX_DIM = 128


def _eager_short() -> bool:
    """Inside an eager short forward (`eager_sdpa_backends`), not while a compiled step is traced."""
    return not torch.compiler.is_compiling() and _EAGER_SHORT.inside


def _split_keys_runs(query: torch.Tensor) -> bool:
    """Whether `split_keys_triton` takes these rows: a CUDA forward in 16-bit floats (its products are tensor-core
    dots; fp32 models keep the grouped path's fp32 products) with a head dim up to `SPLIT_KEYS_MAX_DIM`, not an
    eager short forward (host-bound: the grouped path's torch ops launch faster than two Triton kernels), or Triton's
    interpreter (tests)."""
    if _split_keys is None or query.shape[-1] > SPLIT_KEYS_MAX_DIM or _eager_short():
        return False
    if query.device.type == "cuda":
        return query.dtype in (torch.bfloat16, torch.float16)
    return query.device.type == "cpu" and _SOFTMAX_KERNEL_ON_CPU


def _softmax_kernel_runs(device: torch.device) -> bool:
    return _masked_softmax is not None and (device.type == "cuda" or (device.type == "cpu" and _SOFTMAX_KERNEL_ON_CPU))


#: the largest number of query rows (2 and up; see `sdpa_attention` for one row) that takes the grouped path: a
#: fused step's chunk and decode row (`RaincheckConfig.chunk_size`: 31 by default, 63 with Gated DeltaNet layers;
#: plus one); longer forwards (prefills) take SDPA, whose row tiles they fill
GROUPED_MAX_ROWS = 64


def grouped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scaling: float,
) -> torch.Tensor:
    """Same contract as `naive_attention` (a dense `visible`); returns ``[B, q, Hq, D]``.

    The ``g`` query heads that share a KV head are stacked as the rows of one matrix product per KV head (``[g q, D]
    x [D, k]``): keys and values are read once per KV head and never repeated. Precision as transformers' eager
    attention: the scaled query meets the keys in the inputs' dtype (fp32 accumulation; one eager row: the scale
    applied to the fp32 products), the mask and the softmax are fp32, the probabilities meet the values in the
    values' dtype. (fp32 scores would read and write twice the bytes, and were slower at the Qwen3-VL-8B shape.) A
    row that sees nothing returns zeros.
    """
    b, hq, q, d = query.shape
    hkv, k = key.shape[1], key.shape[2]
    g = hq // hkv
    if q == 1 and not torch.compiler.is_compiling():
        # (eager, one row: the stacked rows are a view) the scale as the product's alpha: one kernel, not two (eager
        # steps are host-bound; a decode step while deferred slots are pending runs this in every attention layer)
        rows, keys = query.reshape(b * hkv, g, d), key.reshape(b * hkv, k, d)
        scores = torch.baddbmm(rows.new_empty(b * hkv, g, k), rows, keys.transpose(-1, -2), beta=0.0, alpha=scaling)
        scores = scores.view(b, hkv, g, 1, k)
    else:
        if query.is_contiguous() or torch.compiler.is_compiling():
            rows = query.reshape(b, hkv, g * q, d) * scaling
        else:  # (eager, rows from a transpose) scaled straight into the stacked layout: one kernel, not a copy and
            # a product
            rows = torch.mul(query, scaling, out=query.new_empty(b, hq, q, d)).view(b, hkv, g * q, d)
        scores = torch.matmul(rows, key.transpose(-1, -2)).view(b, hkv, g, q, k)  # the inputs' dtype
    if _softmax_kernel_runs(scores.device) and not _eager_short():
        probs = _masked_softmax(scores, visible, value.dtype)  # one Triton kernel: see `softmax_triton`
    else:
        probs = grouped_softmax_torch(scores, visible, value.dtype)
    out = torch.matmul(probs, value).view(b, hq, q, d)
    return out.transpose(1, 2).contiguous()


def grouped_softmax_torch(scores: torch.Tensor, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The grouped path's softmax in torch (the reference of `softmax_triton.masked_softmax`): ``scores [b, hkv,
    g, q, k]`` upcast to fp32, keys `visible` (broadcasting to ``[b, hkv, q, k]``) hides at -inf, softmax over k,
    a row that sees nothing -> 0, cast to `dtype`: ``[b, hkv, g q, k]``."""
    b, hkv, g, q, k = scores.shape
    # hidden keys at -inf in the scores' own dtype (exact), then the softmax: written in `dtype` when that is the
    # scores' dtype (its CUDA and CPU kernels compute 16-bit inputs in fp32 and round once on the write: the values
    # of an fp32 softmax cast after, in one kernel instead of three, an upcast, the softmax and a downcast after
    # `nan_to_num`; eager steps are host-bound: every operator costs a launch per layer), else in fp32
    scores = torch.where(visible.unsqueeze(2), scores, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=None if dtype == scores.dtype else torch.float32)
    return probs.nan_to_num(0.0).to(dtype).view(b, hkv, g * q, k)


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
    key length is one more than the last step's, so a step of a new length builds a plan in every layer, and the
    host time of those builds dwarfed the step itself in the profiles of eager Raincheck decode steps (Full's steps,
    whose plans were cached, did not pay it). Flash and memory-efficient attention have no per-shape build. Set
    once per forward, not per layer; compiled steps (fixed shapes, CUDA graphs) and long forwards (a prefill: one
    new shape per turn) keep SDPA's own choice.

    The grouped path's Triton softmax is a `torch.library.triton_op`: one node inside a compiled graph, but called
    eagerly its launch costs several times the host time of the torch softmax's few launches, and eager steps are
    host-bound: eager forwards take the torch softmax."""
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
    if visible is not None and 1 < rows <= GROUPED_MAX_ROWS and visible.dtype == torch.bool and _split_keys_runs(query):
        return _split_keys(query, key, value, visible, scaling)
    if visible is not None and (1 < rows <= GROUPED_MAX_ROWS or (rows == 1 and GROUPED_MAX_ROWS and _eager_short())):
        # (one masked row of an eager short forward, e.g. a decode step while deferred slots are pending: SDPA
        # without cuDNN has no masked GQA kernel and falls back to its math path, which repeats K and V per query
        # head, more than half of such a decode step's GPU time in the profiles)
        return grouped_attention(query, key, value, visible, scaling)
    if visible is not None and not torch.compiler.is_compiling():
        return _dense_masked_sdpa(query, key, value, visible, scaling, enable_gqa)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=visible, scale=scaling, enable_gqa=enable_gqa
    )
    return out.transpose(1, 2).contiguous()


#: the most attention scores (batch rows x query heads x query rows x keys) one dense-masked SDPA call may cover
#: (`_dense_masked_sdpa`): 2^28, 1 GiB of fp32 scores
MAX_SCORE_ELEMENTS = 1 << 28


def score_blocks(batch: int, heads: int, rows: int, keys: int, limit: int) -> tuple[int, int]:
    """(batch rows, query rows) per SDPA call such that each call covers at most `limit` scores (at least one
    query row of one batch row per call)."""
    per_row = heads * rows * keys
    if per_row <= limit:
        return max(1, min(batch, limit // max(per_row, 1))), rows
    return 1, max(1, min(rows, limit // max(heads * keys, 1)))


def _dense_masked_sdpa(query, key, value, visible, scaling, enable_gqa) -> torch.Tensor:
    """SDPA under a dense boolean mask, split over batch rows and query rows so that no call covers more than
    `MAX_SCORE_ELEMENTS` scores. A masked call with grouped-query heads has no fused kernel on CUDA unless cuDNN
    takes it: SDPA's math path then repeats K and V per query head and materialises the fp32 scores (several
    ``[B, Hq, q, k]`` copies, per layer: at the Qwen3-VL-8B shape, a batched prefill of 8 rows of ~1,260 rows
    over ~4,150 keys (first turns with a 4096-token image, retention 0.3) ~20 GiB, of 8 follow-up turns that fold
    ~1,900 pending deferred rows into their prefill ~31 GiB; one row's batch-1 first-turn prefill runs unmasked,
    on flash). Every query row's attention
    depends only on its own row of the mask, so the blocks give the rows the unsplit call gives (up to float
    rounding)."""
    b, hq, q, _ = query.shape
    k = key.shape[2]
    rows_b, rows_q = score_blocks(b, hq, q, k, MAX_SCORE_ELEMENTS)
    if (rows_b >= b and rows_q >= q) or visible.dim() != 4:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scaling,
                                             enable_gqa=enable_gqa)
        return out.transpose(1, 2).contiguous()
    out = query.new_empty(b, q, hq, value.shape[-1])
    for b0 in range(0, b, rows_b):
        b1 = min(b0 + rows_b, b)
        mask_b = visible[b0:b1] if visible.shape[0] > 1 else visible
        for q0 in range(0, q, rows_q):
            q1 = min(q0 + rows_q, q)
            mask = mask_b[:, :, q0:q1] if mask_b.shape[2] > 1 else mask_b
            keys, values = (key, value) if key.shape[0] == 1 else (key[b0:b1], value[b0:b1])
            part = F.scaled_dot_product_attention(query[b0:b1, :, q0:q1], keys, values, attn_mask=mask,
                                                  scale=scaling, enable_gqa=enable_gqa)
            out[b0:b1, q0:q1] = part.transpose(1, 2)
    return out
