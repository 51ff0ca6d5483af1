"""The grouped fused-step attention as one split-key Triton kernel pair (`grouped_attention_triton`; opt-in).

A fused step attends a few query rows (the decode token and a chunk of deferred rows) over the whole static cache
under a dense mask. `hf_raincheck.attention.sdpa.grouped_attention` runs it as two batched matrix products around
a softmax kernel, which writes and reads the ``[Hkv, G q, k]`` scores three times (Qwen3-VL-8B layer, 32 rows over
4352 keys: 31 us per call on the H200, where reading K and V once takes ~5 us). Here, flash-decoding style:

- `_partial_kernel`, one program per (batch x KV head, key split): the ``G q`` query rows of the KV head's ``G``
  query heads as one ``[rows, D]`` tile, an online softmax over its keys (tiles of ``BLOCK_N``; masked keys and
  keys past the end at -inf), writing its unnormalised output, row max and row sum (fp32);
- `_combine_kernel`: per (batch x KV head, row tile), the splits' partials merged by their maxima, divided by the
  total, written as ``[B, q, Hq, D]`` in the values' dtype; a row that sees nothing gets zeros.

Precision: fp32 scores and softmax, the probabilities meet the values in the values' dtype (as transformers' eager
attention; fp32 inputs use IEEE fp32 products). Same contract as `naive_attention` with a dense mask, tested
against it (`tests/test_grouped_triton.py`, also under Triton's interpreter on the CPU). Not timed on a GPU yet,
so `grouped_attention` takes it only with ``HF_RAINCHECK_GROUPED_KERNEL=triton`` (read at import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ..pruning.triton_support import sm_count

BLOCK_N = 32  # keys per tile (64 spills at 128 rows x head dim 128 on sm_90a: `tests/test_triton_compile.py`)
TARGET_PROGRAMS = 2  # partial programs per SM to aim for


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, vis_ptr, acc_ptr, max_ptr, sum_ptr, keys, keys_per_split, scaling,
                    stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh, stride_vk,
                    stride_mb, stride_mh, stride_mq, stride_mk,
                    KV_HEADS: tl.constexpr, G: tl.constexpr, Q: tl.constexpr, D: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                    IEEE: tl.constexpr):
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // KV_HEADS).to(tl.int64)
    h = (bh % KV_HEADS).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    head = h * G + r // Q  # query head of each row
    qi = r % Q  # query row of each row
    r_in = r < G * Q
    d = tl.arange(0, BLOCK_D)
    d_in = d < D
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + qi[:, None] * stride_qq + d[None, :],
                mask=r_in[:, None] & d_in[None, :], other=0.0)
    q = (q.to(tl.float32) * scaling).to(q_ptr.dtype.element_ty)  # the scaled query in the inputs' dtype
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    start = split * keys_per_split
    stop = tl.minimum(start + keys_per_split, keys)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_in = n < stop
        k = tl.load(k_ptr + b * stride_kb + h * stride_kh + n[:, None] * stride_kk + d[None, :],
                    mask=n_in[:, None] & d_in[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        seen = tl.load(vis_ptr + b * stride_mb + h * stride_mh + qi[:, None] * stride_mq + n[None, :] * stride_mk,
                       mask=r_in[:, None] & n_in[None, :], other=0) != 0
        s = tl.where(seen, s, float("-inf"))
        new_top = tl.maximum(top, tl.max(s, axis=1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        scale = tl.exp(top - shift)  # top = -inf: 0 (nothing accumulated yet)
        p = tl.exp(s - shift[:, None])
        total = total * scale + tl.sum(p, axis=1)
        v = tl.load(v_ptr + b * stride_vb + h * stride_vh + n[:, None] * stride_vk + d[None, :],
                    mask=n_in[:, None] & d_in[None, :], other=0.0)
        if IEEE:
            acc = acc * scale[:, None] + tl.dot(p.to(v_ptr.dtype.element_ty), v, input_precision="ieee")
        else:
            acc = acc * scale[:, None] + tl.dot(p.to(v_ptr.dtype.element_ty), v)
        top = new_top
    at = (bh * SPLITS + split).to(tl.int64) * BLOCK_R + r
    tl.store(acc_ptr + at[:, None] * BLOCK_D + d[None, :], acc)
    tl.store(max_ptr + at, top)
    tl.store(sum_ptr + at, total)


@triton.jit
def _combine_kernel(acc_ptr, max_ptr, sum_ptr, out_ptr, stride_ob, stride_oq, stride_oh,
                    KV_HEADS: tl.constexpr, G: tl.constexpr, Q: tl.constexpr, D: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, TILE_R: tl.constexpr, SPLITS: tl.constexpr):
    bh = tl.program_id(0)
    tile = tl.program_id(1)
    b = (bh // KV_HEADS).to(tl.int64)
    h = (bh % KV_HEADS).to(tl.int64)
    r = tile * TILE_R + tl.arange(0, TILE_R)
    d = tl.arange(0, BLOCK_D)
    base = bh.to(tl.int64) * SPLITS * BLOCK_R
    top = tl.full([TILE_R], float("-inf"), tl.float32)
    for s in range(SPLITS):
        top = tl.maximum(top, tl.load(max_ptr + base + s * BLOCK_R + r))
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([TILE_R], dtype=tl.float32)
    acc = tl.zeros([TILE_R, BLOCK_D], dtype=tl.float32)
    for s in range(SPLITS):
        w = tl.exp(tl.load(max_ptr + base + s * BLOCK_R + r) - shift)  # a split that saw nothing: 0
        total += w * tl.load(sum_ptr + base + s * BLOCK_R + r)
        acc += w[:, None] * tl.load(acc_ptr + (base + s * BLOCK_R + r)[:, None] * BLOCK_D + d[None, :])
    out = tl.where((total > 0)[:, None], acc / total[:, None], 0.0)
    head = h * G + r // Q
    qi = r % Q
    ok = (r < G * Q)[:, None] & (d < D)[None, :]
    tl.store(out_ptr + b * stride_ob + qi[:, None] * stride_oq + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok)


def split_plan(batch_heads: int, keys: int, device: torch.device) -> tuple[int, int]:
    """``(splits, keys per split)``: about `TARGET_PROGRAMS` partial programs per SM, whole tiles per split."""
    sms = sm_count(device) if device.type == "cuda" else 4  # the interpreter: a few splits, to test merging them
    tiles = max(1, triton.cdiv(keys, BLOCK_N))
    splits = max(1, min(tiles, triton.cdiv(TARGET_PROGRAMS * sms, batch_heads)))
    per_split = triton.cdiv(tiles, splits) * BLOCK_N
    return triton.cdiv(keys, per_split) if keys else 1, per_split


@triton_op("hf_raincheck::grouped_attention", mutates_args=())
def grouped_attention_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                             scaling: float) -> torch.Tensor:
    """``query [B, Hq, q, D]``, ``key`` / ``value [B, Hkv, k, D]`` (last dim contiguous), a boolean ``visible``
    broadcasting to ``[B, Hkv, q, k]`` (head dim 1 or Hkv) -> ``[B, q, Hq, D]`` in the values' dtype."""
    b, hq, q, d = query.shape
    hkv, k = key.shape[1], key.shape[2]
    g = hq // hkv
    query = query if query.stride(-1) == 1 else query.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    vis = visible.expand(b, hkv, q, k)
    out = torch.empty((b, q, hq, d), dtype=value.dtype, device=value.device)
    block_r = max(16, triton.next_power_of_2(g * q))
    block_d = max(16, triton.next_power_of_2(d))
    splits, per_split = split_plan(b * hkv, k, query.device)
    acc = torch.empty((b * hkv, splits, block_r, block_d), dtype=torch.float32, device=query.device)
    top = torch.empty((b * hkv, splits, block_r), dtype=torch.float32, device=query.device)
    total = torch.empty_like(top)
    shapes = dict(KV_HEADS=hkv, G=g, Q=q, D=d, BLOCK_R=block_r, BLOCK_D=block_d, SPLITS=splits)
    wrap_triton(_partial_kernel)[(splits, b * hkv)](
        query, key, value, vis, acc, top, total, k, per_split, scaling,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), vis.stride(0), vis.stride(1), vis.stride(2), vis.stride(3),
        BLOCK_N=BLOCK_N, IEEE=query.dtype == torch.float32, num_warps=8 if block_r * block_d >= 128 * 128 else 4,
        **shapes)
    tile_r = min(block_r, 32)
    wrap_triton(_combine_kernel)[(b * hkv, block_r // tile_r)](
        acc, top, total, out, out.stride(0), out.stride(1), out.stride(2), TILE_R=tile_r, num_warps=4, **shapes)
    return out
