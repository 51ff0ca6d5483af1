"""Masked attention of a few query rows over a whole cache, the keys split over programs (`split_keys_attention`).

A compiled fused step's attention layer runs its rows (a chunk of deferred rows and the decode row) over every slot
of the static cache under a dense boolean mask (docs/design.md rule 2). `sdpa.grouped_attention` does it in three
kernels that write and read the scores (``[g q, k]`` per KV head) twice. Here, as flash-decoding does, the keys are
split into `splits` ranges: one program per (range, row, KV head, block of stacked rows) holds the ``g`` query heads
of its KV head as the rows of one tile (keys and values read once per KV head, never repeated), runs an online
softmax over its range's keys in blocks, and writes its unnormalised output with its running max and sum; a second
kernel combines the ranges and writes ``[B, q, Hq, D]`` (the layout the attention module wants: no transpose copy).

Precision as SDPA's flash kernels: scores and the softmax in fp32, the probabilities meet the values in their
dtype, fp32 accumulation. A row that sees nothing returns zeros (as `naive.naive_attention`, the reference the
tests compare it with). A `torch.library.triton_op`: compiled steps keep the two kernels as they are and CUDA graphs
replay them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ..triton_support import sm_count

#: keys per block of a program's loop, stacked query rows (query heads x rows) per program, warps per program, and
#: programs per streaming multiprocessor to aim for (the key ranges are chosen to fill the GPU that often). A sweep
#: on the H200 at Qwen3-VL-8B's heads, 32 rows over 4352 keys (``benchmarks/attention_speed.py
#: --split-configs``): 128 rows, 64 keys, 8 warps, 16 ranges 19.9 us per call against 20.8 for 64 rows / 4 warps /
#: 8 ranges and 30.7 for the grouped path
BLOCK_N = 64
BLOCK_M = 128
WARPS = 8
WAVES = 1


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, vis_ptr, acc_ptr, max_ptr, sum_ptr,
                    rows, keys, groups, kv_heads, keys_per_split, scale,
                    sq_b, sq_h, sq_t, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, svis_b, svis_t, svis_n,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    scale = tl.full([], scale, tl.float32)  # (compiled graphs pass Python floats as fp64)
    split = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // kv_heads
    hkv = bh % kv_heads
    r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # stacked rows: query head (within the group) x row
    in_r = r < groups * rows
    t = r % rows
    head = hkv * groups + r // rows
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + t[:, None] * sq_t + d[None, :], mask=in_r[:, None],
                other=0.0)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    start = split * keys_per_split
    stop = tl.minimum(start + keys_per_split, keys)
    k_base = k_ptr + b * sk_b + hkv * sk_h
    v_base = v_ptr + b * sv_b + hkv * sv_h
    vis_base = vis_ptr + b * svis_b + t * svis_t
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        in_n = n < stop
        kt = tl.load(k_base + n[None, :] * sk_n + d[:, None], mask=in_n[None, :], other=0.0)  # [D, N]
        s = tl.dot(q, kt) * scale  # fp32
        seen = tl.load(vis_base[:, None] + n[None, :] * svis_n, mask=in_r[:, None] & in_n[None, :], other=0) != 0
        s = tl.where(seen, s, float("-inf"))
        new_top = tl.maximum(top, tl.max(s, 1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        alpha = tl.exp(top - shift)  # 0 while nothing was seen (-inf - shift)
        p = tl.exp(s - shift[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * sv_n + d[None, :], mask=in_n[:, None], other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        top = new_top
    # partials [splits, B * H_kv, rows_padded(, D)]
    slot = (split * tl.num_programs(1) + bh) * (tl.num_programs(2) * BLOCK_M) + r
    tl.store(acc_ptr + slot[:, None] * HEAD_DIM + d[None, :], acc)
    tl.store(max_ptr + slot, top)
    tl.store(sum_ptr + slot, total)


@triton.jit
def _combine_kernel(acc_ptr, max_ptr, sum_ptr, out_ptr, rows, groups, kv_heads, splits, split_stride, padded,
                    so_b, so_t, so_h, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # over [B, H_kv, groups * rows]: one stacked row of one KV head
    r = row % (groups * rows)
    bh = row // (groups * rows)
    b = bh // kv_heads
    head = (bh % kv_heads) * groups + r // rows
    t = r % rows
    s = tl.arange(0, SPLITS)
    in_s = s < splits
    slot = s * split_stride + bh * padded + r
    tops = tl.load(max_ptr + slot, mask=in_s, other=float("-inf"))
    sums = tl.load(sum_ptr + slot, mask=in_s, other=0.0)
    top = tl.max(tops, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(tops - shift)  # 0 for ranges that saw nothing
    total = tl.sum(sums * weight, 0)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.load(acc_ptr + slot[:, None] * HEAD_DIM + d[None, :], mask=in_s[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * so_b + t * so_t + head * so_h + d, out.to(out_ptr.dtype.element_ty))


def plan(batch: int, kv_heads: int, stacked_rows: int, keys: int, device: torch.device, splits: int = 0,
         block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> tuple[int, int]:
    """``(splits, keys per split)``: the key ranges of one call (`splits` 0: as many as fill the GPU `WAVES`
    times over the (row, KV head, row block) programs, each range at least one `block_n` block)."""
    blocks = max(1, triton.cdiv(keys, block_n))
    if not splits:
        programs = batch * kv_heads * triton.cdiv(stacked_rows, block_m)
        splits = max(1, WAVES * sm_count(device) // max(programs, 1))
    splits = min(splits, blocks)
    per = triton.cdiv(blocks, splits) * block_n
    return triton.cdiv(keys, per), per


def launch_split_keys(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                      scaling: float, splits: int = 0, block_m: int = 0, block_n: int = 0, warps: int = 0,
                      stages: int = 0) -> torch.Tensor:
    """`split_keys_attention`'s launches with their tiling: `splits` key ranges, `block_m` stacked rows and
    `block_n` keys per block, `warps` and software-pipelining `stages` of the first kernel. 0 takes the default:
    `plan`'s ranges; `BLOCK_M`, or the stacked rows' power of two where fewer; `BLOCK_N` (half of it above head
    dim 128); `WARPS` (4 below 128 rows); Triton's stages. Tests and benchmarks pass other tilings; the package
    always takes the defaults."""
    b, hq, rows, dim = query.shape
    hkv, keys = key.shape[1], key.shape[2]
    if hq % hkv or key.shape != (b, hkv, keys, dim) or value.shape != key.shape:
        raise ValueError(f"split_keys_attention: query [B, Hq, q, D], key / value [B, Hkv, k, D] with Hkv dividing "
                         f"Hq; got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if dim < 16 or dim & (dim - 1):
        raise ValueError(f"split_keys_attention: head dim must be a power of two >= 16, got {dim}")
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size and (size < 16 or size & (size - 1)):
            raise ValueError(f"{name} must be 0 (the default) or a power of two >= 16, got {size}")
    if warps and warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"warps must be 0 (the default) or one of 1, 2, 4, 8, 16, got {warps}")
    if splits < 0 or stages < 0:
        raise ValueError(f"splits and stages must be >= 0 (0: the default), got {splits}, {stages}")
    groups = hq // hkv
    out = torch.empty((b, rows, hq, dim), dtype=query.dtype, device=query.device)
    if not out.numel():
        return out
    if keys == 0:
        return out.zero_()
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    vis = visible.expand(b, 1, rows, keys)  # broadcast dims: stride 0
    stacked = groups * rows
    block_m = block_m or min(BLOCK_M, max(16, triton.next_power_of_2(stacked)))
    block_n = block_n or (BLOCK_N if dim <= 128 else BLOCK_N // 2)
    splits, per = plan(b, hkv, stacked, keys, query.device, splits, block_m, block_n)
    row_blocks = triton.cdiv(stacked, block_m)
    padded = row_blocks * block_m
    acc = torch.empty((splits, b * hkv, padded, dim), dtype=torch.float32, device=query.device)
    tops = torch.empty((splits, b * hkv, padded), dtype=torch.float32, device=query.device)
    sums = torch.empty_like(tops)
    options = dict(num_warps=warps or (WARPS if block_m >= BLOCK_M else 4))
    if stages:
        options["num_stages"] = stages
    wrap_triton(_partial_kernel)[(splits, b * hkv, row_blocks)](
        query, key, value, vis, acc, tops, sums, rows, keys, groups, hkv, per, scaling,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), vis.stride(0), vis.stride(2), vis.stride(3),
        HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, **options)
    wrap_triton(_combine_kernel)[(b * hkv * stacked,)](
        acc, tops, sums, out, rows, groups, hkv, splits, b * hkv * padded, padded,
        out.stride(0), out.stride(1), out.stride(2), HEAD_DIM=dim, SPLITS=max(2, triton.next_power_of_2(splits)),
        num_warps=4 if dim <= 128 else 8)
    return out


@triton_op("hf_raincheck::split_keys_attention", mutates_args=())
def split_keys_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                         scaling: float) -> torch.Tensor:
    """Same contract as `naive.naive_attention` with a dense `visible` (bool, broadcasting to ``[B, 1, q, k]``):
    ``query [B, Hq, q, D]``, ``key`` / ``value`` ``[B, Hkv, k, D]`` -> ``[B, q, Hq, D]`` in the query's dtype."""
    return launch_split_keys(query, key, value, visible, scaling)
