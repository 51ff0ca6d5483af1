"""`received_attention`'s Triton kernels (`hf_raincheck.pruning.attention_triton`) against the torch reference
`received_attention_torch` on the same values in fp32: segments (straddling blocks, shorter than a block, empty),
head dims (not powers of two), heads, dtypes, strided q / k, and the VisionZip ranking they give.

On CUDA; on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, small sizes only), which the ``triton``
marker lets run on a machine without a GPU (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from hf_raincheck.pruning.hiprune import ranking
from hf_raincheck.pruning.triton_support import triton_enabled
from hf_raincheck.pruning.vision import pool_merged, received_attention, received_attention_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.triton,
    # the interpreter evaluates masked-off lanes too (log2(0), exp2 overflow) and takes loop bounds from 1-element
    # arrays, which numpy warns about
    pytest.mark.filterwarnings(
        "ignore:divide by zero:RuntimeWarning",
        "ignore:overflow:RuntimeWarning",
        "ignore:Conversion of an array with ndim > 0:DeprecationWarning",
    ),
]

SEGMENTS = {
    "one": [0, 200],
    # lengths not multiples of any block, one shorter than a block, an empty one; rows past the last bound
    "several": [0, 5, 70, 70, 181, 260, 333],
}


@pytest.fixture(scope="module")
def device(triton_device) -> torch.device:
    return triton_device


@pytest.fixture(scope="module")
def kernel(device):
    from hf_raincheck.pruning.attention_triton import received_attention_triton

    return received_attention_triton


def make_qk(total, heads, head_dim, dtype, device, seed=0, sharpness=2.0):
    """q, k ``[total, heads, head_dim]`` as strided slices of one qkv tensor (as the ViT blocks compute them)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(total, 3, heads, head_dim, generator=gen)
    qkv[:, 0] *= sharpness  # peakier softmax than unit logits
    qkv = qkv.to(device=device, dtype=dtype)
    return qkv[:, 0], qkv[:, 1]


def check(kernel, q, k, cu, rtol, atol):
    scale = q.shape[-1] ** -0.5
    got = kernel(q, k, cu, scale)
    want = received_attention_torch(q.float(), k.float(), cu, scale)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    return got, want


TOLERANCES = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-3, 1e-5), torch.float16: (1e-3, 1e-5)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("segments", list(SEGMENTS))
@pytest.mark.parametrize("heads,head_dim", [(1, 72), (4, 72), (4, 64), (2, 16)])
def test_matches_torch(kernel, device, dtype, segments, heads, head_dim):
    cu = SEGMENTS[segments]
    q, k = make_qk(cu[-1] + 7, heads, head_dim, dtype, device, seed=heads * 100 + head_dim)
    assert not q.is_contiguous()
    got, want = check(kernel, q, k, cu, *TOLERANCES[dtype])
    assert torch.all(got[cu[-1] :] == 0)  # outside every segment: no queries
    # each segment's queries spread a total of 1 each over their segment's keys
    for a, b in zip(cu[:-1], cu[1:]):
        assert got[a:b].sum().item() == pytest.approx(b - a, rel=1e-4)


def test_layouts_and_bounds(kernel, device):
    """Contiguous, head-major (transposed) and fp16 inputs; ``cu_seqlens`` as an int32 tensor on the device."""
    cu = torch.tensor([0, 40, 41, 150], dtype=torch.int32, device=device)
    q, k = make_qk(150, 3, 80, torch.float32, device, seed=1)
    check(kernel, q.contiguous(), k.contiguous(), cu, *TOLERANCES[torch.float32])
    qh, kh = q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous()  # [heads, P, d]
    check(kernel, qh.transpose(0, 1), kh.transpose(0, 1), cu, *TOLERANCES[torch.float32])
    check(kernel, q.half(), k.half(), cu, *TOLERANCES[torch.float16])
    assert kernel(q[:0], k[:0], [0], 0.1).shape == (0,)


def test_visionzip_ranking_is_unchanged(kernel, device):
    """The top-b merged tokens per segment (VisionZip's choice, ties to the lowest index) are those of the torch
    reference, in the same order."""
    frames, patches, merge = (16, 1024, 4) if device.type == "cuda" else (2, 192, 4)
    for dtype in (torch.float32, torch.bfloat16):
        q, k = make_qk(frames * patches, 4, 72, dtype, device, seed=5)
        cu = [i * patches for i in range(frames + 1)]
        got, want = check(kernel, q, k, cu, *TOLERANCES[dtype])
        budget = patches // merge // 4
        top = [ranking(pool_merged(x, merge).view(frames, -1))[:, :budget] for x in (got, want)]
        assert torch.equal(top[0], top[1])


def test_received_attention_dispatches(kernel, device, monkeypatch):
    q, k = make_qk(100, 2, 72, torch.float32, device, seed=3)
    cu = [0, 60, 100]
    assert triton_enabled(device)
    assert torch.equal(received_attention(q, k, cu, 0.1), kernel(q, k, cu, 0.1))
    monkeypatch.setenv("HF_RAINCHECK_TRITON", "0")
    assert not triton_enabled(device)
    assert torch.equal(received_attention(q, k, cu, 0.1), received_attention_torch(q, k, cu, 0.1))


@pytest.mark.parametrize("case", ["image", "video"])
def test_large_on_cuda(kernel, device, case):
    """A 4096-merged-token image (16384 patches, one segment) and a 16-frame video (16 x 1024), 16 heads of 72,
    bf16: Qwen3-VL's ViT at its sizes."""
    if device.type != "cuda":
        pytest.skip("large sizes: CUDA only")
    frames, patches = (1, 16384) if case == "image" else (16, 1024)
    q, k = make_qk(frames * patches, 16, 72, torch.bfloat16, device, seed=7, sharpness=1.0)
    cu = torch.arange(frames + 1, device=device, dtype=torch.int32) * patches
    check(kernel, q, k, cu, *TOLERANCES[torch.bfloat16])
