"""The grouped fused-step attention as one split-key Triton kernel pair (`grouped_attention_triton`; opt-in).

A fused step attends a few query rows (the decode token and a chunk of deferred rows) over the whole static cache
under a dense mask. `hf_raincheck.attention.sdpa.grouped_attention` runs it as two batched matrix products around
a softmax kernel, which writes and reads the ``[Hkv, G q, k]`` scores three times. Here, flash-decoding style:

- `_partial_kernel`, one program per (key split, batch x KV head, row tile): ``BLOCK_R`` of the ``G q`` rows
  (the query rows of the KV head's ``G`` query heads) as one tile, an online softmax over the split's keys (tiles
  of ``BLOCK_N``; masked keys and keys past the end at -inf), writing its unnormalised output, row max and row sum
  (fp32);
- `_combine_kernel`: per (batch x KV head, row tile), the splits' partials merged by their maxima, divided by the
  total, written as ``[B, q, Hq, D]`` in the values' dtype; a row that sees nothing gets zeros.

Precision: fp32 scores and softmax, the probabilities meet the values in the values' dtype (as transformers' eager
attention; fp32 inputs use IEEE fp32 products). Same contract as `naive_attention` with a dense mask, tested
against it (`tests/test_grouped_triton.py`, also under Triton's interpreter on the CPU).

The tile sizes are a `KernelConfig` (``HF_RAINCHECK_GROUPED_KERNEL_CONFIG="block_r=64,block_n=64,warps=4,
stages=2,programs=2"``, read at import; `benchmarks/attention_speed.py --kernel-configs` times several). A first
version (all ``G q`` rows in one tile, 32-key tiles, about two programs per SM: many splits, each writing a
128 x 128 fp32 partial) was slower than the grouped path on the H200 and was removed; this one exposes the
trade-off (fewer, longer splits; row tiles for parallelism instead) to measurement.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ..pruning.triton_support import sm_count


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes of `grouped_attention_triton`.

    Attributes:
        block_r: query rows per program (a power of two >= 16; capped at the padded row count).
        block_n: keys per inner tile (a power of two >= 16).
        warps: warps per partial program.
        stages: software-pipelining stages of the key loop.
        programs: partial programs to aim for per SM (sets the number of key splits).
    """

    block_r: int = 64
    block_n: int = 64
    warps: int = 4
    stages: int = 2
    programs: int = 2

    @classmethod
    def parse(cls, text: str) -> KernelConfig:
        """``"block_r=64,block_n=32"`` -> a config (unnamed fields keep their defaults)."""
        names = {f.name for f in fields(cls)}
        values = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = item.partition("=")
            if name not in names or not value.isdigit():
                raise ValueError(f"HF_RAINCHECK_GROUPED_KERNEL_CONFIG: {item!r} is not one of "
                                 f"{sorted(names)} = a positive integer")
            values[name] = int(value)
        config = cls(**values)
        for name in ("block_r", "block_n"):
            v = getattr(config, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"HF_RAINCHECK_GROUPED_KERNEL_CONFIG: {name} must be a power of two >= 16, got {v}")
        if config.warps not in (1, 2, 4, 8, 16) or config.stages < 1 or config.programs < 1:
            raise ValueError(f"HF_RAINCHECK_GROUPED_KERNEL_CONFIG: warps in 1/2/4/8/16, stages >= 1, programs >= 1; "
                             f"got {config}")
        return config


CONFIG = KernelConfig.parse(os.environ.get("HF_RAINCHECK_GROUPED_KERNEL_CONFIG", ""))


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, vis_ptr, acc_ptr, max_ptr, sum_ptr, keys, keys_per_split, scaling,
                    stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh, stride_vk,
                    stride_mb, stride_mh, stride_mq, stride_mk,
                    KV_HEADS: tl.constexpr, G: tl.constexpr, Q: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                    STAGES: tl.constexpr, IEEE: tl.constexpr):
    split = tl.program_id(0)
    bh = tl.program_id(1)
    tile = tl.program_id(2)
    b = (bh // KV_HEADS).to(tl.int64)
    h = (bh % KV_HEADS).to(tl.int64)
    r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
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
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    m_base = vis_ptr + b * stride_mb + h * stride_mh + qi[:, None] * stride_mq
    for n0 in tl.range(start, stop, BLOCK_N, num_stages=STAGES):
        n = n0 + tl.arange(0, BLOCK_N)
        n_in = n < stop
        k = tl.load(k_base + n[:, None] * stride_kk + d[None, :], mask=n_in[:, None] & d_in[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        seen = tl.load(m_base + n[None, :] * stride_mk, mask=r_in[:, None] & n_in[None, :], other=0) != 0
        s = tl.where(seen, s, float("-inf"))
        new_top = tl.maximum(top, tl.max(s, axis=1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        scale = tl.exp(top - shift)  # top = -inf: 0 (nothing accumulated yet)
        p = tl.exp(s - shift[:, None])
        total = total * scale + tl.sum(p, axis=1)
        v = tl.load(v_base + n[:, None] * stride_vk + d[None, :], mask=n_in[:, None] & d_in[None, :], other=0.0)
        if IEEE:
            acc = acc * scale[:, None] + tl.dot(p.to(v_ptr.dtype.element_ty), v, input_precision="ieee")
        else:
            acc = acc * scale[:, None] + tl.dot(p.to(v_ptr.dtype.element_ty), v)
        top = new_top
    at = (bh * SPLITS + split).to(tl.int64) * ROWS + r  # partials: [B Hkv, SPLITS, ROWS(, BLOCK_D)]
    tl.store(acc_ptr + at[:, None] * BLOCK_D + d[None, :], acc)
    tl.store(max_ptr + at, top)
    tl.store(sum_ptr + at, total)


@triton.jit
def _combine_kernel(acc_ptr, max_ptr, sum_ptr, out_ptr, stride_ob, stride_oq, stride_oh,
                    KV_HEADS: tl.constexpr, G: tl.constexpr, Q: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_D: tl.constexpr, TILE_R: tl.constexpr, SPLITS: tl.constexpr):
    bh = tl.program_id(0)
    tile = tl.program_id(1)
    b = (bh // KV_HEADS).to(tl.int64)
    h = (bh % KV_HEADS).to(tl.int64)
    r = tile * TILE_R + tl.arange(0, TILE_R)
    d = tl.arange(0, BLOCK_D)
    base = bh.to(tl.int64) * SPLITS * ROWS
    top = tl.full([TILE_R], float("-inf"), tl.float32)
    for s in range(SPLITS):
        top = tl.maximum(top, tl.load(max_ptr + base + s * ROWS + r))
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([TILE_R], dtype=tl.float32)
    acc = tl.zeros([TILE_R, BLOCK_D], dtype=tl.float32)
    for s in range(SPLITS):
        w = tl.exp(tl.load(max_ptr + base + s * ROWS + r) - shift)  # a split that saw nothing: 0
        total += w * tl.load(sum_ptr + base + s * ROWS + r)
        acc += w[:, None] * tl.load(acc_ptr + (base + s * ROWS + r)[:, None] * BLOCK_D + d[None, :])
    out = tl.where((total > 0)[:, None], acc / total[:, None], 0.0)
    head = h * G + r // Q
    qi = r % Q
    ok = (r < G * Q)[:, None] & (d < D)[None, :]
    tl.store(out_ptr + b * stride_ob + qi[:, None] * stride_oq + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok)


def split_plan(programs: int, keys: int, block_n: int, device: torch.device, per_sm: int) -> tuple[int, int]:
    """``(splits, keys per split)``: about `per_sm` partial programs per SM over `programs` (batch x KV head x row
    tile) programs per split, whole key tiles per split."""
    sms = sm_count(device) if device.type == "cuda" else 4  # (the interpreter: a few splits, to test them)
    tiles = max(1, triton.cdiv(keys, block_n))
    splits = max(1, min(tiles, triton.cdiv(per_sm * sms, programs)))
    per_split = triton.cdiv(tiles, splits) * block_n
    return (triton.cdiv(keys, per_split) if keys else 1), per_split


@triton_op("hf_raincheck::grouped_attention", mutates_args=())
def grouped_attention_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                             scaling: float, block_r: int = 64, block_n: int = 64, warps: int = 4, stages: int = 2,
                             programs: int = 2) -> torch.Tensor:
    """``query [B, Hq, q, D]``, ``key`` / ``value [B, Hkv, k, D]`` (last dim contiguous), a boolean ``visible``
    broadcasting to ``[B, Hkv, q, k]`` (head dim 1 or Hkv) -> ``[B, q, Hq, D]`` in the values' dtype. The tile
    sizes are `KernelConfig`'s fields."""
    b, hq, q, d = query.shape
    hkv, k = key.shape[1], key.shape[2]
    g = hq // hkv
    query = query if query.stride(-1) == 1 else query.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    vis = visible.expand(b, hkv, q, k)
    out = torch.empty((b, q, hq, d), dtype=value.dtype, device=value.device)
    block_r = min(block_r, max(16, triton.next_power_of_2(g * q)))
    rows = triton.cdiv(g * q, block_r) * block_r  # padded rows
    block_d = max(16, triton.next_power_of_2(d))
    row_tiles = rows // block_r
    splits, per_split = split_plan(b * hkv * row_tiles, k, block_n, query.device, programs)
    acc = torch.empty((b * hkv, splits, rows, block_d), dtype=torch.float32, device=query.device)
    top = torch.empty((b * hkv, splits, rows), dtype=torch.float32, device=query.device)
    total = torch.empty_like(top)
    shapes = dict(KV_HEADS=hkv, G=g, Q=q, D=d, ROWS=rows, BLOCK_D=block_d, SPLITS=splits)
    wrap_triton(_partial_kernel)[(splits, b * hkv, row_tiles)](
        query, key, value, vis, acc, top, total, k, per_split, scaling,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), vis.stride(0), vis.stride(1), vis.stride(2), vis.stride(3),
        BLOCK_R=block_r, BLOCK_N=block_n, STAGES=stages, IEEE=query.dtype == torch.float32, num_warps=warps,
        **shapes)
    tile_r = min(rows, 32)
    wrap_triton(_combine_kernel)[(b * hkv, rows // tile_r)](
        acc, top, total, out, out.stride(0), out.stride(1), out.stride(2), TILE_R=tile_r, num_warps=4, **shapes)
    return out


def grouped_attention_kernel(query, key, value, visible, scaling, config: KernelConfig | None = None):
    """`grouped_attention_triton` with the tile sizes of `config` (None: `CONFIG`, from the environment)."""
    c = CONFIG if config is None else config
    return grouped_attention_triton(query, key, value, visible, scaling, c.block_r, c.block_n, c.warps, c.stages,
                                    c.programs)
