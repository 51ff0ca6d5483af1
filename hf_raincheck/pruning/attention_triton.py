"""Triton kernels for `received_attention` (the attention each key of a ViT block receives), flash-attention
style: the ``[heads, queries, keys]`` probabilities are never materialised.

- pass 1 (`_lse_kernel`): per (head, query) the log-sum-exp of ``scale * q.k`` over the keys of the query's
  segment (online max / sum over key blocks, in base 2: ``log2(e)`` is folded into the scale);
- pass 2 (`_received_kernel`): per (head, key) the sum over the queries of its segment of the probabilities
  ``exp2(scale * log2(e) * q.k - lse)`` (lse in base 2), written to ``[heads, P]`` and averaged over heads in
  torch (deterministic: no atomics).

Entry points: `received_attention_triton` (both passes), `received_attention_from_lse` (pass 2 only, from the
natural-log LSE an attention kernel returns: `hf_raincheck.pruning.vision.FlashLSECapture` takes it from the
hooked ViT block's own flash attention); `lse_pass` / `received_pass` launch one pass each (timed by
``benchmarks/received_attention.py``, the tuning sweep of `CONFIGS`).

Segments (``cu_seqlens``) reach the kernels as per-row ``[start, stop)`` bounds, so a block of rows may straddle
segments: each program loops over the union of its rows' segments; only the blocks at segment edges mask pairs
from different segments (those inside every row's segment, nearly all of a large image, skip the mask).
Dots take the inputs' dtype (bf16 / fp16 on the tensor cores, fp32 exact: ``input_precision="ieee"``) and
accumulate in fp32. A head_dim that is not a power of two (Qwen3-VL: 72, Qwen2.5-VL: 80) is split into a
power-of-two part and a masked tail of at least 16 (72 = 64 + 16 with 8 valid), not padded to the next power.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable

import torch
import triton
import triton.language as tl

from ..triton_support import interpreted

#: (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages) per pass and input kind. 16-bit: the fastest of the tuning
#: sweep at a Qwen3-VL ViT's shape (16384 patches, 16 heads of 72, bf16, one segment); fp32 inputs (ieee dots on the
#: CUDA cores) are for tests and the interpreter, so they take small tiles. Callers may pass others (``configs=`` /
#: ``config=``), e.g. the tuning sweep ``benchmarks/received_attention.py``
CONFIGS = {
    ("lse", "16bit"): (256, 64, 8, 3),
    ("received", "16bit"): (128, 128, 4, 3),
    ("lse", "fp32"): (64, 32, 4, 2),
    ("received", "fp32"): (32, 64, 4, 2),
}


def _split_head_dim(d: int) -> tuple[int, int]:
    """``(D0, D1)``: a power-of-two part and a tail (0: none); both at least 16 (the smallest ``tl.dot`` K)."""
    if d <= 16:
        return 16, 0
    d0 = 1 << (d.bit_length() - 1)
    return d0, (0 if d == d0 else max(16, triton.next_power_of_2(d - d0)))


@triton.jit
def _load_rows(base, rows, row_ok, stride_row, stride_dim, dims, D: tl.constexpr, UPCAST: tl.constexpr):
    """``[rows, dims]`` tile of one head (rows past the segment or dims past ``D`` read as 0)."""
    ptrs = base + rows.to(tl.int64)[:, None] * stride_row + dims[None, :] * stride_dim
    tile = tl.load(ptrs, mask=row_ok[:, None] & (dims[None, :] < D), other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)  # dots stay exact: products of 16-bit floats fit fp32
    return tile


@triton.jit
def _block_ranges(start, stop, ok, P, BLOCK: tl.constexpr):
    """Loop bounds of a program whose rows (where `ok`) attend within ``[start, stop)``: blocks of `BLOCK` from
    ``lo`` up to ``hi`` (the union of the segments); those in ``[a, b)`` lie inside every row's segment (no mask)."""
    lo = tl.min(tl.where(ok, start, P), axis=0)
    hi = tl.max(tl.where(ok, stop, 0), axis=0)
    inner_start = tl.max(tl.where(ok, start, 0), axis=0)
    inner_stop = tl.min(tl.where(ok, stop, P), axis=0)
    a = lo + tl.cdiv(inner_start - lo, BLOCK) * BLOCK
    b = a + tl.maximum(inner_stop - a, 0) // BLOCK * BLOCK
    return lo, a, b, hi


@triton.jit
def _lse_step(m_i, l_i, q0, q1, k_base, n0, hi, start, stop, sk_row, sk_dim, qk_scale,
              D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              UPCAST: tl.constexpr):
    """One key block of pass 1: the online max ``m_i`` (of the raw dots) and sum ``l_i`` updated."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < hi
    k0 = _load_rows(k_base, cols, col_ok, sk_row, sk_dim, tl.arange(0, D0), D, UPCAST)
    s = tl.dot(q0, tl.trans(k0), input_precision="ieee")
    if D1 > 0:
        k1 = _load_rows(k_base, cols, col_ok, sk_row, sk_dim, D0 + tl.arange(0, D1), D, UPCAST)
        s = tl.dot(q1, tl.trans(k1), s, input_precision="ieee")
    if MASKED:
        inside = (cols[None, :] >= start[:, None]) & (cols[None, :] < stop[:, None])
        s = tl.where(inside, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s * qk_scale - (m_new * qk_scale)[:, None])
    l_i = l_i * tl.exp2((m_i - m_new) * qk_scale) + tl.sum(p, axis=1)
    return m_new, l_i


@triton.jit
def _lse_blocks(m_i, l_i, q0, q1, k_base, n_lo, n_hi, hi, start, stop, sk_row, sk_dim, qk_scale,
                D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                UPCAST: tl.constexpr):
    """`_lse_step` over the key blocks starting in ``[n_lo, n_hi)``."""
    for n0 in range(n_lo, n_hi, BLOCK_N):
        m_i, l_i = _lse_step(m_i, l_i, q0, q1, k_base, n0, hi, start, stop, sk_row, sk_dim, qk_scale,
                             D, D0, D1, BLOCK_N, MASKED, UPCAST)
    return m_i, l_i


@triton.jit
def _lse_kernel(
    Q, K, SEG_START, SEG_STOP, LSE,
    P, sq_row, sq_head, sq_dim, sk_row, sk_head, sk_dim, qk_scale,
    D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``LSE[h, i] = log2 sum_j exp2(qk_scale * q_i.k_j)`` over the keys ``j`` of query ``i``'s segment."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < P
    start = tl.load(SEG_START + rows, mask=row_ok, other=0)
    stop = tl.load(SEG_STOP + rows, mask=row_ok, other=0)
    lo, a, b, hi = _block_ranges(start, stop, row_ok, P, BLOCK_N)
    q_base = Q + head.to(tl.int64) * sq_head
    k_base = K + head.to(tl.int64) * sk_head
    q0 = _load_rows(q_base, rows, row_ok, sq_row, sq_dim, tl.arange(0, D0), D, UPCAST)
    q1 = q0
    if D1 > 0:
        q1 = _load_rows(q_base, rows, row_ok, sq_row, sq_dim, D0 + tl.arange(0, D1), D, UPCAST)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # running max of the raw dots (finite: no inf - inf)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    # key blocks inside every row's segment first (no mask), then those at segment edges
    m_i, l_i = _lse_blocks(m_i, l_i, q0, q1, k_base, a, b, hi, start, stop, sk_row, sk_dim, qk_scale,
                           D, D0, D1, BLOCK_N, False, UPCAST)
    m_i, l_i = _lse_blocks(m_i, l_i, q0, q1, k_base, lo, a, hi, start, stop, sk_row, sk_dim, qk_scale,
                           D, D0, D1, BLOCK_N, True, UPCAST)
    m_i, l_i = _lse_blocks(m_i, l_i, q0, q1, k_base, b, hi, hi, start, stop, sk_row, sk_dim, qk_scale,
                           D, D0, D1, BLOCK_N, True, UPCAST)
    # rows without keys (outside every segment): l_i = 0 -> -inf, never read by pass 2
    tl.store(LSE + head.to(tl.int64) * P + rows, m_i * qk_scale + tl.log2(l_i), mask=row_ok)


@triton.jit
def _received_step(acc, k0, k1, q_base, lse_base, m0, hi, start, stop, sq_row, sq_dim, qk_scale,
                   D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                   UPCAST: tl.constexpr):
    """One query block of pass 2: ``acc`` (per key) plus the block's probabilities."""
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < hi
    q0 = _load_rows(q_base, rows, row_ok, sq_row, sq_dim, tl.arange(0, D0), D, UPCAST)
    s = tl.dot(k0, tl.trans(q0), input_precision="ieee")  # [keys, queries]
    if D1 > 0:
        q1 = _load_rows(q_base, rows, row_ok, sq_row, sq_dim, D0 + tl.arange(0, D1), D, UPCAST)
        s = tl.dot(k1, tl.trans(q1), s, input_precision="ieee")
    lse = tl.load(lse_base + rows, mask=row_ok, other=float("inf"))
    p = tl.exp2(s * qk_scale - lse[None, :])
    if MASKED:
        inside = (rows[None, :] >= start[:, None]) & (rows[None, :] < stop[:, None])
        p = tl.where(inside, p, 0.0)
    return acc + tl.sum(p, axis=1)


@triton.jit
def _received_blocks(acc, k0, k1, q_base, lse_base, m_lo, m_hi, hi, start, stop, sq_row, sq_dim, qk_scale,
                     D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr,
                     MASKED: tl.constexpr, UPCAST: tl.constexpr):
    """`_received_step` over the query blocks starting in ``[m_lo, m_hi)``."""
    for m0 in range(m_lo, m_hi, BLOCK_M):
        acc = _received_step(acc, k0, k1, q_base, lse_base, m0, hi, start, stop, sq_row, sq_dim, qk_scale,
                             D, D0, D1, BLOCK_M, MASKED, UPCAST)
    return acc


@triton.jit
def _received_kernel(
    Q, K, SEG_START, SEG_STOP, LSE, OUT,
    P, sq_row, sq_head, sq_dim, sk_row, sk_head, sk_dim, qk_scale,
    D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``OUT[h, j] = sum_i exp2(qk_scale * q_i.k_j - LSE[h, i])`` over the queries ``i`` of key ``j``'s segment."""
    pid_n = tl.program_id(0)
    head = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < P
    start = tl.load(SEG_START + cols, mask=col_ok, other=0)
    stop = tl.load(SEG_STOP + cols, mask=col_ok, other=0)
    lo, a, b, hi = _block_ranges(start, stop, col_ok, P, BLOCK_M)
    q_base = Q + head.to(tl.int64) * sq_head
    k_base = K + head.to(tl.int64) * sk_head
    lse_base = LSE + head.to(tl.int64) * P
    k0 = _load_rows(k_base, cols, col_ok, sk_row, sk_dim, tl.arange(0, D0), D, UPCAST)
    k1 = k0
    if D1 > 0:
        k1 = _load_rows(k_base, cols, col_ok, sk_row, sk_dim, D0 + tl.arange(0, D1), D, UPCAST)
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc = _received_blocks(acc, k0, k1, q_base, lse_base, a, b, hi, start, stop, sq_row, sq_dim, qk_scale,
                           D, D0, D1, BLOCK_M, False, UPCAST)
    acc = _received_blocks(acc, k0, k1, q_base, lse_base, lo, a, hi, start, stop, sq_row, sq_dim, qk_scale,
                           D, D0, D1, BLOCK_M, True, UPCAST)
    acc = _received_blocks(acc, k0, k1, q_base, lse_base, b, hi, hi, start, stop, sq_row, sq_dim, qk_scale,
                           D, D0, D1, BLOCK_M, True, UPCAST)
    tl.store(OUT + head.to(tl.int64) * P + cols, acc, mask=col_ok)


def segment_bounds(cu_seqlens: torch.Tensor | Iterable[int], total: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row ``[total]`` int32 ``start, stop`` of its segment of `cu_seqlens` (no host sync); rows outside every
    segment get the empty ``[row, row)``."""
    cu = torch.as_tensor(cu_seqlens, device=device).to(torch.int64).clamp(0, total)
    rows = torch.arange(total, device=device, dtype=torch.int64)
    if cu.numel() < 2:
        return rows.to(torch.int32), rows.to(torch.int32)
    seg = torch.searchsorted(cu, rows, right=True) - 1  # the last boundary <= row: skips empty segments
    inside = (seg >= 0) & (seg < cu.numel() - 1)
    seg = seg.clamp(0, cu.numel() - 2)
    start = torch.where(inside, cu[seg], rows)
    stop = torch.where(inside, cu[seg + 1], rows)
    return start.to(torch.int32), stop.to(torch.int32)


#: natural log -> base 2 (the kernels' LSE is in base 2)
LOG2E = math.log2(math.e)


def _check_config(config) -> tuple[int, int, int, int]:
    """`config` as ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` ints, or ValueError."""
    try:
        bm, bn, warps, stages = (int(x) for x in config)
    except (TypeError, ValueError):
        raise ValueError(f"a config is (BLOCK_M, BLOCK_N, num_warps, num_stages), got {config!r}") from None
    powers = all(x > 0 and x & (x - 1) == 0 for x in (bm, bn, warps))
    if not powers or min(bm, bn) < 16 or stages < 1:
        raise ValueError(f"BLOCK_M, BLOCK_N (>= 16) and num_warps must be powers of two, num_stages >= 1: {config!r}")
    return bm, bn, warps, stages


def _config(pass_name: str, kind: str, config=None) -> tuple[int, int, int, int]:
    """The launch config of pass `pass_name` (``"lse"`` / ``"received"``) for inputs of `kind`: `config` when given,
    else the default of `CONFIGS`."""
    return _check_config(CONFIGS[(pass_name, kind)] if config is None else config)


def prepare_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(q, k, kind)``: q, k checked (``[P, heads, head_dim]``, one shape) and as the kernels read them (bf16 / fp16
    kept, anything else in fp32); kind ``"16bit"`` or ``"fp32"`` (the key of `CONFIGS`)."""
    if q.shape != k.shape or q.dim() != 3:
        raise ValueError(f"q and k must be [P, heads, head_dim] of one shape, got {tuple(q.shape)}, {tuple(k.shape)}")
    if not (q.dtype == k.dtype and q.dtype in (torch.bfloat16, torch.float16)):
        q, k = q.float(), k.float()
    return q, k, _kind(q)


def _kind(q: torch.Tensor) -> str:
    """The `CONFIGS` key of inputs prepared by `prepare_qk`: ``"fp32"`` or ``"16bit"``."""
    return "fp32" if q.dtype == torch.float32 else "16bit"


def _shared(q: torch.Tensor, k: torch.Tensor, scale: float) -> tuple[tuple, dict]:
    """The kernels' common runtime arguments and constexprs."""
    total, _, d = q.shape
    d0, d1 = _split_head_dim(d)
    # under the interpreter, tiles go to fp32 before the dots: its bf16 dots multiply raw bits
    constexprs = dict(D=d, D0=d0, D1=d1, UPCAST=interpreted())
    return (total, *q.stride(), *k.stride(), float(scale) * LOG2E), constexprs


def _on_device(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def lse_pass(q, k, start, stop, scale: float, config=None) -> torch.Tensor:
    """Pass 1: ``[heads, P]`` fp32 base-2 log-sum-exp of each query over the keys of its segment.

    q, k from `prepare_qk`; start, stop from `segment_bounds`; config ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``
    (None: `CONFIGS`)."""
    total, heads, _ = q.shape
    bm, bn, warps, stages = _config("lse", _kind(q), config)
    lse = torch.empty(heads, total, dtype=torch.float32, device=q.device)
    args, constexprs = _shared(q, k, scale)
    with _on_device(q):
        _lse_kernel[(triton.cdiv(total, bm), heads)](
            q, k, start, stop, lse, *args, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **constexprs
        )
    return lse


def received_pass(q, k, start, stop, lse2: torch.Tensor, scale: float, config=None) -> torch.Tensor:
    """Pass 2: ``[heads, P]`` fp32, per head and key the probabilities it receives from the queries of its segment,
    given their base-2 log-sum-exp `lse2` ``[heads, P]`` fp32 contiguous (`lse_pass`). Arguments as `lse_pass`."""
    total, heads, _ = q.shape
    if lse2.shape != (heads, total) or lse2.dtype != torch.float32 or not lse2.is_contiguous():
        raise ValueError(f"lse must be a contiguous fp32 [heads, P] = [{heads}, {total}] tensor, got "
                         f"{lse2.dtype} {tuple(lse2.shape)}")
    bm, bn, warps, stages = _config("received", _kind(q), config)
    out = torch.empty(heads, total, dtype=torch.float32, device=q.device)
    args, constexprs = _shared(q, k, scale)
    with _on_device(q):
        _received_kernel[(triton.cdiv(total, bn), heads)](
            q, k, start, stop, lse2, out, *args, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
            **constexprs
        )
    return out


@torch.no_grad()
def received_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor | Iterable[int],
    scale: float,
    configs: dict | None = None,
) -> torch.Tensor:
    """`hf_raincheck.pruning.vision.received_attention` with the Triton kernels: ``[P]`` fp32.

    q, k: ``[P, heads, head_dim]``, any strides (e.g. slices of a qkv tensor); bf16 / fp16 (tensor-core dots) or
    anything else (computed in fp32). configs: launch configs ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` by pass
    (``{"lse": ..., "received": ...}``, either may be left out) in place of `CONFIGS` (tuning)."""
    q, k, _ = prepare_qk(q, k)
    configs = dict(configs or {})
    unknown = set(configs) - {"lse", "received"}
    if unknown:
        raise ValueError(f"configs are keyed by pass, 'lse' / 'received'; got {sorted(unknown)}")
    total, heads, _ = q.shape
    if total == 0 or heads == 0:
        return torch.zeros(total, dtype=torch.float32, device=q.device)
    start, stop = segment_bounds(cu_seqlens, total, q.device)
    lse2 = lse_pass(q, k, start, stop, scale, configs.get("lse"))
    return received_pass(q, k, start, stop, lse2, scale, configs.get("received")).mean(dim=0)


@torch.no_grad()
def received_attention_from_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor | Iterable[int],
    scale: float,
    config=None,
) -> torch.Tensor:
    """`received_attention_triton` given each query's log-sum-exp (pass 2 only): ``[P]`` fp32.

    lse: ``[heads, P]``, the natural log of ``sum_j exp(scale * q_i.k_j)`` over the keys of query ``i``'s segment,
    as an attention kernel returns it (SDPA's flash backend: its ``logsumexp`` ``[1, heads, P]``, batch dim dropped);
    rows outside every segment are never read. config: pass 2's launch config in place of `CONFIGS`."""
    q, k, _ = prepare_qk(q, k)
    total, heads, _ = q.shape
    if lse.shape != (heads, total):
        raise ValueError(f"lse must be [heads, P] = [{heads}, {total}], got {tuple(lse.shape)}")
    if total == 0 or heads == 0:
        return torch.zeros(total, dtype=torch.float32, device=q.device)
    start, stop = segment_bounds(cu_seqlens, total, q.device)
    lse2 = (lse.to(torch.float32) * LOG2E).contiguous()
    return received_pass(q, k, start, stop, lse2, scale, config).mean(dim=0)
