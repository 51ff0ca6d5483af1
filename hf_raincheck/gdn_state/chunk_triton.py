"""One chunk of at most 64 Gated DeltaNet rows from a state, in one Triton kernel (`chunk_gated_delta`).

A compiled fused step's deferred window (63 rows by default) continues the prefix checkpoint through fla-core's
chunked kernels: seven launches per GDN layer (the gates' cumulative sum, two l2 norms, ``kkt_solve``,
``recompute_w_u``, the state pass, the output), much of what a Qwen3.5-9B fused step adds over a decode-only step
at batch 1 (CHANGELOG, 2026-12-04). For one chunk the whole WY form fits in one program per (row, value
head, block of V columns); per value head, with ``k``, ``q`` l2-normalised, ``q`` scaled by ``K^-1/2``,
``c_t = g_1 + ... + g_t`` and ``D[i, j] = exp(c_i - c_j)`` (``i >= j``):

    L = strict_lower(beta_i (k_i . k_j) D[i, j])          (the rows' interactions, T x T)
    R = (I + L)^-1                                          (block doubling: six levels, the first without products)
    U = R (beta (v - exp(c) k S_0))                        (the rows' new values)
    O = exp(c) (q S_0) + lower(q k^T . D) U
    S_T = exp(c_T) S_0 + (exp(c_T - c) k)^T U

(the recurrence ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = S_t^T q_t``, of
`naive.naive_gated_delta`, which the tests compare it with). Products on TF32 tensor cores (10-bit mantissa; fla's
chunked kernels round k, v and the state to bf16 for theirs, so this is the closer of the two to the float64
recurrence: `tests/test_gdn_chunk_triton.py` checks it against fla on a GPU); ``"tf32x3"`` (fp32-accurate, as
`join_triton`) made ptxas spill ~4.5 KB of registers per thread at K = 128 (8 warps) against ~0.6 KB; with the
default 4 warps TF32 spills ~0.5 KB and is still the fastest launch measured (`tests/test_triton_compile.py` prints
the report); full-fp32 ``"ieee"`` products (FMA loops) took ptxas 114 s at K = 32 and 293 s at K = 128 to compile
for sm_90a, so the products are TF32 only (Triton's interpreter computes them in fp32: the tests check the algorithm
there at fp32 accuracy). Rows past the chunk's end (padding) read as ``g = beta = 0``, k = q = 0: the identity.

`kernels.gated_delta` calls it in place of fla's chunked function for 2-64 rows from a state (a compiled or eager
fused step's window, at every batch size), with `kernels.one_chunk_block_columns` columns per program. With
``CARRY = K`` (`chunk_gated_delta_with_transition`) the state is ``[S | I]`` and the values ``[v | 0]`` without
either being built (the identity's programs read no values and store no outputs): a Raincheck first prefill's tail
after the boundary, the live state and P_tail in one launch (`kernels.tail_kernel_takes`; `kernels.tail_block_columns`
columns of ``[S | I]`` per program: 64 at Qwen3.5-9B's heads, where 32 make 256 programs), replayed with fla's call
for the rows before the boundary from one CUDA graph (`graphed.graphed_split`; host times by path:
`benchmarks/gdn_prefill_host.py`). For the fused step's window at Qwen3.5-9B's heads on an H200
(``benchmarks/gdn_chunk.py``, 24 calls in a CUDA graph, us per call, fla's chunked function in brackets): B = 1
15.7 (37.4) with 32 columns per program (128 programs: one wave), 18.2 with 64; from B = 2 on 64 columns (half the
programs, each computing the rows' inverse once for twice the columns): B = 2 / 4 / 8 / 16 18.8 / 27.7 / 53.5 /
104.7 (47.0 / 60.5 / 94.4 / 163.6), where 32 columns took 29.7 / 57.6 / 114.8 / 227.0 and 128 columns 31.7 / 36.3 /
71.0 / 140.4. Looping a program over several column blocks from one inverse was slower than 64 columns at every B
(CHANGELOG). Three products fewer than the plain WY form (20.7 us per call there): the
inverse's first doubling level is closed-form, and U applies R to the program's ``[T, BLOCK_V]`` columns once, where
fla's WY form applies it to ``[T, K]`` first (``W = R (beta exp(c) k)``, then ``U = R (beta v) - W S_0``).

A compiled fused step runs no join (`lazy_window_`, ``LAZY``; batch 1 and static batches): the decode row runs
first on the unjoined live state, and this kernel's epilogue adds the window's change to a pending difference and
the decode row's output correction (a K-vector by ``[K, BLOCK_V]`` reduction per program); the live state is folded
once, when the fused steps end (`ops.join_pending_`); the steps' effect: benchmarks page, Latency, Qwen3.5 run 7. A
join inside the epilogue (``S_live += P_tail (new - old)``, a K x K by K x BLOCK_V product per program) took 31.1
us per call on the H200 at B = 1 against 30.8 for the window and join kernels (CHANGELOG). At B = 8 / 16
(Qwen3.5-9B's heads, an H100) leaving the joins pending takes a fused step's GDN layer from 303 / 557 to 262 / 472
us (benchmarks page, Batches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: the most rows one call takes (one chunk; the inverse takes log2(CHUNK) doubling levels). The inverse is exact
#: block by block (``inv([[A, 0], [C, B]]) = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]``): the Neumann product
#: ``(I - L)(I + L^2)(I + L^4)...`` is not, its powers of L grow to ~1e9 for aligned keys with beta near 1 (tested)
CHUNK = 64
#: V columns per program, and warps per program: on the H200 at Qwen3.5-9B's heads (63 rows, bf16;
#: ``benchmarks/gdn_chunk.py --triton-configs``) 32 columns with 4 warps took 15.6 us per call at B = 1 against 21.3
#: with 8 warps, 18.3 with 64 columns and 26.4 with 16 (fla's chunked function: 37.1)
BLOCK_V = 32
WARPS = 4
#: V columns per program where `BLOCK_V`'s programs fill more than one wave of the GPU (batches; see the module's
#: docstring for the measurements)
WIDE_BLOCK_V = 64
_EPS = 1e-6  # the l2 norm's, as fla's and transformers' (``x / sqrt(sum(x^2) + eps)``)


@triton.jit
def _chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, o_ptr, ht_ptr, pending_ptr, live_ptr, lo_ptr,
                  rows, key_heads, value_heads, value_dim, scale,
                  h0_b, h0_h, h0_k, h0_v, ht_b, ht_h, ht_k, ht_v,
                  KEY_DIM: tl.constexpr, BT: tl.constexpr, BLOCK_V: tl.constexpr, LEVELS: tl.constexpr,
                  EPS: tl.constexpr, CARRY: tl.constexpr, LAZY: tl.constexpr):
    bh = tl.program_id(1).to(tl.int64)
    b = bh // value_heads
    h = bh % value_heads
    hk = h // (value_heads // key_heads)
    t = tl.arange(0, BT)
    in_t = t < rows
    kd = tl.arange(0, KEY_DIM)
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_v = cols < value_dim
    in_c = cols < value_dim + CARRY  # the state's columns: S's V, then (CARRY = K) those of the transition map

    qk_at = ((b * rows + t[:, None]) * key_heads + hk) * KEY_DIM + kd[None, :]
    q = tl.load(q_ptr + qk_at, mask=in_t[:, None], other=0.0).to(tl.float32)
    k = tl.load(k_ptr + qk_at, mask=in_t[:, None], other=0.0).to(tl.float32)
    q = q * (tl.rsqrt(tl.sum(q * q, 1) + EPS) * scale)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, 1) + EPS)[:, None]
    gate_at = (b * rows + t) * value_heads + h
    g = tl.load(g_ptr + gate_at, mask=in_t, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + gate_at, mask=in_t, other=0.0).to(tl.float32)
    c = tl.cumsum(g, 0)
    lower_eq = t[:, None] >= t[None, :]
    decay = tl.exp(tl.where(lower_eq, c[:, None] - c[None, :], float("-inf")))  # 0 above the diagonal

    # R = (I + L)^-1 by doubling: R holds the inverses of the diagonal blocks of size 2^s; the next level's
    # off-diagonal blocks are -B^-1 C A^-1 (inv([[A, 0], [C, B]])), for all blocks at once
    kk = tl.dot(k, tl.trans(k), input_precision="tf32")
    lower = tl.where(t[:, None] > t[None, :], beta[:, None] * kk * decay, 0.0)
    # level 0 without products (R = I there): the inverse of each 2 x 2 block [[1, 0], [l, 1]] is [[1, 0], [-l, 1]]
    pair = (t[:, None] // 2 == t[None, :] // 2) & (t[:, None] > t[None, :])
    r = tl.where(t[:, None] == t[None, :], 1.0, 0.0) - tl.where(pair, lower, 0.0)
    for level in tl.static_range(1, LEVELS):
        size = 1 << level
        pair = (t[:, None] // (2 * size) == t[None, :] // (2 * size)) & (t[:, None] // size > t[None, :] // size)
        r = r - tl.dot(tl.dot(r, tl.where(pair, lower, 0.0), input_precision="tf32"), r,
                       input_precision="tf32")

    grow = tl.exp(c)
    v_at = ((b * rows + t[:, None]) * value_heads + h) * value_dim + cols[None, :]
    tv_mask = in_t[:, None] & in_v[None, :]
    v = tl.load(v_ptr + v_at, mask=tv_mask, other=0.0).to(tl.float32)  # (the map's columns: v = 0)
    s0 = tl.load(h0_ptr + b * h0_b + h * h0_h + kd[:, None] * h0_k + cols[None, :] * h0_v, mask=in_v[None, :],
                 other=0.0)
    if CARRY:  # the map's columns start from the identity
        s0 += tl.where(kd[:, None] == (cols - value_dim)[None, :], 1.0, 0.0)
    # U = R (beta v - beta exp(c) k S_0): R applied once, to [BT, BLOCK_V] (not to [BT, K] first, fla's W)
    u = tl.dot(r, beta[:, None] * (v - grow[:, None] * tl.dot(k, s0, input_precision="tf32")), input_precision="tf32")

    a = tl.where(lower_eq, tl.dot(q, tl.trans(k), input_precision="tf32") * decay, 0.0)
    o = grow[:, None] * tl.dot(q, s0, input_precision="tf32") + tl.dot(a, u, input_precision="tf32")
    tl.store(o_ptr + v_at, o.to(o_ptr.dtype.element_ty), mask=tv_mask)

    last = tl.sum(tl.where(t == BT - 1, c, 0.0), 0)  # padding rows add nothing to c: c at the last real row
    k_end = k * tl.exp(last - c)[:, None]
    s = tl.exp(last) * s0 + tl.dot(tl.trans(k_end), u, input_precision="tf32")
    tl.store(ht_ptr + b * ht_b + h * ht_h + kd[:, None] * ht_k + cols[None, :] * ht_v, s, mask=in_c[None, :])
    if LAZY:  # the pending difference grows by this window's; the decode row's output takes it (see `lazy_window_`)
        d_at = pending_ptr + ((b * value_heads + h) * KEY_DIM + kd[:, None]) * value_dim + cols[None, :]
        d = tl.load(d_at, mask=in_v[None, :], other=0.0) + (s - s0)
        tl.store(d_at, d, mask=in_v[None, :])
        live = live_ptr + (b * value_heads + h) * (value_dim + KEY_DIM)  # [o_S | u] of the decode row
        u = tl.load(live + value_dim + kd)
        o_live = tl.load(live + cols, mask=in_v, other=0.0) + tl.sum(u[:, None] * d, 0)
        tl.store(lo_ptr + (b * value_heads + h) * value_dim + cols, o_live.to(lo_ptr.dtype.element_ty), mask=in_v)


def _check(q, k, v, g, beta, state, block_v: int, warps: int) -> None:
    """The shapes, dtypes and launch options `chunk_gated_delta` takes."""
    batch, rows, key_heads, key_dim = k.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    if q.shape != k.shape or v.shape[:2] != (batch, rows) or g.shape != (batch, rows, value_heads) \
            or beta.shape != g.shape:
        raise ValueError(f"chunk_gated_delta: q, k [B, T, H_k, K], v [B, T, H_v, V], g and beta [B, T, H_v]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta "
                         f"{tuple(beta.shape)}")
    if not 1 <= rows <= CHUNK:
        raise ValueError(f"chunk_gated_delta: 1 to {CHUNK} rows, got {rows}")
    if key_dim < 16 or key_dim & (key_dim - 1) or value_heads % key_heads:
        raise ValueError(f"chunk_gated_delta: K must be a power of two >= 16 and H_v a multiple of H_k; got K "
                         f"{key_dim}, H_k {key_heads}, H_v {value_heads}")
    if state.shape != (batch, value_heads, key_dim, value_dim) or state.dtype != torch.float32:
        raise ValueError(f"chunk_gated_delta: state must be [B, H_v, K, V] = {(batch, value_heads, key_dim, value_dim)}"
                         f" float32, got {tuple(state.shape)} {state.dtype}")
    if block_v and (block_v < 16 or block_v & (block_v - 1)):
        raise ValueError(f"block_v must be 0 (the default) or a power of two >= 16, got {block_v}")
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"warps must be one of 1, 2, 4, 8, 16, got {warps}")


def block_columns(value_dim: int, block_v: int = 0) -> int:
    """V columns per program for a V of `value_dim`: `block_v` (0: `BLOCK_V`), at most V rounded up to a power of
    two >= 16."""
    return min(block_v or BLOCK_V, max(16, 1 << (value_dim - 1).bit_length()))


def _launch(q, k, v, g, beta, h0, out, ht, block_v: int, warps: int, carry: int = 0, lazy: tuple | None = None
            ) -> None:
    """`_chunk_kernel` over (column blocks, B x H_v) from state `h0` into `ht` (`carry` > 0: ``[h0 | I]`` into
    `ht` ``[B, H_v, K, V + carry]``; `lazy`: ``(pending, live, live_out)`` of `lazy_window_`)."""
    batch, rows, key_heads, key_dim = k.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    block_v = block_columns(value_dim, block_v)
    grid = (triton.cdiv(value_dim + carry, block_v), batch * value_heads)
    pending, live, live_out = lazy if lazy is not None else (out, out, out)  # (unread without `lazy`)
    _chunk_kernel[grid](q, k, v, g, beta, h0, out, ht, pending, live, live_out, rows, key_heads, value_heads,
                        value_dim, key_dim ** -0.5, *h0.stride(), *ht.stride(), KEY_DIM=key_dim, BT=CHUNK,
                        BLOCK_V=block_v, LEVELS=CHUNK.bit_length() - 1, EPS=_EPS, CARRY=carry,
                        LAZY=lazy is not None, num_warps=warps)


def chunk_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, block_v: int = 0, warps: int = WARPS,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``q, k [B, T, H_k, K]``, ``v [B, T, H_v, V]``, ``g`` (log decay, fp32), ``beta`` ``[B, T, H_v]`` from
    `state` ``[B, H_v, K, V]`` fp32 (q and k l2-normalised in the kernel, q scaled by ``K^-1/2``, as fla's
    ``use_qk_l2norm_in_kernel=True``), ``T <= CHUNK``. Returns ``(o [B, T, H_v, V]`` in v's dtype, the final state
    ``[B, H_v, K, V]`` fp32). `block_v`: V columns per program (0: `BLOCK_V`); `warps` per program."""
    _check(q, k, v, g, beta, state, block_v, warps)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty_like(v)
    final = torch.empty(state.shape, dtype=torch.float32, device=v.device)
    if not out.numel():
        return out, final.copy_(state)
    _launch(q, k, v, g, beta, state, out, final, block_v, warps)
    return out, final


def chunk_gated_delta_with_transition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, state: torch.Tensor, block_v: int = 0,
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_gated_delta` from ``[state | I]`` with values ``[v | 0]``, without building either: returns ``(o [B,
    T, H_v, V]`` in v's dtype, ``[S_T | P] [B, H_v, K, V + K]`` fp32)``, P the product of the rows' transitions
    (latest on the left). The programs of the K extra columns start from the identity's columns and read no
    values; only S's columns' outputs are stored. A Raincheck first prefill's tail after a new plan's boundary
    (`ops.advance_split`): the live state and P_tail in one launch. `block_v`: columns per program of ``[S |
    I]`` (0: `BLOCK_V`)."""
    _check(q, k, v, g, beta, state, block_v, WARPS)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    batch, value_heads, key_dim, value_dim = state.shape
    out = torch.empty_like(v)
    final = torch.empty(batch, value_heads, key_dim, value_dim + key_dim, dtype=torch.float32, device=v.device)
    _launch(q, k, v, g, beta, state, out, final, block_v, WARPS, carry=key_dim)
    return out, final


def lazy_window_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 prefix: torch.Tensor, pending: torch.Tensor, live: torch.Tensor, block_v: int = 0,
                 warps: int = WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused step's window with the join left pending, in one launch: the rows (as `chunk_gated_delta`) continue
    the checkpoint `prefix` ``[B, H_v, K, V]`` fp32 in place, `pending` ``[B, H_v, K, V]`` fp32 (the checkpoint's
    change since the live state's last join) grows by this window's change, and the decode row's output takes
    it: ``o_live = o_S + pending^T u``, from `live` ``[B, 1, H_v, V + K]`` fp32, the decode row run first on the
    unjoined live ``[S | P_tail]`` (``o_S``, then ``u = P_tail^T q``: P_tail's columns). Returns ``(o [B, T, H_v,
    V]`` in v's dtype, ``o_live [B, 1, H_v, V]`` in v's dtype)``. The true live state is ``S + P_tail pending``
    (both sides advance by the same affine map), folded in by one join when the steps end
    (`ops.join_pending_`)."""
    _check(q, k, v, g, beta, prefix, block_v, warps)
    batch, value_heads, key_dim, value_dim = prefix.shape
    if pending.shape != prefix.shape or pending.dtype != torch.float32 or not pending.is_contiguous() \
            or not prefix.is_contiguous():
        raise ValueError(f"lazy_window_: prefix and pending must be contiguous float32 {tuple(prefix.shape)}")
    if live.shape != (batch, 1, value_heads, value_dim + key_dim) or live.dtype != torch.float32:
        want = (batch, 1, value_heads, value_dim + key_dim)
        raise ValueError(f"lazy_window_: live must be [B, 1, H_v, V + K] = {want} float32, got {tuple(live.shape)} "
                         f"{live.dtype}")
    q, k, v, g, beta, live = (x.contiguous() for x in (q, k, v, g, beta, live))
    out = torch.empty_like(v)
    live_out = torch.empty(batch, 1, value_heads, value_dim, dtype=v.dtype, device=v.device)
    _launch(q, k, v, g, beta, prefix, out, prefix, block_v, warps, lazy=(pending, live, live_out))
    return out, live_out
