"""The one-chunk Gated DeltaNet kernel (`hf_raincheck.gdn_state.chunk_triton`) against the per-token float64
reference (`naive.naive_gated_delta`) and, on a GPU with fla-core, against fla's chunked function it replaces.

GPU tests (CI deselects them); they also run on the CPU under Triton's interpreter:
``TRITON_INTERPRET=1 python -m pytest -m triton tests/test_gdn_chunk_triton.py``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import TRITON_MARKS  # noqa: E402

from hf_raincheck.gdn_state.naive import naive_gated_delta, naive_transition  # noqa: E402
from hf_raincheck.triton_support import interpreted  # noqa: E402

pytestmark = TRITON_MARKS

#: how close to the float64 recurrence fp32 rows must come: under Triton's interpreter the kernel's products are
#: fp32 (the algorithm's own accuracy); on a GPU they run on TF32 tensor cores (10-bit mantissa, ~5e-4 relative)
FP32_TOL = dict(atol=2e-5, rtol=1e-4) if interpreted() else dict(atol=3e-3, rtol=3e-3)


@pytest.fixture(scope="module")
def device(triton_device) -> torch.device:
    return triton_device


def _rows(batch, rows, key_heads, value_heads, key_dim, value_dim, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, rows, key_heads, key_dim, generator=gen)
    k = torch.randn(batch, rows, key_heads, key_dim, generator=gen)
    v = torch.randn(batch, rows, value_heads, value_dim, generator=gen)
    g = -0.5 * torch.rand(batch, rows, value_heads, generator=gen)
    beta = torch.rand(batch, rows, value_heads, generator=gen)
    state = 0.1 * torch.randn(batch, value_heads, key_dim, value_dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), state


SHAPES = [(1, 63, 2, 4, 32, 32), (2, 5, 1, 2, 16, 48), (1, 64, 2, 2, 64, 64), (2, 1, 2, 2, 16, 16),
          (1, 33, 1, 1, 128, 40)]


@pytest.mark.parametrize("shape", SHAPES)
def test_one_chunk_equals_the_per_token_reference(device, shape):
    """Outputs and final state within `FP32_TOL` of the float64 recurrence: any row count up to 64 (one row, a
    ragged count), grouped key heads, a V that the column blocks do not divide."""
    from hf_raincheck.gdn_state.chunk_triton import chunk_gated_delta

    q, k, v, g, beta, state = _rows(*shape, seed=sum(shape))
    out, final = chunk_gated_delta(*(x.to(device) for x in (q, k, v, g, beta, state)))
    want_out, want_state = naive_gated_delta(q, k, v, g, beta, state)
    assert out.shape == v.shape and out.dtype == v.dtype and final.dtype == torch.float32
    torch.testing.assert_close(out.cpu().double(), want_out, **FP32_TOL)
    torch.testing.assert_close(final.cpu().double(), want_state, **FP32_TOL)


@pytest.mark.parametrize("shape", [(2, 63, 2, 4, 32, 128), (3, 20, 1, 2, 16, 64), (2, 9, 1, 1, 16, 96)])
def test_wide_column_blocks_equal_the_reference(device, shape):
    """The batches' launch (`chunk_triton.WIDE_BLOCK_V`, 64 V columns per program): outputs and final state within
    `FP32_TOL` of the float64 recurrence and close to the default launch's (the same products on other column
    blocks); two blocks of V = 128, one block of V = 64, a V of one and a half blocks (96)."""
    from hf_raincheck.gdn_state.chunk_triton import WIDE_BLOCK_V, chunk_gated_delta

    q, k, v, g, beta, state = _rows(*shape, seed=sum(shape) + 1)
    inputs = [x.to(device) for x in (q, k, v, g, beta, state)]
    out, final = chunk_gated_delta(*inputs, block_v=WIDE_BLOCK_V)
    want_out, want_state = naive_gated_delta(q, k, v, g, beta, state)
    torch.testing.assert_close(out.cpu().double(), want_out, **FP32_TOL)
    torch.testing.assert_close(final.cpu().double(), want_state, **FP32_TOL)
    narrow_out, narrow_final = chunk_gated_delta(*inputs)
    torch.testing.assert_close(out, narrow_out, **FP32_TOL)
    torch.testing.assert_close(final, narrow_final, **FP32_TOL)


@pytest.mark.parametrize("beta, spread, gate", [(0.99, 0.0, 0.0), (0.9, 0.3, -0.01)])
def test_aligned_keys(device, beta, spread, gate):
    """Keys nearly one direction, beta near 1, little decay (neighbouring image tokens can look like this): the
    rows' interaction matrix has powers of ~1e9 (a Neumann-series inverse loses everything in fp32), its inverse
    entries stay of order 1; outputs and state within 1e-4 of the float64 recurrence under the interpreter (fp32
    products). On a GPU the TF32 products' rounding passes through that matrix: 1e-2 (the H200 measured 4.2e-3 on 1
    state entry of 2048, the rest under 3e-3; the Neumann inverse's error here is ~5e8)."""
    from hf_raincheck.gdn_state.chunk_triton import chunk_gated_delta

    q, k, v, _, _, state = _rows(1, 64, 1, 2, 32, 32, seed=11)
    gen = torch.Generator().manual_seed(12)
    k = torch.randn(1, 1, 1, 32, generator=gen) + spread * torch.randn(1, 64, 1, 32, generator=gen)
    g = torch.full((1, 64, 2), gate)
    beta = torch.full((1, 64, 2), beta)
    out, final = chunk_gated_delta(*(x.to(device) for x in (q, k, v, g, beta, state)))
    want_out, want_state = naive_gated_delta(q, k, v, g, beta, state)
    tol = dict(atol=1e-4, rtol=1e-4) if interpreted() else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.cpu().double(), want_out, **tol)
    torch.testing.assert_close(final.cpu().double(), want_state, **tol)


def test_padding_rows_leave_the_state_alone(device):
    """Rows after the real ones with ``g = beta = 0`` (a compiled fused step's padding, whatever their q / k / v)
    leave the final state of the real rows, and the real rows' outputs, as they are."""
    from hf_raincheck.gdn_state.chunk_triton import chunk_gated_delta

    q, k, v, g, beta, state = _rows(1, 40, 2, 4, 32, 32, seed=3)
    real = 29
    g[:, real:] = 0.0
    beta[:, real:] = 0.0
    out, final = chunk_gated_delta(*(x.to(device) for x in (q, k, v, g, beta, state)))
    want_out, want_state = naive_gated_delta(q[:, :real], k[:, :real], v[:, :real], g[:, :real], beta[:, :real],
                                             state)
    torch.testing.assert_close(out[:, :real].cpu().double(), want_out, **FP32_TOL)
    torch.testing.assert_close(final.cpu().double(), want_state, **FP32_TOL)


def test_bfloat16_rows(device):
    """bf16 q / k / v / beta (a compiled step's dtypes; g fp32): outputs in bf16, within bf16 rounding of the
    float64 recurrence on the same (rounded) inputs."""
    from hf_raincheck.gdn_state.chunk_triton import chunk_gated_delta

    q, k, v, g, beta, state = _rows(1, 63, 2, 4, 32, 32, seed=5, dtype=torch.bfloat16)
    out, final = chunk_gated_delta(*(x.to(device) for x in (q, k, v, g, beta, state)))
    want_out, want_state = naive_gated_delta(q, k, v, g, beta, state)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().double(), want_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(final.cpu().double(), want_state, **FP32_TOL)


@pytest.mark.parametrize("shape", [(1, 30, 2, 4, 32, 32), (2, 5, 1, 2, 16, 16), (1, 1, 1, 2, 16, 32),
                                   (1, 64, 1, 1, 32, 16)])
def test_with_transition_runs_from_the_state_and_the_identity(device, shape):
    """`chunk_gated_delta_with_transition`: the rows from ``[state | I]`` with values ``[v | 0]`` (nothing of
    either built): the outputs and final state from `state`, and the product of the rows' transitions, within
    `FP32_TOL` of the float64 recurrence."""
    from hf_raincheck.gdn_state.chunk_triton import chunk_gated_delta_with_transition

    q, k, v, g, beta, state = _rows(*shape, seed=sum(shape) + 1)
    g = 0.05 * g  # little decay: P of 64 rows stays far from 0
    value_heads, key_dim = shape[3], shape[4]
    out, final = chunk_gated_delta_with_transition(*(x.to(device) for x in (q, k, v, g, beta, state)))
    want_out, want_state = naive_gated_delta(q, k, v, g, beta, state)
    assert out.shape == v.shape and final.shape == (*state.shape[:-1], state.shape[-1] + key_dim)
    torch.testing.assert_close(out.cpu().double(), want_out, **FP32_TOL)
    torch.testing.assert_close(final[..., : state.shape[-1]].cpu().double(), want_state, **FP32_TOL)
    torch.testing.assert_close(final[..., state.shape[-1]:].cpu().double(),
                               naive_transition(k, g, beta, value_heads), **FP32_TOL)


def test_with_transition_wide_column_blocks(device):
    """`chunk_gated_delta_with_transition` with 64 columns of ``[state | I]`` per program (`kernels.tail_block_columns`
    past one wave of the GPU): the float64 recurrence's outputs, state and transition product, and the 32-column
    launch's, within `FP32_TOL`."""
    from hf_raincheck.gdn_state.chunk_triton import chunk_gated_delta_with_transition

    q, k, v, g, beta, state = _rows(1, 30, 1, 2, 64, 64, seed=12)
    g = 0.05 * g
    rows = [x.to(device) for x in (q, k, v, g, beta, state)]
    out, final = chunk_gated_delta_with_transition(*rows, block_v=64)
    narrow_out, narrow_final = chunk_gated_delta_with_transition(*rows, block_v=32)
    torch.testing.assert_close(out.cpu().double(), naive_gated_delta(q, k, v, g, beta, state)[0], **FP32_TOL)
    torch.testing.assert_close(final[..., 64:].cpu().double(), naive_transition(k, g, beta, 2), **FP32_TOL)
    torch.testing.assert_close(out, narrow_out, **FP32_TOL)
    torch.testing.assert_close(final, narrow_final, **FP32_TOL)


@pytest.mark.parametrize("t, cut", [(90, 60), (90, 89), (40, 1), (130, 66), (140, 60)])
@pytest.mark.parametrize("with_state", [True, False], ids=["state", "zeros"])
def test_advance_split_with_a_short_tail_runs_it_in_the_kernel(device, t, cut, with_state):
    """`ops.advance_split` with at most one chunk after the boundary (a prompt's question after its image): the rows
    before the boundary in one call, the tail from ``[S_b | I]`` in the kernel (`kernels.tail_kernel_takes`); the
    outputs, the boundary state, the final state and P_tail against the per-token float64 definitions. fla backend
    on a GPU (needs fla-core), the torch one under the interpreter (the rows before the boundary in torch)."""
    from hf_raincheck.gdn_state import kernels
    from hf_raincheck.gdn_state.ops import advance_split

    backend = "fla" if device.type == "cuda" else "torch"
    if backend == "fla" and not kernels.fla_available():
        pytest.skip("needs fla-core")
    q, k, v, g, beta, state = _rows(1, t, 2, 4, 32, 32, seed=t + cut)
    g = 0.05 * g  # little decay: P_tail of 64 rows stays far from 0
    s0 = state if with_state else None
    assert kernels.tail_kernel_takes(backend, t - cut, 32, 32, device) == (t - cut <= 64)
    calls = []
    real = kernels.gated_delta_with_transition
    kernels.gated_delta_with_transition = lambda *a: calls.append(a[0].shape[1]) or real(*a)
    try:
        out, boundary, live = advance_split(backend, *(x.to(device) for x in (q, k, v, g, beta)),
                                            None if s0 is None else s0.to(device), cut)
    finally:
        kernels.gated_delta_with_transition = real
    assert calls == ([t - cut] if t - cut <= 64 else [])
    want_out, want_state = naive_gated_delta(q, k, v, g, beta, s0)
    want_boundary = naive_gated_delta(*(x[:, :cut] for x in (q, k, v, g, beta)), s0)[1]
    tol = FP32_TOL if device.type == "cpu" else dict(atol=2e-2, rtol=2e-2)  # fla: bf16 products
    torch.testing.assert_close(out.cpu().double(), want_out, **tol)
    torch.testing.assert_close(boundary.cpu().double(), want_boundary, **tol)
    torch.testing.assert_close(live[..., :32].cpu().double(), want_state, **tol)
    torch.testing.assert_close(live[..., 32:].cpu().double(),
                               naive_transition(k[:, cut:], g[:, cut:], beta[:, cut:], 4), **tol)


def test_split_graph_runs_the_kernel_on_a_padded_tail(device):
    """`graphed.graphed_split` with the kernel as its tail function: tails of 40, then 7, then 64 rows in the
    bucket's `TAIL_ROWS` static rows (the rows past a shorter tail hold the last call's values, inert through
    ``g = beta = 0``), after 70-90 rows from a state or zeros; against the float64 definitions. On a GPU a CUDA
    graph with fla's chunked function for the rows before the boundary, equal to the two calls made directly (the
    graphed head, the kernel on the tail alone); under the interpreter the runner without a graph, torch's chunked
    function before the boundary."""
    from hf_raincheck.gdn_state import graphed, kernels
    from hf_raincheck.gdn_state.chunk_triton import chunk_gated_delta_with_transition

    cuda = device.type == "cuda"
    if cuda and not kernels.fla_available():
        pytest.skip("needs fla-core")
    chunk = kernels.functions("fla" if cuda else "torch")[0]
    graphed.release()
    try:
        for t, tail, with_state in ((130, 40, True), (80, 7, False), (134, 64, True)):
            q, k, v, g, beta, state = _rows(1, t, 2, 4, 32, 32, seed=t + tail)
            g = 0.05 * g
            cut = t - tail
            s0 = state if with_state else None
            rows = [x.to(device) for x in (q, k, v, g, beta)]
            with torch.no_grad():
                out, boundary, live = graphed.graphed_split(chunk, chunk_gated_delta_with_transition, *rows,
                                                            None if s0 is None else s0.to(device), cut,
                                                            capture=cuda)
                if cuda:  # the same kernels on the same rows, called one after the other
                    head, want_b = graphed.graphed_chunk(chunk, *(x[:, :cut] for x in rows), s0.to(device)
                                                         if s0 is not None else None)
                    tail_out, want_live = chunk_gated_delta_with_transition(*(x[:, cut:] for x in rows),
                                                                            want_b.float())
                    assert torch.equal(out, torch.cat([head, tail_out], dim=1))
                    assert torch.equal(boundary, want_b.float()) and torch.equal(live, want_live)
            want_out, want_state = naive_gated_delta(q, k, v, g, beta, s0)
            want_boundary = naive_gated_delta(*(x[:, :cut] for x in (q, k, v, g, beta)), s0)[1]
            tol = FP32_TOL if not cuda else dict(atol=2e-2, rtol=2e-2)  # fla: bf16 products
            torch.testing.assert_close(out.cpu().double(), want_out, **tol)
            torch.testing.assert_close(boundary.cpu().double(), want_boundary, **tol)
            torch.testing.assert_close(live[..., :32].cpu().double(), want_state, **tol)
            torch.testing.assert_close(live[..., 32:].cpu().double(),
                                       naive_transition(k[:, cut:], g[:, cut:], beta[:, cut:], 4), **tol)
    finally:
        graphed.release()


@pytest.mark.parametrize("shape", [(1, 63, 2, 4, 32, 32), (2, 5, 1, 2, 16, 48)])
def test_lazy_window_leaves_the_join_pending_and_corrects_the_decode_row(device, shape):
    """`lazy_window_` over three fused steps (the decode row first, on the unjoined live ``[S | P_tail]``, then the
    window) against the joined steps in float64: every decode row's output equals the one from the joined live
    state, the checkpoint moves as the rows say, and folding ``S += P_tail pending`` gives the joined live state."""
    from hf_raincheck.gdn_state.chunk_triton import lazy_window_

    batch, rows, key_heads, value_heads, key_dim, value_dim = shape
    gen = torch.Generator().manual_seed(7)
    prefix = 0.1 * torch.randn(batch, value_heads, key_dim, value_dim, generator=gen)
    live_s = 0.1 * torch.randn(batch, value_heads, key_dim, value_dim, generator=gen)
    transition = torch.eye(key_dim).expand(batch, value_heads, key_dim, key_dim) * 0.9 \
        + 0.02 * torch.randn(batch, value_heads, key_dim, key_dim, generator=gen)
    want_prefix, want_live, want_p = prefix.double(), live_s.double(), transition.double()
    on = {"prefix": prefix.to(device), "pending": torch.zeros_like(prefix).to(device),
          "state": torch.cat([live_s, transition], -1).double()}  # [S | P_tail], unjoined, advanced in float64 here
    for step in range(3):
        q, k, v, g, beta, _ = _rows(batch, rows, key_heads, value_heads, key_dim, value_dim, seed=10 + step)
        q1, k1, v1, g1, beta1, _ = _rows(batch, 1, key_heads, value_heads, key_dim, value_dim, seed=20 + step)
        # joined (the reference): the window moves the checkpoint, the join, then the decode row
        _, new_prefix = naive_gated_delta(q, k, v, g, beta, want_prefix)
        want_live = want_live + want_p @ (new_prefix - want_prefix)
        want_prefix = new_prefix
        want_out1, want_live = naive_gated_delta(q1, k1, v1, g1, beta1, want_live)
        want_p = naive_transition(k1, g1, beta1, value_heads, want_p)
        # lazy: the decode row on the unjoined [S | P_tail] (values [v | 0]), then the window
        zeros = torch.zeros(batch, 1, value_heads, key_dim)
        live_out, on["state"] = naive_gated_delta(q1, k1, torch.cat([v1, zeros], -1), g1, beta1, on["state"])
        out, o_live = lazy_window_(*(x.to(device) for x in (q, k, v, g, beta)), on["prefix"], on["pending"],
                                   live_out.float().to(device))
        torch.testing.assert_close(o_live.cpu().double(), want_out1, **FP32_TOL)
        torch.testing.assert_close(on["prefix"].cpu().double(), want_prefix, **FP32_TOL)
    s, p = on["state"][..., :value_dim], on["state"][..., value_dim:]
    torch.testing.assert_close(p, want_p, **FP32_TOL)
    torch.testing.assert_close(s + p @ on["pending"].cpu().double(), want_live, **FP32_TOL)


def test_bad_inputs_name_what_is_allowed(device):
    from hf_raincheck.gdn_state.chunk_triton import chunk_gated_delta

    q, k, v, g, beta, state = (x.to(device) for x in _rows(1, 8, 1, 2, 16, 16, seed=1))
    with pytest.raises(ValueError, match="1 to 64 rows"):
        chunk_gated_delta(*(torch.cat([x] * 9, dim=1) for x in (q, k, v, g, beta)), state)
    with pytest.raises(ValueError, match="float32"):
        chunk_gated_delta(q, k, v, g, beta, state.double())
    with pytest.raises(ValueError, match="H_v a multiple of H_k"):
        chunk_gated_delta(torch.cat([q] * 3, 2), torch.cat([k] * 3, 2), v, g, beta, state)
    with pytest.raises(ValueError, match="block_v"):
        chunk_gated_delta(q, k, v, g, beta, state, block_v=24)
    with pytest.raises(ValueError, match="warps"):
        chunk_gated_delta(q, k, v, g, beta, state, warps=3)
    from hf_raincheck.gdn_state.chunk_triton import lazy_window_

    live = torch.zeros(1, 1, 2, 32, device=device)
    with pytest.raises(ValueError, match="prefix and pending must be contiguous float32"):
        lazy_window_(q, k, v, g, beta, state, state.double(), live)
    with pytest.raises(ValueError, match=r"live must be \[B, 1, H_v, V \+ K\]"):
        lazy_window_(q, k, v, g, beta, state, torch.zeros_like(state), live[..., :16])


def test_equals_fla_chunked_function_at_the_9b_heads():
    """On a GPU with fla-core: a fused step's window at Qwen3.5-9B's GDN heads (16 key / 32 value heads of 128), bf16,
    against fla's ``chunk_gated_delta_rule`` (what compiled fused steps of batches call), both against the float64
    recurrence: the kernel is at least as close to it as fla is."""
    from hf_raincheck.gdn_state import kernels

    if not (torch.cuda.is_available() and kernels.fla_available()):
        pytest.skip("needs a CUDA GPU and fla-core")
    from hf_raincheck.gdn_state.chunk_triton import chunk_gated_delta

    q, k, v, g, beta, state = _rows(1, 63, 16, 32, 128, 128, seed=9, dtype=torch.bfloat16)
    cuda = [x.cuda() for x in (q, k, v, g, beta, state)]
    out, final = chunk_gated_delta(*cuda)
    fla_out, fla_final = kernels.functions("fla")[0](*cuda[:3], g=cuda[3], beta=cuda[4], initial_state=cuda[5],
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_out, want_state = naive_gated_delta(q, k, v, g, beta, state)
    ours = (out.cpu().double() - want_out).abs().max().item(), (final.cpu().double() - want_state).abs().max().item()
    theirs = ((fla_out.cpu().double() - want_out).abs().max().item(),
              (fla_final.cpu().double() - want_state).abs().max().item())
    assert ours[0] <= max(theirs[0], 1e-2) and ours[1] <= max(theirs[1], 1e-4), (ours, theirs)


def test_fla_backend_routes_windows_to_the_kernel():
    """On a GPU with fla-core: `kernels.gated_delta("fla", ...)` (what fused steps call) runs the one-chunk kernel
    for a window, with 32 V columns per program where they fit one wave of the SMs (batch 1) and 64 past it (a
    batch): the kernel's outputs bit for bit; a V that 64 columns do not divide, past one wave, stays with fla's
    chunked function."""
    from hf_raincheck.gdn_state import kernels

    if not (torch.cuda.is_available() and kernels.fla_available()):
        pytest.skip("needs a CUDA GPU and fla-core")
    from hf_raincheck.gdn_state.chunk_triton import chunk_gated_delta

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heads = max(1, sms // 4)  # 4 blocks of 32 V columns per head: one wave at B = 1
    for batch, columns in ((1, 32), (2, 64), (8, 64)):
        assert kernels.one_chunk_block_columns(63, batch, heads, 128, sms) == columns
        rows = [x.cuda() for x in _rows(batch, 63, 1, heads, 128, 128, seed=4, dtype=torch.bfloat16)]
        out, final = kernels.gated_delta("fla", *rows)
        want_out, want_final = chunk_gated_delta(*rows, block_v=columns)
        assert torch.equal(out, want_out) and torch.equal(final, want_final), batch
    ragged = [x.cuda() for x in _rows(8, 63, 1, heads, 128, 96, seed=4, dtype=torch.bfloat16)]
    assert kernels.one_chunk_block_columns(63, 8, heads, 96, sms) == 0
    fla_out, fla_final = kernels.functions("fla")[0](*ragged[:3], g=ragged[3], beta=ragged[4],
                                                     initial_state=ragged[5], output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    out, final = kernels.gated_delta("fla", *ragged)
    assert torch.equal(out, fla_out) and torch.equal(final, fla_final.float())


def test_first_prefill_tail_takes_one_wave_of_programs():
    """On a GPU: a first prefill's tail (`kernels.gated_delta_with_transition`) at Qwen3.5-9B's heads runs 64
    columns of ``[S_b | I]`` per program where 32 would take two waves of the SMs: the launch at the chosen columns
    bit for bit, and the float64 recurrence's outputs, state and transition product within the GPU's `FP32_TOL`."""
    from hf_raincheck.gdn_state import kernels

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from hf_raincheck.gdn_state.chunk_triton import chunk_gated_delta_with_transition

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heads = 32  # Qwen3.5-9B: 8 blocks of 32 columns per head, 256 programs (past one wave of any GPU up to 255 SMs)
    assert kernels.tail_block_columns(1, heads, 128, 128, sms) == (64 if heads * 8 > sms else 32)
    q, k, v, g, beta, state = _rows(1, 30, 1, heads, 128, 128, seed=6, dtype=torch.bfloat16)
    g = 0.05 * g
    rows = [x.cuda() for x in (q, k, v, g, beta, state)]
    out, final = kernels.gated_delta_with_transition(*rows)
    want_out, want_final = chunk_gated_delta_with_transition(*rows, block_v=kernels.tail_block_columns(
        1, heads, 128, 128, sms))
    assert torch.equal(out, want_out) and torch.equal(final, want_final)
    ref_out, ref_state = naive_gated_delta(q, k, v, g, beta, state)
    torch.testing.assert_close(out.cpu().double(), ref_out, atol=1e-2, rtol=1e-2)  # bf16 outputs
    torch.testing.assert_close(final[..., :128].cpu().double(), ref_state, **FP32_TOL)
    torch.testing.assert_close(final[..., 128:].cpu().double(), naive_transition(k, g, beta, heads), **FP32_TOL)