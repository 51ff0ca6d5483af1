"""The grouped fused-step attention's masked softmax as one Triton kernel (`masked_softmax`).

`hf_raincheck.attention.sdpa.grouped_attention` stacks the query heads of a KV head as rows, so a fused step of a
Qwen3-VL-8B layer (32 query rows, 4 query heads per KV head) has 8 x 128 score rows of a few thousand keys.
Compiled, the torch softmax over them (mask, fp32 softmax, NaN -> 0, cast) became one Inductor reduction that
Inductor split (too few rows for its unsplit kernel, which also turns its online softmax off), several times
slower than reading the scores and writing the probabilities once. Here one program per row reads the row once
(keys up to `ONE_PASS_KEYS`; longer rows take an online max / sum pass, then a second), the mask by its strides
(broadcast dims have stride 0: nothing is expanded), and writes the probabilities in the values' dtype.

Same arithmetic as the torch path it replaces (`sdpa.grouped_softmax_torch`, the reference it is tested
against): scores upcast to fp32, masked keys at -inf, ``exp(x - max) / sum``, a row that sees nothing -> zeros.
Only the order of the fp32 sum differs. A `torch.library.triton_op`, so compiled steps keep the kernel as it is
(Inductor calls the user kernel inside its graph; CUDA graphs replay it). The tiling is fixed: a sweep of block
sizes and warps (``benchmarks/attention_speed.py --softmax-configs``, `launch_masked_softmax`'s `block` and
`warps`) found none better than this default at a fused step's shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

#: rows of at most this many keys are read once (held in registers); longer rows are read twice
ONE_PASS_KEYS = 8192
LONG_BLOCK = 2048  # keys per block of the two-pass kernel


@triton.jit
def _masked_softmax_kernel(scores_ptr, visible_ptr, out_ptr, keys, heads, groups, rows,
                           stride_vb, stride_vh, stride_vq, stride_vk,
                           BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # over [batch, heads, groups, rows]
    qi = row % rows
    hb = row // (rows * groups)
    h = hb % heads
    b = hb // heads
    src = scores_ptr + row * keys
    dst = out_ptr + row * keys
    vis = visible_ptr + b * stride_vb + h * stride_vh + qi * stride_vq
    offs = tl.arange(0, BLOCK_K)
    if ONE_PASS:
        inside = offs < keys
        seen = tl.load(vis + offs * stride_vk, mask=inside, other=0) != 0
        x = tl.load(src + offs, mask=inside, other=0.0).to(tl.float32)
        x = tl.where(seen, x, float("-inf"))
        top = tl.max(x, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)
        e = tl.exp(x - top)
        total = tl.sum(e, axis=0)
        p = tl.where(total > 0, e / total, 0.0)
        tl.store(dst + offs, p.to(out_ptr.dtype.element_ty), mask=inside)
    else:
        top = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], dtype=tl.float32)
        for start in range(0, keys, BLOCK_K):
            at = start + offs
            inside = at < keys
            seen = tl.load(vis + at * stride_vk, mask=inside, other=0) != 0
            x = tl.load(src + at, mask=inside, other=0.0).to(tl.float32)
            x = tl.where(seen, x, float("-inf"))
            new_top = tl.maximum(top, tl.max(x, axis=0))
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)
            total = total * tl.exp(tl.where(top == float("-inf"), float("-inf"), top - shift)) + tl.sum(
                tl.exp(x - shift), axis=0)
            top = new_top
        shift = tl.where(top == float("-inf"), 0.0, top)
        for start in range(0, keys, BLOCK_K):
            at = start + offs
            inside = at < keys
            seen = tl.load(vis + at * stride_vk, mask=inside, other=0) != 0
            x = tl.load(src + at, mask=inside, other=0.0).to(tl.float32)
            e = tl.exp(tl.where(seen, x, float("-inf")) - shift)
            p = tl.where(total > 0, e / total, 0.0)
            tl.store(dst + at, p.to(out_ptr.dtype.element_ty), mask=inside)


def launch_masked_softmax(scores: torch.Tensor, visible: torch.Tensor, out_dtype: torch.dtype, block: int = 0,
                          warps: int = 0) -> torch.Tensor:
    """`masked_softmax`'s kernel launch, with its tiling: `block` keys per block (0: a row of up to
    `ONE_PASS_KEYS` keys in one block, read once; longer rows in blocks of `LONG_BLOCK`, read twice; a row longer
    than a nonzero `block` takes the two-pass kernel), `warps` per program (0: by the block's size). Tests and
    benchmarks call it with other tilings; the package always takes the defaults (through `masked_softmax`)."""
    if block and (block < 16 or block & (block - 1)):
        raise ValueError(f"block must be 0 (automatic) or a power of two >= 16, got {block}")
    if warps and warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"warps must be 0 (automatic) or one of 1, 2, 4, 8, 16, 32, got {warps}")
    b, h, g, q, k = scores.shape
    scores = scores.contiguous()
    vis = visible.expand(b, h, q, k)  # broadcast dims: stride 0 (bool, read as Triton's i1)
    out = torch.empty((b, h, g * q, k), dtype=out_dtype, device=scores.device)
    one_pass = k <= (block or ONE_PASS_KEYS)
    block = max(16, triton.next_power_of_2(k)) if one_pass else (block or LONG_BLOCK)
    warps = warps or (4 if block <= 2048 else (8 if block <= 4096 else 16))
    if b * h * g * q and k:
        wrap_triton(_masked_softmax_kernel)[(b * h * g * q,)](
            scores, vis, out, k, h, g, q, vis.stride(0), vis.stride(1), vis.stride(2), vis.stride(3),
            BLOCK_K=block, ONE_PASS=one_pass, num_warps=warps)
    return out


@triton_op("hf_raincheck::grouped_masked_softmax", mutates_args=())
def masked_softmax(scores: torch.Tensor, visible: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``scores [B, H, G, Q, K]`` (contiguous) and a boolean ``visible`` that broadcasts to ``[B, H, Q, K]`` ->
    fp32 softmax over K of the visible keys, in `out_dtype`, ``[B, H, G * Q, K]`` (a row that sees nothing: 0)."""
    return launch_masked_softmax(scores, visible, out_dtype)
