"""The split-key grouped attention kernels (`hf_raincheck.attention.grouped_triton`) against the naive reference.

GPU tests (CI deselects them); they also run on the CPU under Triton's interpreter:
``TRITON_INTERPRET=1 python -m pytest -m triton tests/test_grouped_triton.py``.
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


# the default tiles, and small ones: several row tiles and key splits per KV head on tiny shapes
CONFIGS = ["", "block_r=16,block_n=16,programs=4,stages=1", "block_r=32,block_n=32,warps=2,stages=3,programs=1"]


def grouped(*args, config=""):
    from hf_raincheck.attention.grouped_triton import KernelConfig, grouped_attention_kernel  # needs Triton

    return grouped_attention_kernel(*args, config=KernelConfig.parse(config))


def _inputs(q, k, hq, hkv, d, batch, device, seed, mask_heads=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, hq, q, d, generator=gen).to(dtype).to(device)
    key = torch.randn(batch, hkv, k, d, generator=gen).to(dtype).to(device)
    value = torch.randn(batch, hkv, k, d, generator=gen).to(dtype).to(device)
    visible = (torch.rand(batch, mask_heads, q, k, generator=gen) < 0.6).to(device)
    return query, key, value, visible


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("q,k,hq,hkv,d,batch", [(2, 9, 4, 4, 16, 1), (8, 40, 4, 2, 16, 1), (32, 100, 8, 2, 16, 2),
                                                (5, 7, 6, 1, 24, 1), (4, 300, 4, 2, 32, 1)])
def test_grouped_kernel_equals_naive(device, q, k, hq, hkv, d, batch, config):
    """Several key splits (300 keys), several row tiles (64 rows), head dims that are not a power of two, a row
    that sees nothing (zeros), a row that sees only its last key; for several tile configurations."""
    query, key, value, visible = _inputs(q, k, hq, hkv, d, batch, device, seed=q + k)
    visible[0, 0, 0] = False
    if q > 1:
        visible[0, 0, 1] = False
        visible[0, 0, 1, k - 1] = True
    ref = naive_attention(query, key, value, visible, 0.3)
    out = grouped(query, key, value, visible, 0.3, config=config)
    assert out.shape == ref.shape == (batch, q, hq, d) and out.dtype == value.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))


def test_grouped_kernel_masks_per_head_and_shared_over_the_batch(device):
    """A mask per KV head (the reference takes it per query head: each KV head's mask repeated over its group),
    and one mask shared by the batch."""
    query, key, value, visible = _inputs(6, 70, 8, 2, 16, 3, device, seed=4, mask_heads=2)
    per_query_head = visible.repeat_interleave(4, dim=1)
    torch.testing.assert_close(grouped(query, key, value, visible, 0.25),
                               naive_attention(query, key, value, per_query_head, 0.25), atol=1e-5, rtol=1e-5)
    shared = visible[:1, :1]
    torch.testing.assert_close(grouped(query, key, value, shared, 0.25),
                               naive_attention(query, key, value, shared, 0.25), atol=1e-5, rtol=1e-5)


def test_grouped_kernel_reads_a_cache_slice(device):
    """Keys and values as views of a larger static cache (strided over slots, the head dim contiguous)."""
    query, key, value, visible = _inputs(4, 50, 4, 2, 16, 1, device, seed=8)
    big_k = torch.zeros(1, 2, 80, 16, device=device)
    big_v = torch.zeros_like(big_k)
    big_k[:, :, :50] = key
    big_v[:, :, :50] = value
    torch.testing.assert_close(grouped(query, big_k[:, :, :50], big_v[:, :, :50], visible, 0.3),
                               naive_attention(query, key, value, visible, 0.3), atol=1e-5, rtol=1e-5)


def test_grouped_kernel_bf16_is_close_to_the_fp32_reference(device):
    if device.type != "cuda":
        pytest.skip("bf16 products: the GPU run")
    query, key, value, visible = _inputs(32, 4352, 32, 8, 128, 1, device, seed=3)
    visible[..., :1] = True
    ref = naive_attention(query, key, value, visible, 128 ** -0.5)
    out = grouped(query.bfloat16(), key.bfloat16(), value.bfloat16(), visible, 128 ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_grouped_attention_routes_to_the_kernel_when_asked(device, monkeypatch):
    """``HF_RAINCHECK_GROUPED_KERNEL=triton`` (read at import; here the module switch) sends the grouped path to
    the kernel pair; its answer equals the reference."""
    from hf_raincheck.attention import grouped_triton

    calls = []
    monkeypatch.setattr(sdpa, "_grouped_kernel", lambda *a: calls.append(1) or grouped_triton.grouped_attention_kernel(*a))
    query, key, value, visible = _inputs(6, 40, 8, 2, 16, 1, device, seed=2)
    out = sdpa.grouped_attention(query, key, value, visible, 0.3)
    torch.testing.assert_close(out, naive_attention(query, key, value, visible, 0.3), atol=1e-5, rtol=1e-5)
    assert calls == [1]


def test_grouped_kernel_compiles_into_a_cuda_graph(device):
    """Compiled (fullgraph, CUDA graphs) at a Qwen3-VL-8B fused-step shape, the op gives the eager kernels' values."""
    if device.type != "cuda":
        pytest.skip("torch.compile with Triton kernels needs CUDA")
    query, key, value, visible = _inputs(32, 4352, 32, 8, 128, 1, device, seed=6, dtype=torch.bfloat16)
    visible[..., :1] = True
    fn = torch.compile(lambda *a: grouped(*a, 128 ** -0.5), fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        got = fn(query, key, value, visible)
    torch.testing.assert_close(got, grouped(query, key, value, visible, 128 ** -0.5), atol=0, rtol=0)


def test_kernel_config_parses_and_names_bad_fields():
    pytest.importorskip("triton")
    from hf_raincheck.attention.grouped_triton import KernelConfig

    assert KernelConfig.parse("") == KernelConfig()
    assert KernelConfig.parse("block_r=32, stages=3") == KernelConfig(block_r=32, stages=3)
    with pytest.raises(ValueError, match="'rows=2' is not one of"):
        KernelConfig.parse("rows=2")
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 48"):
        KernelConfig.parse("block_n=48")
    with pytest.raises(ValueError, match="warps in 1/2/4/8/16"):
        KernelConfig.parse("warps=3")
