"""`received_attention`'s Triton kernels (`hf_raincheck.pruning.attention_triton`) against the torch reference
`received_attention_torch` on the same values in fp32: segments (straddling blocks, shorter than a block, empty),
head dims (not powers of two), heads, dtypes, strided q / k, and the VisionZip ranking they give; pass 2 alone
from a given log-sum-exp (`received_attention_from_lse`: the reference's, and that of SDPA's flash backend), and
launch configs passed in (the tuning sweep's).

On CUDA; on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, small sizes only), which the ``triton``
marker lets run on a machine without a GPU (tests/conftest.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import TRITON_MARKS  # noqa: E402
from hf_raincheck.pruning.hiprune import ranking  # noqa: E402
from hf_raincheck.triton_support import triton_enabled  # noqa: E402
from hf_raincheck.pruning.vision import pool_merged, received_attention, received_attention_torch  # noqa: E402

pytestmark = TRITON_MARKS

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


# ------------------------------------------------------------------------------------------ pass 2 from a given LSE
def torch_lse(q, k, cu, scale):
    """``[heads, P]`` fp32 natural-log LSE of each query over its segment's keys (rows outside segments: 0)."""
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for a, b in zip(cu[:-1], cu[1:]):
        logits = torch.einsum("qhd,khd->hqk", q[a:b].float(), k[a:b].float()) * scale
        lse[:, a:b] = torch.logsumexp(logits, dim=-1)
    return lse


def flash_lse(q, k, cu, scale):
    """The same from SDPA's flash backend, one call per segment as the ViT's attention makes them (the LSE the
    hooks take from the ViT): CUDA with 16-bit q / k, the CPU with fp32."""
    from hf_raincheck.pruning.vision import SDPACall, flash_attention_with_lse

    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for a, b in zip(cu[:-1], cu[1:]):
        qs, ks = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k))  # [1, heads, n, d]
        got = flash_attention_with_lse(SDPACall(qs, ks, ks, scale=scale))
        assert got is not None, "SDPA would not run its flash backend here"
        lse[:, a:b] = got[1][0]
    return lse


@pytest.fixture(scope="module")
def from_lse(device):
    from hf_raincheck.pruning.attention_triton import received_attention_from_lse

    return received_attention_from_lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("segments", list(SEGMENTS))
@pytest.mark.parametrize("heads,head_dim", [(1, 72), (4, 72), (2, 16)])
def test_from_lse_matches_torch(from_lse, device, dtype, segments, heads, head_dim):
    cu = SEGMENTS[segments]
    q, k = make_qk(cu[-1] + 7, heads, head_dim, dtype, device, seed=heads * 100 + head_dim)
    scale = head_dim**-0.5
    got = from_lse(q, k, torch_lse(q, k, cu, scale), cu, scale)
    want = received_attention_torch(q.float(), k.float(), cu, scale)
    torch.testing.assert_close(got, want, rtol=TOLERANCES[dtype][0], atol=TOLERANCES[dtype][1])
    assert torch.all(got[cu[-1] :] == 0)


@pytest.mark.parametrize("case", ["small", "image", "video"])
def test_from_flash_lse_matches_torch(from_lse, device, case):
    """With the LSE of SDPA's flash backend (bf16 on CUDA, fp32 on the CPU); on CUDA also at Qwen3-VL's ViT sizes."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if case != "small" and device.type != "cuda":
        pytest.skip("large sizes: CUDA only")
    frames, patches, heads = {"small": (3, 70, 2), "image": (1, 16384, 16), "video": (16, 1024, 16)}[case]
    q, k = make_qk(frames * patches, heads, 72, dtype, device, seed=11, sharpness=1.0)
    cu = [i * patches for i in range(frames + 1)]
    scale = 72**-0.5
    got = from_lse(q, k, flash_lse(q, k, cu, scale), torch.tensor(cu, device=device), scale)
    want = received_attention_torch(q.float(), k.float(), cu, scale)
    torch.testing.assert_close(got, want, rtol=TOLERANCES[dtype][0], atol=TOLERANCES[dtype][1])


def test_from_lse_checks_its_inputs(from_lse, device):
    q, k = make_qk(50, 2, 16, torch.float32, device)
    with pytest.raises(ValueError, match="lse must be"):
        from_lse(q, k, torch.zeros(50, 2, device=device), [0, 50], 0.25)
    assert from_lse(q[:0], k[:0], torch.zeros(2, 0, device=device), [0], 0.25).shape == (0,)


# ------------------------------------------------------------------------------------------ launch configs
def test_configs_can_be_passed_in(kernel, device):
    """Other launch configs (as the tuning sweep passes them) give the same sums; bad ones are refused."""
    from hf_raincheck.pruning.attention_triton import CONFIGS

    cu = SEGMENTS["several"]
    for dtype in (torch.float32, torch.bfloat16):
        q, k = make_qk(cu[-1], 1, 72, dtype, device, seed=4)
        default = kernel(q, k, cu, 0.1)
        for configs in ({"lse": (32, 64, 4, 1)}, {"received": (64, 32, 2, 2)}, {"lse": (128, 32, 8, 4)}):
            torch.testing.assert_close(kernel(q, k, cu, 0.1, configs=configs), default, rtol=1e-5, atol=1e-6)
    before = dict(CONFIGS)
    for bad, match in (({"pass1": (32, 32, 4, 2)}, "keyed by pass"), ({"lse": (8, 32, 4, 2)}, "powers of two"),
                       ({"received": (48, 32, 4, 2)}, "powers of two"), ({"lse": (32, 32)}, "a config is")):
        with pytest.raises(ValueError, match=match):
            kernel(q, k, cu, 0.1, configs=bad)
    assert CONFIGS == before


def test_tuning_sweep_smoke(device, tmp_path, capsys):
    """``benchmarks/received_attention.py --small`` (two configs per pass) writes its table and JSON."""
    import importlib.util
    import json
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "benchmarks", "received_attention.py")
    spec = importlib.util.spec_from_file_location("received_attention_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    out = tmp_path / "sweep.json"
    sweep.main(["--small", "--device", device.type, "--cases", "image", "--repeats", "1", "--warmup", "0",
                "--out", str(out)])
    report = json.loads(out.read_text())
    assert len(report["records"]) == 4 and all(r["error"] is None and r["ok"] for r in report["records"])
    assert set(report["best"]) == {"lse", "received"}
    assert "| # | BLOCK_M | BLOCK_N | warps | stages | image ms |" in capsys.readouterr().out
