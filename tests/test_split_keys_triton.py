"""The split-keys masked attention kernel (`hf_raincheck.attention.split_keys_triton`) against `naive_attention`.

GPU tests (CI deselects them); they also run on the CPU under Triton's interpreter:
``TRITON_INTERPRET=1 python -m pytest -m triton tests/test_split_keys_triton.py``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import TRITON_MARKS  # noqa: E402

from hf_raincheck.attention import naive_attention, sdpa  # noqa: E402

pytestmark = TRITON_MARKS


@pytest.fixture(scope="module")
def device(triton_device) -> torch.device:
    return triton_device


def _dtype(device) -> torch.dtype:
    """The kernel's dtype where it runs in the package: bf16 on a GPU; fp32 under the interpreter (which has no
    bf16 dots), where the reference is met to float rounding."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _tol(dtype) -> dict:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def _case(b, hq, hkv, q, k, d, device, mask_batch, seed, dtype=None):
    dtype = dtype or _dtype(device)
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(b, hq, q, d, generator=gen).to(dtype).to(device)
    key = torch.randn(b, hkv, k, d, generator=gen).to(dtype).to(device)
    value = torch.randn(b, hkv, k, d, generator=gen).to(dtype).to(device)
    visible = torch.rand(mask_batch, 1, q, k, generator=gen) < 0.6
    visible[0, 0, 0] = False  # a row that sees nothing
    if q > 1:
        visible[0, 0, 1] = False
        visible[0, 0, 1, k - 1] = True  # a row that sees only the last key
    return query, key, value, visible.to(device)


def _reference(query, key, value, visible, scaling):
    """`naive_attention` in fp32 (the kernel's scores and softmax are fp32), in the query's dtype."""
    out = naive_attention(query.float(), key.float(), value.float(), visible, scaling)
    return out.to(query.dtype)


# (batch, query heads, KV heads, rows, keys, head dim, mask batch): groups of 1 / 2 / 4, one row (a decode row), a
# fused step's chunk + decode row, stacked rows over one tile (5 x 4 = 20 of 16), keys off the block size, a
# per-row mask and a shared one
SHAPES = [
    (1, 4, 4, 1, 70, 16, 1),
    (2, 8, 2, 5, 129, 32, 2),
    (2, 8, 2, 5, 129, 32, 1),
    (1, 8, 2, 32, 300, 32, 1),
    (1, 16, 4, 9, 64, 64, 1),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_split_keys_equals_naive(device, shape):
    from hf_raincheck.attention.split_keys_triton import split_keys_attention

    b, hq, hkv, q, k, d, mask_batch = shape
    query, key, value, visible = _case(b, hq, hkv, q, k, d, device, mask_batch, seed=sum(shape))
    got = split_keys_attention(query, key, value, visible, d ** -0.5)
    want = _reference(query, key, value, visible, d ** -0.5)
    assert got.shape == (b, q, hq, d) and got.dtype == query.dtype
    torch.testing.assert_close(got, want, **_tol(query.dtype))
    assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))  # the row that sees nothing: zeros


@pytest.mark.parametrize("tiling", [dict(splits=1), dict(splits=3), dict(splits=64), dict(block_m=16, block_n=16),
                                    dict(block_m=32, block_n=32, warps=2), dict(splits=2, block_m=64, warps=8)],
                         ids=lambda t: ",".join(f"{k}={v}" for k, v in t.items()))
def test_other_tilings_equal_naive(device, tiling):
    """`launch_split_keys`' tilings (the benchmark sweeps them): one key range, ranges that see nothing (many
    ranges of few keys, the masked rows), row tiles smaller than the stacked rows."""
    from hf_raincheck.attention.split_keys_triton import launch_split_keys

    query, key, value, visible = _case(2, 8, 2, 6, 200, 32, device, 2, seed=7)
    visible[1, 0, 2, :150] = False  # the first ranges of a row see nothing
    got = launch_split_keys(query, key, value, visible, 0.2, **tiling)
    torch.testing.assert_close(got, _reference(query, key, value, visible, 0.2), **_tol(query.dtype))


def test_strided_query_from_the_attention_module(device):
    """The attention module hands over ``query`` as a transpose of ``[B, q, Hq, D]`` (not contiguous), and keys /
    values as slices of a larger cache."""
    from hf_raincheck.attention.split_keys_triton import split_keys_attention

    query, key, value, visible = _case(1, 8, 2, 7, 90, 32, device, 1, seed=11)
    strided_query = query.transpose(1, 2).contiguous().transpose(1, 2)
    cache = torch.randn(1, 2, 120, 32, dtype=key.dtype, device=device)
    cache[:, :, :90] = key
    got = split_keys_attention(strided_query, cache[:, :, :90], value, visible, 0.25)
    torch.testing.assert_close(got, _reference(query, key, value, visible, 0.25), **_tol(query.dtype))


def test_sdpa_routes_masked_short_forwards_to_it(device, monkeypatch):
    """`sdpa_attention` takes the kernel for 2 to GROUPED_MAX_ROWS masked rows on a Triton device (not for one
    row, not inside an eager short forward, not above SPLIT_KEYS_MAX_DIM); the result equals the reference."""
    assert sdpa._split_keys is not None  # Triton imports here: sdpa took the kernel at import
    calls = []
    original = sdpa._split_keys
    monkeypatch.setattr(sdpa, "_split_keys", lambda *a: calls.append(a[0].shape) or original(*a))
    query, key, value, visible = _case(1, 8, 2, 6, 40, 16, device, 1, seed=5)
    out = sdpa.sdpa_attention(query, key, value, visible, 0.3)
    torch.testing.assert_close(out, _reference(query, key, value, visible, 0.3), **_tol(query.dtype))
    assert len(calls) == 1
    sdpa.sdpa_attention(query[:, :, :1], key, value, visible[:, :, :1], 0.3)  # one row: SDPA
    with sdpa._EAGER_SHORT:
        inside = sdpa.sdpa_attention(query, key, value, visible, 0.3)  # eager short forward: the grouped path
    torch.testing.assert_close(inside, out, **_tol(query.dtype))
    monkeypatch.setattr(sdpa, "SPLIT_KEYS_MAX_DIM", 8)
    sdpa.sdpa_attention(query, key, value, visible, 0.3)
    assert len(calls) == 1


def test_split_keys_compiles_into_a_cuda_graph(device):
    """Compiled (fullgraph, CUDA graphs) at Qwen3-VL-8B's fused-step shape, the op gives the eager kernel's
    values."""
    if device.type != "cuda":
        pytest.skip("torch.compile with Triton kernels needs CUDA")
    from hf_raincheck.attention.split_keys_triton import split_keys_attention

    query, key, value, visible = _case(1, 32, 8, 32, 4352, 128, device, 1, seed=3)
    fn = torch.compile(lambda *a: split_keys_attention(*a, 128 ** -0.5), fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        got = fn(query, key, value, visible)
    torch.testing.assert_close(got, split_keys_attention(query, key, value, visible, 128 ** -0.5), atol=0, rtol=0)
    torch.testing.assert_close(got, _reference(query, key, value, visible, 128 ** -0.5), atol=2e-2, rtol=2e-2)


def test_bad_inputs_are_refused_naming_the_argument(device):
    from hf_raincheck.attention.split_keys_triton import launch_split_keys

    query, key, value, visible = _case(1, 6, 4, 2, 8, 16, device, 1, seed=4)
    with pytest.raises(ValueError, match="Hkv dividing Hq"):
        launch_split_keys(query, key, value, visible, 0.3)
    query, key, value, visible = _case(1, 4, 2, 2, 8, 24, device, 1, seed=4)
    with pytest.raises(ValueError, match="head dim must be a power of two"):
        launch_split_keys(query, key, value, visible, 0.3)
    query, key, value, visible = _case(1, 4, 2, 2, 8, 16, device, 1, seed=4)
    for tiling, name in ((dict(block_m=100), "block_m"), (dict(block_n=8), "block_n"), (dict(warps=3), "warps"),
                         (dict(splits=-1), "splits")):
        with pytest.raises(ValueError, match=f"^{name}"):
            launch_split_keys(query, key, value, visible, 0.3, **tiling)


def test_fused_steps_through_the_kernel_equal_the_grouped_path(device, monkeypatch):
    """End to end: a tiny Qwen3-VL's Raincheck answer whose fused steps' masked rows run the kernel (on the CPU, under
    Triton's interpreter, eager forwards take it: no eager-short context there) equals the answer through the
    grouped path: same tokens, logits to fp32 rounding. (On a GPU the compiled bf16 steps are compared in
    tests/test_steps_gpu.py.)"""
    if device.type != "cpu":
        pytest.skip("the CPU run of the interpreter; the GPU's compiled steps: tests/test_steps_gpu.py")
    from handmade import _conv, _tiny_model
    from helpers import generate, new_tokens

    from hf_raincheck import RaincheckConfig, enable_raincheck

    model = enable_raincheck(_tiny_model("eager"))
    inputs = _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4])
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking")
    calls = []
    kernel = sdpa._split_keys
    monkeypatch.setattr(sdpa, "_split_keys", lambda *a: calls.append(tuple(a[0].shape)) or kernel(*a))
    through_kernel = generate(model, inputs, 10, cfg)
    assert calls and {shape[2] for shape in calls} <= {6, 5, 4, 3, 2}, calls  # fused steps: chunk + decode row
    monkeypatch.setattr(sdpa, "_split_keys", None)
    grouped = generate(model, inputs, 10, cfg)
    assert new_tokens(through_kernel, inputs) == new_tokens(grouped, inputs)
    torch.testing.assert_close(torch.stack(through_kernel.logits), torch.stack(grouped.logits), atol=1e-4, rtol=1e-4)
