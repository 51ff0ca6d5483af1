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
from hf_raincheck.gdn_state.naive import naive_gated_delta

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


def test_at_most_max_graphs_are_kept_the_most_recently_used(monkeypatch):
    monkeypatch.setattr(graphed, "BUCKET", 64)
    chunk = functions("torch")[0]
    for t in (65, 129, 65, 193):  # buckets 128, 192, 128 again (now the most recent), 256
        graphed.graphed_chunk(chunk, *rows(t, seed=t), None, capture=False)
    assert [key[1] for key in graphed._GRAPHS] == [128, 256]
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
