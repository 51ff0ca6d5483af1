"""A compiled fused step's GDN restoration in one Triton kernel: the chunk of deferred rows from the prefix state,
then the join ``S_live += P_tail (S_prefix_new - S_prefix_old)`` (DESIGN.md rule 3).

In a compiled Qwen3.5-9B fused step (31 deferred rows, H200) this work took, per GDN layer, fla-core's chunked
kernels (four launches, 24 us), its two l2norm kernels (2.7 us) and the join's fp32 product (8.2 us): 0.84 of the
step's 7.80 GPU ms (`benchmarks/results/latency_profile_qwen3_5_static_pool.txt`). Here one program per value head
and block of `BV` value columns keeps its ``[K, BV]`` slice of the prefix state in registers, runs the rows in
order (the recurrence of fla's fused recurrent kernel: q and k l2-normalised in the kernel, q scaled by K^-1/2;
``S <- exp(g) S``, ``u = beta (v - S^T k)``, ``S <- S + k u^T``, ``o = S^T q``), writes the new slice, and adds
``P_tail`` times its change to the live state's slice (a tensor-core product in three TF32 passes, ``tf32x3``: fp32's
accuracy; the plain fp32 product spilled ~14 KB of registers per program). Padding rows (``g = beta = 0``) leave
the state as it is. A ``torch.library`` custom op (one opaque node in a compiled step, as `ops.gated_delta`), 8 warps
per program: no spills at the Qwen3.5 shape (``tests/test_triton_compile.py``).

Opt-in (`HF_RAINCHECK_GDN_RESTORE_KERNEL=triton`): measured on the H200 (2026-12-01) at 52.7 us per layer, 1.27 ms
per fused step against the 0.84 ms it replaces (`benchmarks/results/latency_profile_qwen3_5_restore_kernel.txt`):
each program runs the 31 rows one after another, and 128 programs leave that chain exposed. Compiled steps with it
equal eager steps there (`tests/test_steps_gpu.py` with it on). Tested against the plain reference
(`naive.naive_gated_delta`, `naive.naive_join`) under Triton's interpreter (``tests/test_gdn_restore_triton.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _restore_chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, prefix_ptr, live_ptr, o_ptr, rows, scale,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                          stride_ot, stride_oh,
                          GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, LIVE_W: tl.constexpr,
                          BV: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)
    vb = tl.program_id(1)
    hk = h // GROUP
    rk = tl.arange(0, K)
    rv = vb * BV + tl.arange(0, BV)
    slice_at = h * K * V + rk[:, None] * V + rv[None, :]
    start = tl.load(prefix_ptr + slice_at)
    s = start
    for t in range(rows):
        kt = tl.load(k_ptr + t * stride_kt + hk * stride_kh + rk).to(tl.float32)
        qt = tl.load(q_ptr + t * stride_qt + hk * stride_qh + rk).to(tl.float32)
        vt = tl.load(v_ptr + t * stride_vt + h * stride_vh + rv).to(tl.float32)
        gt = tl.load(g_ptr + t * stride_gt + h).to(tl.float32)
        bt = tl.load(beta_ptr + t * stride_bt + h).to(tl.float32)
        kt = kt / tl.sqrt(tl.sum(kt * kt, axis=0) + 1e-6)
        qt = qt / tl.sqrt(tl.sum(qt * qt, axis=0) + 1e-6) * scale
        s = s * tl.exp(gt)
        u = bt * (vt - tl.sum(s * kt[:, None], axis=0))
        s = s + kt[:, None] * u[None, :]
        out = tl.sum(s * qt[:, None], axis=0)
        tl.store(o_ptr + t * stride_ot + h * stride_oh + rv, out.to(o_ptr.dtype.element_ty))
    tl.store(prefix_ptr + slice_at, s)
    transition = tl.load(live_ptr + h * K * LIVE_W + rk[:, None] * LIVE_W + V + rk[None, :])  # P_tail [K, K]
    update = tl.dot(transition, s - start, input_precision="tf32x3")
    live_at = live_ptr + h * K * LIVE_W + rk[:, None] * LIVE_W + rv[None, :]
    tl.store(live_at, tl.load(live_at) + update)


def supported(key_dim: int, value_dim: int) -> bool:
    """Head sizes the kernel takes: powers of two of at least 16."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (key_dim, value_dim))


@torch.library.custom_op("hf_raincheck::gdn_restore_chunk", mutates_args=("prefix", "live"))
def restore_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  prefix: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Rows ``q, k [1, T, H_k, K]``, ``v [1, T, H_v, V]``, ``g, beta [1, T, H_v]`` continue ``prefix [1, H_v, K, V]``
    (fp32, updated in place); ``live [1, H_v, K, V + K]`` (fp32, ``[S_live | P_tail]``) gets ``P_tail (new prefix -
    old prefix)`` added to its first V columns, in place. Returns the rows' outputs ``[1, T, H_v, V]`` in q's
    dtype."""
    _, rows, heads_k, key_dim = q.shape
    heads_v, value_dim = v.shape[2], v.shape[3]
    if not supported(key_dim, value_dim) or heads_v % heads_k:
        raise ValueError(f"gdn_restore_chunk: head sizes must be powers of two >= 16 and H_v a multiple of H_k, got "
                         f"K={key_dim}, V={value_dim}, H_k={heads_k}, H_v={heads_v}")
    if prefix.shape != (1, heads_v, key_dim, value_dim) or live.shape != (1, heads_v, key_dim, value_dim + key_dim):
        raise ValueError(f"gdn_restore_chunk: prefix must be [1, {heads_v}, {key_dim}, {value_dim}] and live "
                         f"[1, {heads_v}, {key_dim}, {value_dim + key_dim}], got {tuple(prefix.shape)} and "
                         f"{tuple(live.shape)}")
    if not (prefix.is_contiguous() and live.is_contiguous()):
        raise ValueError("gdn_restore_chunk: prefix and live must be contiguous (they are updated in place)")
    k = k if k.stride(-1) == 1 else k.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    g = g if g.stride(-1) == 1 else g.contiguous()
    beta = beta if beta.stride(-1) == 1 else beta.contiguous()
    out = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    block_v = min(32, value_dim)
    if rows:
        _restore_chunk_kernel[(heads_v, value_dim // block_v)](
            q, k, v, g, beta, prefix, live, out, rows, key_dim ** -0.5,
            q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2), g.stride(1),
            beta.stride(1), out.stride(1), out.stride(2),
            GROUP=heads_v // heads_k, K=key_dim, V=value_dim, LIVE_W=value_dim + key_dim, BV=block_v,
            num_warps=8)
    return out


@restore_chunk.register_fake
def _(q, k, v, g, beta, prefix, live):
    return torch.empty(v.shape, dtype=q.dtype, device=v.device)
