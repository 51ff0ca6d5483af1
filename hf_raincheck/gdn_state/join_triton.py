"""The GDN join of a compiled step of deferred rows alone (the unfused control, ``fused=False``) as one Triton kernel
(`join_prefix_`; compiled fused steps, batch 1 and static batches, leave theirs pending: `ops.lazy_window_`).

After a fused step's deferred rows moved a prefix checkpoint from ``old`` to ``new``, the live state takes the
join and the checkpoint takes the new state (docs/design.md rule 3):

    S_live += P_tail (new - old);  old <- new

on the live ``[S | P_tail]`` buffer ``[B, H_v, K, V + K]`` and the checkpoint ``[B, H_v, K, V]`` (fp32). In torch
that is three passes over fp32 states (the difference, written out; an fp32 batched GEMM, which cuBLAS runs on SIMT
cores; the checkpoint's copy). At a Qwen3.5-9B B = 16 fused step they cost 74 + 32 us per GDN layer (2.5 of the
step's 19.2 GPU ms). Here one program per (row, head, block of V columns) reads ``P_tail`` and the two checkpoints'
columns once, forms the difference in registers, writes the new checkpoint columns, and accumulates
the product into S on tensor cores in three TF32 products (``input_precision="tf32x3"``: the low parts' products
restore fp32 accuracy, unlike plain TF32's 10-bit mantissa). CUDA-graph replays of 24 calls
(`benchmarks/gdn_join.py`), torch path -> kernel: 112.8 -> 94.7 us at B = 16, 60.5 -> 46.0 at B = 8, 13.6 -> 10.8
at B = 1.

The op is a `torch.library.custom_op` (opaque to the compiler, its Triton launch made at run time and captured by
CUDA graphs), as the package's other in-place GDN ops (`ops.join_`, `ops.advance_`), so Inductor keeps its
mutation of the step's state buffers in place without copying them (`tests/test_gdn_join_triton.py` checks the
compiled code).

The reference is `naive.naive_join` (float64), and the torch path it replaces (`ops.join_` and a copy), which
runs where Triton does not (`ops.join_prefix_` decides, at import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The tiling: S columns per program (a K x 32 fp32 accumulator in registers), P_tail columns / checkpoint rows per
# step of the product, software-pipelining stages. A sweep on the H200 at Qwen3.5-9B's heads (benchmarks page,
# "Batches": `benchmarks/gdn_join.py --configs ...`) had 32 / 32 / 2 stages (8 warps) best at B = 1 and 8 and within
# 1.1% of the best at B = 16.
BLOCK_V = 32
BLOCK_K = 32
STAGES = 2


@triton.jit
def _join_prefix_kernel(state_ptr, old_ptr, new_ptr, heads, key_dim, value_dim,
                        s_b, s_h, s_k, s_c, o_b, o_h, o_k, o_c, n_b, n_h, n_k, n_c,
                        ROWS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b = bh // heads
    h = bh % heads
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)  # this program's S / checkpoint columns
    rows = tl.arange(0, ROWS)  # every key row of S and P_tail
    in_cols = cols < value_dim
    in_rows = rows < key_dim
    state = state_ptr + b * s_b + h * s_h
    old = old_ptr + b * o_b + h * o_h
    new = new_ptr + b * n_b + h * n_h
    s_at = state + rows[:, None] * s_k + cols[None, :] * s_c
    s_mask = in_rows[:, None] & in_cols[None, :]
    acc = tl.load(s_at, mask=s_mask, other=0.0)
    for start in range(0, key_dim, BLOCK_K):
        inner = start + tl.arange(0, BLOCK_K)  # P_tail columns = checkpoint rows of this step
        in_inner = inner < key_dim
        p = tl.load(state + rows[:, None] * s_k + (value_dim + inner)[None, :] * s_c,
                    mask=in_rows[:, None] & in_inner[None, :], other=0.0)
        d_mask = in_inner[:, None] & in_cols[None, :]
        before = tl.load(old + inner[:, None] * o_k + cols[None, :] * o_c, mask=d_mask, other=0.0)
        after = tl.load(new + inner[:, None] * n_k + cols[None, :] * n_c, mask=d_mask, other=0.0)
        tl.store(old + inner[:, None] * o_k + cols[None, :] * o_c, after, mask=d_mask)
        acc = tl.dot(p, after - before, acc, input_precision=PRECISION)
    tl.store(s_at, acc, mask=s_mask)


def launch_join_prefix(state: torch.Tensor, old: torch.Tensor, new: torch.Tensor, precision: str = "tf32x3",
                       block_v: int = 0, block_k: int = 0, warps: int = 0, stages: int = 0) -> None:
    """`join_prefix_`'s kernel launch, with its tiling: `block_v` S columns per program (0: `BLOCK_V`), `block_k`
    P_tail columns per step of the product (0: `BLOCK_K`), `warps` per program (0: by the key rows), `stages` of
    software pipelining (0: `STAGES`). `precision` is Triton's ``input_precision`` of the product (tests
    compare plain ``"tf32"`` with the default). Benchmarks call it with other tilings
    (``benchmarks/gdn_join.py``); the package always takes the defaults (through `join_prefix_`)."""
    batch, heads, key_dim, value_dim = old.shape
    if state.shape != (batch, heads, key_dim, value_dim + key_dim) or new.shape != old.shape:
        raise ValueError(f"join_prefix_: state must be [B, H_v, K, V + K] and old / new [B, H_v, K, V]; got state "
                         f"{tuple(state.shape)}, old {tuple(old.shape)}, new {tuple(new.shape)}")
    if not (state.dtype == old.dtype == new.dtype == torch.float32):
        raise ValueError(f"join_prefix_: fp32 states only, got {state.dtype}, {old.dtype}, {new.dtype}")
    for name, value in (("block_v", block_v), ("block_k", block_k)):
        if value and (value < 16 or value & (value - 1)):
            raise ValueError(f"{name} must be 0 (the default) or a power of two >= 16, got {value}")
    if warps and warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"warps must be 0 (the default) or one of 1, 2, 4, 8, 16, got {warps}")
    if not batch * heads * key_dim * value_dim:
        return
    rows = max(16, triton.next_power_of_2(key_dim))
    block_v = min(block_v or BLOCK_V, max(16, triton.next_power_of_2(value_dim)))
    block_k = min(block_k or BLOCK_K, rows)
    grid = (batch * heads, triton.cdiv(value_dim, block_v))
    options = dict(num_warps=warps or (4 if rows <= 64 else 8), num_stages=stages or STAGES)
    _join_prefix_kernel[grid](  # (called inside the opaque op only: never traced)
        state, old, new, heads, key_dim, value_dim, *state.stride(), *old.stride(), *new.stride(),
        ROWS=rows, BLOCK_V=block_v, BLOCK_K=block_k, PRECISION=precision, **options)


@torch.library.custom_op("hf_raincheck::join_prefix_", mutates_args=("state", "old"))
def join_prefix_(state: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> None:
    """``state[..., :V] += state[..., V:] @ (new - old)``, then ``old <- new``, in place: `state` ``[B, H_v, K, V +
    K]`` (``[S | P_tail]``), `old` / `new` ``[B, H_v, K, V]`` (the prefix checkpoint before and after), fp32."""
    launch_join_prefix(state, old, new)


@join_prefix_.register_fake
def _(state, old, new):
    return None
