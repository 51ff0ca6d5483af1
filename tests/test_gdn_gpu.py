"""GPU-only: fla-core's kernels against the torch path (run on the H200; skipped without CUDA).

    python -m pytest -q -s tests/test_gdn_gpu.py      # prints the measured errors
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from hf_raincheck.gdn_state import advance, fla_available, gated_delta  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not fla_available(), reason="needs CUDA and fla-core"),
]

HK, HV, K, V = 16, 32, 128, 128  # Qwen3.5-9B's GDN heads


def factors(t, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, HK, K, generator=gen)
    k = torch.randn(1, t, HK, K, generator=gen)
    v = torch.randn(1, t, HV, V, generator=gen)
    g = -torch.exp(torch.empty(1, t, HV).uniform_(-7.0, -1.0, generator=gen))
    beta = torch.rand(1, t, HV, generator=gen)
    return [x.cuda().to(dtype if x is not g else torch.float32) for x in (q, k, v, g, beta)]


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("recurrent_rows", [1, 64], ids=["chunked", "recurrent-upto-64"])
@pytest.mark.parametrize(
    "t, dtype", [(1, torch.bfloat16), (31, torch.bfloat16), (300, torch.bfloat16), (1, torch.float32)],
    ids=["decode-bf16", "chunk31-bf16", "prefill300-bf16", "decode-fp32"],
)
def test_fla_matches_torch(monkeypatch, t, dtype, recurrent_rows):
    """(recurrent_rows: `kernels.FLA_RECURRENT_MAX_ROWS` and `FLA_EAGER_RECURRENT_MAX_ROWS`, which kernel rows from a
    state take.)"""
    import hf_raincheck.gdn_state.kernels as kernels

    monkeypatch.setattr(kernels, "FLA_RECURRENT_MAX_ROWS", recurrent_rows)
    monkeypatch.setattr(kernels, "FLA_EAGER_RECURRENT_MAX_ROWS", recurrent_rows)
    q, k, v, g, beta = factors(t, dtype)
    s0 = torch.randn(1, HV, K, V, generator=torch.Generator().manual_seed(1)).cuda()
    stacked = torch.cat([s0, torch.eye(K).cuda().expand(1, HV, K, K)], dim=-1)
    out_t, st_t = advance("torch", q, k, v, g, beta, stacked, carry=K)
    out_f, st_f = advance("fla", q, k, v, g, beta, stacked, carry=K)
    s_t, p_t, s_f, p_f = st_t[..., :V], st_t[..., V:], st_f[..., :V], st_f[..., V:]
    errors = dict(out=rel(out_f, out_t), state=rel(s_f, s_t), transition=rel(p_f, p_t))
    print(f"\nT={t} {dtype}: relative errors fla vs torch {errors}")
    bound = 2e-2 if dtype == torch.bfloat16 else 2e-3
    assert max(errors.values()) < bound
    # and the stacked call equals the plain one on the state part
    out_plain, s_plain = gated_delta("fla", q, k, v, g, beta, s0)
    assert rel(s_f, s_plain) < bound and rel(out_f, out_plain) < bound


def test_tiny_qwen3_5_end_to_end_fla_equals_torch():
    from handmade import _conv
    from handmade_qwen3_5 import tiny_qwen3_5

    from hf_raincheck import RaincheckConfig, enable_raincheck

    model = enable_raincheck(tiny_qwen3_5("eager").cuda())
    inputs = {k: v.cuda() for k, v in _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4]).items()}
    outs = {}
    for backend in ("torch", "fla"):
        cfg = RaincheckConfig(retention=0.3, pruning="uniform", guard_tokens=2, chunk_size=3, gdn_backend=backend)
        with torch.no_grad():
            outs[backend] = model.generate(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                                           output_logits=True, return_dict_in_generate=True, raincheck_config=cfg)
    a, b = torch.stack(outs["torch"].logits), torch.stack(outs["fla"].logits)
    print(f"\ntiny Qwen3.5 fp32 logits, fla vs torch: max abs diff {float((a - b).abs().max()):.2e}")
    assert torch.equal(outs["torch"].sequences, outs["fla"].sequences)
    torch.testing.assert_close(b, a, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 5, 31], ids=["recurrent", "chunk5", "chunk31"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_identity_rows_leave_fla_states_bit_for_bit(rows, dtype):
    """Rows with ``g = beta = 0`` (a compiled batch step's padding rows, a stopped row's decode position) through
    fla's kernels, as compiled steps call them (the custom op): the final ``[S | P]`` state is the initial one bit
    for bit, so `gdn_batch_forward_graph` writes the kernel's states without selecting the rows that changed."""
    q, k, v, _, _ = factors(rows, dtype, seed=3)
    g = torch.zeros(1, rows, HV, device="cuda")
    beta = torch.zeros(1, rows, HV, device="cuda", dtype=dtype)
    gen = torch.Generator().manual_seed(4)
    state = torch.cat([torch.randn(1, HV, K, V, generator=gen), torch.randn(1, HV, K, K, generator=gen)], -1).cuda()
    _, final = advance("fla", q, k, v, g, beta, state.clone(), carry=K, opaque=True)
    assert torch.equal(final, state)
    _, final = advance("fla", q, k, v, g, beta, state[..., :V].contiguous(), opaque=True)
    assert torch.equal(final, state[..., :V])


@pytest.mark.parametrize("t, cut", [(1250, 1220), (1250, 1000), (300, 64), (200, 199), (90, 1)])
@pytest.mark.parametrize("with_state", [True, False], ids=["state", "zeros"])
def test_fla_split_matches_fla_called_directly(t, cut, with_state):
    """`advance_split` with fla-core (rows before the boundary through their bucket's CUDA graph where
    `graphed.takes`, a tail of at most one chunk in the one-chunk Triton kernel, a longer one from ``[S_b | I]``
    through its own bucket's graph) against fla's functions called directly (the rows before the boundary from the
    state, the tail from ``[S_b | I]`` with values ``[v | 0]``) and against the torch kernels; bf16 as on the GPU."""
    from hf_raincheck.gdn_state.ops import advance_split

    q, k, v, g, beta = factors(t, torch.bfloat16, seed=2)
    s0 = torch.randn(1, HV, K, V, generator=torch.Generator().manual_seed(3)).cuda() if with_state else None
    with torch.no_grad():
        out, boundary, live = advance_split("fla", q, k, v, g, beta, s0, cut)
        head = [x[:, :cut] for x in (q, k, v, g, beta)]
        tail = [x[:, cut:] for x in (q, k, v, g, beta)]
        out1, ref_boundary = gated_delta("fla", *head, s0)
        eye = torch.eye(K, device="cuda").expand(1, HV, K, K)
        tail[2] = torch.cat([tail[2], tail[2].new_zeros(*tail[2].shape[:-1], K)], dim=-1)
        out2, ref_live = gated_delta("fla", *tail, torch.cat([ref_boundary, eye], dim=-1))
        ref_out = torch.cat([out1, out2[..., :V]], dim=1)
        errors = dict(out=rel(out, ref_out), tail_out=rel(out[:, cut:], out2[..., :V]),
                      boundary=rel(boundary, ref_boundary), state=rel(live[..., :V], ref_live[..., :V]),
                      transition=rel(live[..., V:], ref_live[..., V:]))
        print(f"\nT={t} cut={cut}: relative errors against fla called directly {errors}")
        assert max(errors.values()) < 1e-2
        torch_out, torch_boundary, torch_live = advance_split("torch", q, k, v, g, beta, s0, cut)
    assert rel(out, torch_out) < 2e-2 and rel(live, torch_live) < 2e-2 and rel(boundary, torch_boundary) < 2e-2


def test_graphed_prefill_calls_equal_fla_called_directly():
    """`advance("fla", ...)` of an eager prefill (rows `graphed.takes`) replays its bucket's CUDA graph: calls of
    1,220, 1,250 (one bucket), 1,000 (another) and 1,100 rows (the first bucket again, shorter: its rows past 1,100
    inert again), from a state and from zeros, against fla's function called directly: the same kernels on the same
    rows (the bucket's extra rows are inert), so equal to bf16 rounding; outputs handed back earlier are copies that
    later replays leave alone; one graph per bucket."""
    from hf_raincheck.gdn_state import graphed, kernels

    graphed.release()
    state = torch.randn(1, HV, K, V, generator=torch.Generator().manual_seed(7)).cuda()
    kept = []
    for t, s0 in ((1220, None), (1250, state), (1000, state), (1100, None)):
        rows = factors(t, torch.bfloat16, seed=t)
        with torch.no_grad():  # (as in generate: `graphed.takes` leaves autograd-recording calls to fla)
            out, final = advance("fla", *rows, s0)
            want_out, want_final = kernels.gated_delta("fla", *rows, s0)
        errors = dict(out=rel(out, want_out), state=rel(final, want_final))
        print(f"\nT={t}, {'state' if s0 is not None else 'zeros'}: graphed vs direct {errors}")
        assert max(errors.values()) < 1e-2
        kept.append((out, final, out.clone(), final.clone()))
    assert sorted(key[2] for key in graphed._GRAPHS) == [1024, 1280]  # (kind, functions, rows, ...)
    for out, final, out_then, final_then in kept:
        assert torch.equal(out, out_then) and torch.equal(final, final_then)
    graphed.release()
