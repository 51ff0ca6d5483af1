"""`gdn_state.graphed`: eager prefill calls of fla's chunked function through one CUDA graph per bucket of rows.

On the CPU the bucket's static buffers run without a graph (``capture=False``), with transformers' torch kernel as
the chunked function: the padding (inert rows past the call's own), the reuse of a bucket by calls of other lengths
and states, the copies handed back, the kept graphs. The graphs themselves run on a GPU (`tests/test_gdn_gpu.py`).
"""

from __future__ import annotations

import pytest
import torch

from hf_raincheck.gdn_state import graphed
from hf_raincheck.gdn_state.kernels import functions
from hf_raincheck.gdn_state.naive import naive_gated_delta, naive_transition

HK, HV, K, V = 2, 4, 16, 8


def rows(t, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, HK, K, generator=gen)
    k = torch.randn(1, t, HK, K, generator=gen)
    v = torch.randn(1, t, HV, V, generator=gen)
    g = -0.2 * torch.rand(1, t, HV, generator=gen)
    beta = torch.rand(1, t, HV, generator=gen)
    return q, k, v, g, beta


@pytest.fixture(autouse=True)
def _fresh():
    graphed.release()
    yield
    graphed.release()


def test_calls_of_one_bucket_equal_the_per_token_reference():
    """Calls of 100, 70 (shorter: the last call's rows past it must be inert again), 90 and 128 rows, from a state
    and from zeros (after a state: the bucket's state zeroed), all through one bucket of 128 rows: outputs and final
    states within 1e-5 of the float64 recurrence; results handed back earlier are not rewritten by later calls."""
    chunk = functions("torch")[0]
    state = 0.3 * torch.randn(1, HV, K, V, generator=torch.Generator().manual_seed(1))
    kept = []
    for t, s0 in ((100, state), (70, None), (90, None), (128, state), (75, None)):
        factors = rows(t, seed=t)
        out, final = graphed.graphed_chunk(chunk, *factors, s0, capture=False)
        want_out, want_final = naive_gated_delta(*factors, s0)
        assert out.shape == (1, t, HV, V) and final.shape == (1, HV, K, V) and final.dtype == torch.float32
        torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final.double(), want_final, atol=1e-5, rtol=1e-5)
        kept.append((out, final, want_out, want_final))
    assert len(graphed._GRAPHS) == 1
    for out, final, want_out, want_final in kept:
        torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final.double(), want_final, atol=1e-5, rtol=1e-5)


def _torch_tail(q, k, v, g, beta, state):
    """`kernels.gated_delta_with_transition` in torch: rows from ``[state | I]`` with values ``[v | 0]``."""
    chunk = functions("torch")[0]
    eye = torch.eye(K).expand(1, HV, K, K)
    out, final = chunk(q, k, torch.cat([v, v.new_zeros(*v.shape[:-1], K)], dim=-1), g=g, beta=beta,
                       initial_state=torch.cat([state, eye], dim=-1), output_final_state=True,
                       use_qk_l2norm_in_kernel=True)
    return out[..., :V], final.float()


def test_split_calls_equal_the_per_token_reference():
    """`graphed_split` (the rows before a boundary and the tail after it, padded to `TAIL_ROWS` inert rows, in one
    runner): calls of 100 rows with a tail of 20, of 120 with 60 (a longer tail: the last call's head rows past the
    new cut inert again), of 90 with 5 (the tail's rows past 5 inert again), of 128 with 1, from a state and from
    zeros: outputs, the boundary state and ``[S_T | P_tail]`` within 1e-5 of the float64 recurrence, through one
    kept runner (bucket of 128 rows); results handed back earlier are not rewritten."""
    chunk = functions("torch")[0]
    state = 0.3 * torch.randn(1, HV, K, V, generator=torch.Generator().manual_seed(1))
    kept = []
    for t, tail, s0 in ((100, 20, state), (120, 60, None), (90, 5, state), (128, 1, None)):
        factors = rows(t, seed=t + tail)
        cut = t - tail
        out, boundary, live = graphed.graphed_split(chunk, _torch_tail, *factors, s0, cut, capture=False)
        want = dict(out=naive_gated_delta(*factors, s0)[0],
                    boundary=naive_gated_delta(*(x[:, :cut] for x in factors), s0)[1],
                    state=naive_gated_delta(*factors, s0)[1],
                    transition=naive_transition(factors[1][:, cut:], factors[3][:, cut:], factors[4][:, cut:], HV))
        got = dict(out=out, boundary=boundary, state=live[..., :V], transition=live[..., V:])
        assert out.shape == (1, t, HV, V) and live.shape == (1, HV, K, V + K) and boundary.dtype == torch.float32
        for name in want:
            torch.testing.assert_close(got[name].double(), want[name], atol=1e-5, rtol=1e-5, msg=name)
        kept.append((got, want))
    assert len(graphed._GRAPHS) == 1
    for got, want in kept:
        for name in want:
            torch.testing.assert_close(got[name].double(), want[name], atol=1e-5, rtol=1e-5, msg=name)


def test_calls_of_one_shape_each_take_their_own_rows():
    """A forward's GDN layers call with one shape after another (the runner reuses its destination views): split
    calls of 100 rows with a tail of 20 from a state (three), one with a tail of 30 from zeros, the first shape
    again; then three chunk calls of 90 rows: each on its own rows, within 1e-5 of the float64 recurrence."""
    chunk = functions("torch")[0]
    state = 0.3 * torch.randn(1, HV, K, V, generator=torch.Generator().manual_seed(2))
    for seed, s0, cut in ((11, state, 80), (12, state, 80), (13, state, 80), (14, None, 70), (15, state, 80)):
        factors = rows(100, seed=seed)
        out, boundary, live = graphed.graphed_split(chunk, _torch_tail, *factors, s0, cut, capture=False)
        want_out, want_state = naive_gated_delta(*factors, s0)
        torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(live[..., :V].double(), want_state, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(boundary.double(), naive_gated_delta(*(x[:, :cut] for x in factors), s0)[1],
                                   atol=1e-5, rtol=1e-5)
    for seed in (21, 22, 23):
        factors = rows(90, seed=seed)
        out, final = graphed.graphed_chunk(chunk, *factors, None, capture=False)
        want_out, want_final = naive_gated_delta(*factors, None)
        torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final.double(), want_final, atol=1e-5, rtol=1e-5)


def test_split_takes_a_short_tail_after_rows_the_graphs_take():
    cuda = torch.device("cuda")
    assert not graphed.takes_split(1000, 0, 1, cuda) and not graphed.takes_split(1000, graphed.TAIL_ROWS + 1, 1, cuda)
    assert not graphed.takes_split(graphed.MIN_ROWS - 1, 30, 1, cuda)
    assert not graphed.takes_split(1000, 30, 1, torch.device("cpu"))
    if torch.cuda.is_available():
        with torch.no_grad():
            assert graphed.takes_split(1000, 30, 1, cuda) and graphed.takes_split(1000, graphed.TAIL_ROWS, 1, cuda)


def test_at_most_max_graphs_are_kept_the_most_recently_used(monkeypatch):
    monkeypatch.setattr(graphed, "BUCKET", 64)
    assert graphed.MAX_GRAPHS == 3
    chunk = functions("torch")[0]
    for t in (65, 129, 193, 65, 257):  # buckets 128, 192, 256, 128 again (now the most recent), 320
        graphed.graphed_chunk(chunk, *rows(t, seed=t), None, capture=False)
    assert [key[2] for key in graphed._GRAPHS] == [256, 128, 320]  # (kind, functions, rows, ...)
    graphed.release()
    assert not graphed._GRAPHS


def test_takes_eager_calls_at_batch_1_on_cuda_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not graphed.takes(1000, 1, cpu)
    assert not graphed.takes(graphed.MIN_ROWS - 1, 1, cuda) and not graphed.takes(graphed.MAX_ROWS + 1, 1, cuda)
    assert not graphed.takes(1000, 2, cuda)
    if not torch.cuda.is_available():  # (is_current_stream_capturing needs a CUDA runtime)
        return
    with torch.no_grad():
        assert graphed.takes(1000, 1, cuda)
    with torch.enable_grad():
        assert not graphed.takes(1000, 1, cuda)  # autograd recording: fla's function, with its history


def test_a_failed_capture_warns_once_and_calls_the_function(monkeypatch):
    chunk = functions("torch")[0]

    def broken(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphed, "_Runner", broken)
    factors = rows(100, seed=3)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        out, final = graphed.graphed_chunk(chunk, *factors, None, capture=False)
    want_out, want_final = naive_gated_delta(*factors, None)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final.double(), want_final, atol=1e-5, rtol=1e-5)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphed.graphed_chunk(chunk, *rows(120, seed=4), None, capture=False)  # the same bucket: no second warning
    assert not graphed._GRAPHS


def test_a_failed_split_capture_leaves_the_two_calls_to_advance_split(monkeypatch):
    """A split graph that cannot be captured warns once and returns None (no call is made); `ops.advance_split`
    then makes the rows' two calls itself, with the per-token reference's outputs and states."""
    from hf_raincheck.gdn_state import kernels, ops

    def broken(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphed, "_Runner", broken)
    chunk = functions("torch")[0]
    factors = rows(100, seed=7)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        assert graphed.graphed_split(chunk, _torch_tail, *factors, None, 80, capture=False) is None
    asked = []
    monkeypatch.setattr(kernels, "split_graph_takes", lambda *a: True)
    monkeypatch.setattr(kernels, "tail_kernel_takes", lambda *a: True)
    monkeypatch.setattr(kernels, "gated_delta_split", lambda *a: asked.append(a[-1]) or graphed.graphed_split(
        chunk, _torch_tail, *a[:-2], a[-2], a[-1], capture=False))
    monkeypatch.setattr(kernels, "gated_delta_with_transition", _torch_tail)
    out, boundary, live = ops.advance_split("torch", *factors, None, 80)
    assert asked == [80] and not graphed._GRAPHS
    torch.testing.assert_close(out.double(), naive_gated_delta(*factors, None)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(boundary.double(), naive_gated_delta(*(x[:, :80] for x in factors), None)[1],
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(live[..., :V].double(), naive_gated_delta(*factors, None)[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(live[..., V:].double(),
                               naive_transition(factors[1][:, 80:], factors[3][:, 80:], factors[4][:, 80:], HV),
                               atol=1e-5, rtol=1e-5)


def test_a_bucket_made_in_inference_mode_serves_calls_outside_it():
    """`generate` runs under ``no_grad``; a script may wrap it in ``inference_mode``: the bucket's static buffers are
    normal tensors either way, so the next call (outside inference mode) can write them."""
    chunk = functions("torch")[0]
    with torch.inference_mode():
        graphed.graphed_chunk(chunk, *rows(100, seed=5), None, capture=False)
    factors = rows(90, seed=6)
    with torch.no_grad():
        out, final = graphed.graphed_chunk(chunk, *factors, None, capture=False)
    torch.testing.assert_close(out.double(), naive_gated_delta(*factors, None)[0], atol=1e-5, rtol=1e-5)
    assert len(graphed._GRAPHS) == 1
