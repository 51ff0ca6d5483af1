"""The grouped path's masked softmax kernel (`hf_raincheck.attention.softmax_triton`) against its torch reference.

GPU tests (CI deselects them); they also run on the CPU under Triton's interpreter:
``TRITON_INTERPRET=1 python -m pytest -m triton tests/test_softmax_triton.py``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import TRITON_MARKS  # noqa: E402

from hf_raincheck.attention import naive_attention, naive_masked_softmax, sdpa  # noqa: E402

pytestmark = TRITON_MARKS


@pytest.fixture(scope="module")
def device(triton_device) -> torch.device:
    return triton_device


def masked_softmax(*args):
    from hf_raincheck.attention.softmax_triton import masked_softmax as kernel  # needs Triton

    return kernel(*args)


def _case(b, h, g, q, k, device, dtype, mask_batch, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = (4 * torch.randn(b, h, g, q, k, generator=gen)).to(dtype).to(device)
    visible = (torch.rand(mask_batch, 1, q, k, generator=gen) < 0.7).to(device)
    visible[0, 0, 0] = False  # a row that sees nothing
    if q > 1:
        visible[0, 0, 1] = False
        visible[0, 0, 1, k - 1] = True  # a row that sees only its last key
    return scores, visible


@pytest.mark.parametrize("k", [1, 7, 200, 8192, 9000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_softmax_equals_torch(device, k, dtype):
    if device.type == "cpu" and k > 256:
        pytest.skip("long rows: too slow under the interpreter (the GPU run covers them)")
    for b, mask_batch in ((1, 1), (2, 1), (2, 2)):
        scores, visible = _case(b, 2, 3, 4, k, device, dtype, mask_batch, seed=k + b)
        for out_dtype in (torch.float32, torch.bfloat16):
            want = sdpa.grouped_softmax_torch(scores, visible, out_dtype)
            got = masked_softmax(scores, visible, out_dtype)
            assert got.shape == want.shape == (b, 2, 3 * 4, k) and got.dtype == out_dtype
            tol = dict(atol=2e-6, rtol=2e-5) if out_dtype == torch.float32 else {}
            torch.testing.assert_close(got, want, **tol)
            if k <= 256:  # the plain reference (row by row): slow for long rows
                torch.testing.assert_close(got, naive_masked_softmax(scores, visible, out_dtype), **tol)
            rows = got.view(b, 2, 3, 4, k)
            assert torch.equal(rows[0, :, :, 0], torch.zeros_like(rows[0, :, :, 0]))  # sees nothing: zeros


def test_two_pass_rows_equal_torch(device, monkeypatch):
    """Rows longer than ONE_PASS_KEYS take the online max / sum pass, then the write pass: same values (here with
    small limits, so that the interpreter runs it too; blocks that see nothing and a row that sees nothing)."""
    from hf_raincheck.attention import softmax_triton

    monkeypatch.setattr(softmax_triton, "ONE_PASS_KEYS", 64)
    monkeypatch.setattr(softmax_triton, "LONG_BLOCK", 32)
    scores, visible = _case(2, 2, 2, 3, 200, device, torch.float32, 2, seed=1)
    visible[1, 0, 2, :96] = False  # the first three blocks of a row see nothing
    got = masked_softmax(scores, visible, torch.float32)
    torch.testing.assert_close(got, sdpa.grouped_softmax_torch(scores, visible, torch.float32), atol=2e-6, rtol=2e-5)


def test_grouped_attention_takes_the_kernel_and_matches_naive(device, monkeypatch):
    """On a Triton device the grouped path's softmax is the kernel; the attention still equals the reference."""
    calls = []
    original = sdpa._masked_softmax
    assert original is not None  # Triton imports here: sdpa took the kernel at import
    monkeypatch.setattr(sdpa, "_masked_softmax", lambda *a: calls.append(1) or original(*a))
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(2, 8, 6, 16, generator=gen).to(device)
    key = torch.randn(2, 2, 40, 16, generator=gen).to(device)
    value = torch.randn(2, 2, 40, 16, generator=gen).to(device)
    visible = (torch.rand(2, 1, 6, 40, generator=gen) < 0.6).to(device)
    visible[0, 0, 0] = False
    out = sdpa.grouped_attention(query, key, value, visible, 0.3)
    torch.testing.assert_close(out, naive_attention(query, key, value, visible, 0.3), atol=1e-5, rtol=1e-5)
    assert calls == [1]
    # inside an eager short forward (`eager_sdpa_backends` on CUDA) the torch softmax runs instead: same result
    with sdpa._EAGER_SHORT:
        inside = sdpa.grouped_attention(query, key, value, visible, 0.3)
    torch.testing.assert_close(inside, naive_attention(query, key, value, visible, 0.3), atol=1e-5, rtol=1e-5)
    assert calls == [1]


def test_masked_softmax_compiles_into_a_cuda_graph(device):
    """Compiled (fullgraph, CUDA graphs), the op gives the eager kernel's values."""
    if device.type != "cuda":
        pytest.skip("torch.compile with Triton kernels needs CUDA")
    scores, visible = _case(1, 8, 4, 32, 4352, device, torch.bfloat16, 1, seed=3)
    fn = torch.compile(lambda s, v: masked_softmax(s, v, torch.bfloat16), fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        got = fn(scores, visible)
    torch.testing.assert_close(got, masked_softmax(scores, visible, torch.bfloat16), atol=0, rtol=0)


@pytest.mark.parametrize("block, warps", [(32, 1), (64, 0), (0, 2), (256, 8)])
def test_other_tilings_equal_torch(device, block, warps):
    """`launch_masked_softmax`'s tilings (benchmarks sweep them; one pass where the row fits the block, else two
    passes): the same values as the torch reference."""
    from hf_raincheck.attention.softmax_triton import launch_masked_softmax

    scores, visible = _case(2, 2, 2, 3, 200, device, torch.bfloat16, 2, seed=2)
    visible[1, 0, 2, :96] = False
    for out_dtype in (torch.float32, torch.bfloat16):
        got = launch_masked_softmax(scores, visible, out_dtype, block=block, warps=warps)
        tol = dict(atol=2e-6, rtol=2e-5) if out_dtype == torch.float32 else {}
        torch.testing.assert_close(got, sdpa.grouped_softmax_torch(scores, visible, out_dtype), **tol)


def test_bad_tilings_are_refused_naming_the_argument(device):
    from hf_raincheck.attention.softmax_triton import launch_masked_softmax

    scores, visible = _case(1, 1, 1, 2, 8, device, torch.float32, 1, seed=4)
    for tiling, name in ((dict(block=100), "block"), (dict(block=8), "block"), (dict(warps=3), "warps")):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            launch_masked_softmax(scores, visible, torch.float32, **tiling)
