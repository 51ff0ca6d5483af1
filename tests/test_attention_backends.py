"""Attention backends against the naive reference on random inputs: SDPA (dense mask, bottom-right causal) and
the grouped few-rows path that fused steps take."""

from __future__ import annotations

import os

import pytest
import torch

from hf_raincheck.attention import naive_attention, naive_masked_softmax, sdpa, sdpa_attention
from hf_raincheck.conversation import output_cache


def _inputs(q, k, hq, hkv, d=16, batch=1, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, hq, q, d, generator=gen).to(dtype)
    key = torch.randn(batch, hkv, k, d, generator=gen).to(dtype)
    value = torch.randn(batch, hkv, k, d, generator=gen).to(dtype)
    visible = torch.rand(batch, 1, q, k, generator=gen) < 0.6
    return query, key, value, visible


@pytest.mark.parametrize("q,k,hq,hkv,batch", [(2, 9, 4, 4, 1), (8, 40, 4, 2, 1), (32, 100, 8, 2, 2), (5, 7, 6, 1, 1),
                                              (1, 9, 4, 4, 1), (1, 40, 8, 2, 2)])
def test_grouped_equals_naive(q, k, hq, hkv, batch):
    query, key, value, visible = _inputs(q, k, hq, hkv, batch=batch)
    visible[0, 0, 0] = False  # a row that sees nothing: zeros, as the reference
    ref = naive_attention(query, key, value, visible, 0.3)
    out = sdpa.grouped_attention(query, key, value, visible, 0.3)
    assert out.shape == ref.shape == (batch, q, hq, query.shape[-1])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))


def test_grouped_shared_mask_broadcasts_over_the_batch():
    query, key, value, visible = _inputs(6, 30, 4, 2, batch=3)
    shared = visible[:1]
    torch.testing.assert_close(sdpa.grouped_attention(query, key, value, shared, 0.25),
                               naive_attention(query, key, value, shared, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 31, 64, 65, 130])
@pytest.mark.parametrize("limit", [0, 64])
def test_sdpa_routes_few_rows_to_the_grouped_path_and_agrees(monkeypatch, rows, limit):
    """2 to GROUPED_MAX_ROWS masked rows take the grouped path (or the split-keys kernel where it runs:
    tests/test_split_keys_triton.py), others SDPA; all equal the reference."""
    monkeypatch.setattr(sdpa, "GROUPED_MAX_ROWS", limit)
    calls = []
    original = sdpa.grouped_attention
    monkeypatch.setattr(sdpa, "grouped_attention", lambda *a: calls.append(1) or original(*a))
    if sdpa._split_keys is not None:  # under Triton's interpreter the split-keys kernel takes these rows instead
        kernel = sdpa._split_keys
        monkeypatch.setattr(sdpa, "_split_keys", lambda *a: calls.append(1) or kernel(*a))
    query, key, value, visible = _inputs(rows, 200, 8, 2, seed=rows)
    visible[..., :1] = True  # every row sees a key (SDPA's fully masked rows are not part of the contract here)
    out = sdpa_attention(query, key, value, visible, 0.2)
    torch.testing.assert_close(out, naive_attention(query, key, value, visible, 0.2), atol=2e-5, rtol=1e-4)
    assert bool(calls) == (1 < rows <= limit)


def test_bottom_right_causal_ignores_the_grouped_path():
    query, key, value, _ = _inputs(8, 20, 4, 2)
    out = sdpa_attention(query, key, value, None, 0.3, causal_lower_right=True)
    torch.testing.assert_close(out, naive_attention(query, key, value, None, 0.3, causal_lower_right=True),
                               atol=2e-5, rtol=1e-4)


def test_grouped_bf16_is_close_to_the_fp32_reference():
    query, key, value, visible = _inputs(32, 300, 8, 2, d=64, seed=3)
    visible[..., :1] = True
    ref = naive_attention(query, key, value, visible, 0.125)
    out = sdpa.grouped_attention(query.bfloat16(), key.bfloat16(), value.bfloat16(), visible, 0.125)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_grouped_softmax_masks_in_the_scores_dtype_with_the_fp32_values(dtype):
    """`grouped_softmax_torch` hides keys in the scores' own dtype and normalises in one softmax kernel that computes
    in fp32 and writes the scores' dtype (fewer operators in host-bound eager steps): bit for bit the values of
    upcasting first, masking and normalising in fp32 and casting back, rows that see nothing included (zeros)."""
    g = torch.Generator().manual_seed(5)
    scores = (torch.randn(2, 2, 3, 5, 40, generator=g) * 8).to(dtype)
    visible = torch.rand(2, 1, 5, 40, generator=g) < 0.6
    visible[1, 0, 2] = False  # a row that sees nothing
    want = torch.softmax(scores.float().masked_fill(~visible.unsqueeze(2), float("-inf")), dim=-1)
    want = want.nan_to_num(0.0).to(dtype).view(2, 2, 15, 40)
    got = sdpa.grouped_softmax_torch(scores, visible, dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    assert not got.view(2, 2, 3, 5, 40)[1, :, :, 2].any()


def test_grouped_scales_transposed_rows_as_contiguous_ones():
    """Rows straight from a transpose (transformers' ``[B, q, H, D] -> [B, H, q, D]``) are scaled into the stacked
    layout in one operator: the same values bit for bit as from contiguous rows."""
    query, key, value, visible = _inputs(5, 30, 8, 2, d=16, seed=4, dtype=torch.bfloat16)
    transposed = query.transpose(1, 2).contiguous().transpose(1, 2)
    assert not transposed.is_contiguous()
    assert torch.equal(sdpa.grouped_attention(transposed, key, value, visible, 0.3),
                       sdpa.grouped_attention(query, key, value, visible, 0.3))


def test_one_eager_row_takes_the_scale_into_its_product(monkeypatch):
    """One row (a decode step while deferred slots are pending: every attention layer of an eager step) from a
    transpose, as transformers makes it: the stacked rows are a view, the scale rides the scores' product (``baddbmm``
    alpha) and the softmax writes the scores' dtype, so the path runs five kernel operators (as
    `benchmarks/step_ops.py` counts them: product, mask, softmax, NaN guard, product) where it ran eight (scale,
    product, mask, upcast, softmax, NaN guard, downcast, product); the values equal the reference within bf16
    rounding."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from step_ops import _kernel_events

    query, key, value, visible = _inputs(1, 300, 8, 2, d=64, batch=2, seed=6)
    query = query.transpose(1, 2).contiguous().transpose(1, 2).bfloat16()  # [B, 1, H, D] -> [B, H, 1, D]
    key, value = key.bfloat16(), value.bfloat16()
    visible[..., :1] = True
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = sdpa.grouped_attention(query, key, value, visible, 0.125)
    kernels = [e.name for e in _kernel_events(prof.events())]
    assert kernels == ["aten::baddbmm", "aten::where", "aten::_softmax", "aten::nan_to_num", "aten::bmm"], kernels
    ref = naive_attention(query.float(), key.float(), value.float(), visible, 0.125)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_grouped_takes_an_expanded_mask():
    """A mask broadcast with `expand` (no copy) works as a dense one (no `view` on non-contiguous strides)."""
    query, key, value, visible = _inputs(4, 12, 4, 2, batch=2)
    expanded = visible[:1, :, :1].expand(2, 1, 4, 12)
    assert not expanded.is_contiguous()
    torch.testing.assert_close(sdpa.grouped_attention(query, key, value, expanded, 0.3),
                               naive_attention(query, key, value, expanded, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_torch_softmax_equals_the_plain_reference(dtype):
    """The grouped path's torch softmax (the reference of the Triton kernel) against the row-by-row float64
    reference: masked keys at 0, a row that sees nothing all zeros, one mask shared by a KV head's query heads and
    broadcast over the batch."""
    gen = torch.Generator().manual_seed(7)
    scores = (4 * torch.randn(2, 2, 3, 4, 37, generator=gen)).to(dtype)
    for mask_batch in (1, 2):
        visible = torch.rand(mask_batch, 1, 4, 37, generator=gen) < 0.6
        visible[0, 0, 1] = False
        for out_dtype in (torch.float32, torch.bfloat16):
            got = sdpa.grouped_softmax_torch(scores, visible, out_dtype)
            want = naive_masked_softmax(scores, visible, out_dtype)
            assert got.dtype == want.dtype == out_dtype and got.shape == (2, 2, 12, 37)
            tol = dict(atol=1e-6, rtol=1e-5) if out_dtype == torch.float32 else {}
            torch.testing.assert_close(got, want, **tol)
            assert not got.view(2, 2, 3, 4, 37)[0, :, :, 1].any()


def test_short_eager_forwards_on_cuda_leave_cudnn_out():
    """`eager_sdpa_backends`: on CUDA, forwards of a few rows run SDPA without cuDNN (a plan built per new key
    length); the other backends keep their flags; nested or concurrent forwards keep it off until the last leaves,
    then the user's setting comes back (also when it was off); long forwards and other devices change nothing."""
    flags = torch.backends.cuda
    cuda = torch.device("cuda")
    others = (flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled(), flags.math_sdp_enabled())
    assert flags.cudnn_sdp_enabled()
    with sdpa.eager_sdpa_backends(cuda, 1):
        assert not flags.cudnn_sdp_enabled()
        assert (flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled(), flags.math_sdp_enabled()) == others
        with sdpa.eager_sdpa_backends(cuda, sdpa.SHAPE_CHANGING_ROWS):  # another forward (a background completion)
            assert not flags.cudnn_sdp_enabled()
        assert not flags.cudnn_sdp_enabled()  # still inside the first
    assert flags.cudnn_sdp_enabled()
    for device, rows in (("cpu", 1), ("cuda", sdpa.SHAPE_CHANGING_ROWS + 1)):
        with sdpa.eager_sdpa_backends(torch.device(device), rows):
            assert flags.cudnn_sdp_enabled()
    flags.enable_cudnn_sdp(False)  # the user's own setting
    try:
        with sdpa.eager_sdpa_backends(cuda, 1):
            assert not flags.cudnn_sdp_enabled()
        assert not flags.cudnn_sdp_enabled()
    finally:
        flags.enable_cudnn_sdp(True)


def test_every_eager_forward_sets_its_attention_backends(monkeypatch):
    """`run_rows` enters `eager_sdpa_backends` once per forward, with the forward's row count (prefill, decode-only
    and fused steps)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from handmade import _conv, _tiny_model
    from helpers import generate

    from hf_raincheck import RaincheckConfig, enable_raincheck
    from hf_raincheck.generation import rows as rows_module

    seen = []
    original = rows_module.eager_sdpa_backends

    def recorded(device, rows):
        seen.append(rows)
        return original(device, rows)

    monkeypatch.setattr(rows_module, "eager_sdpa_backends", recorded)
    model = enable_raincheck(_tiny_model("eager"))
    inputs = _conv([(1, 8, 8)], [3, 2, 4])
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking")
    out = generate(model, inputs, 10, cfg)
    deferred = output_cache(out).turn_stats[0].deferred
    assert deferred == 11
    # the prefill (the kept prompt tokens), two guard steps, fused steps carrying 5, 5 and 1 deferred rows, the rest
    assert seen == [inputs["input_ids"].shape[1] - deferred, 1, 1, 6, 6, 2, 1, 1, 1, 1]


def test_one_masked_row_of_an_eager_short_forward_takes_the_grouped_path(monkeypatch):
    """Inside an eager short forward (cuDNN off), one row under a mask (a decode step while deferred slots are
    pending) goes to the grouped path, not to SDPA (whose masked GQA fallback repeats K and V per query head);
    outside it, and without a mask, one row stays on SDPA. Same values as the reference either way."""
    from hf_raincheck.attention import naive_attention

    calls = []
    original = sdpa.grouped_attention
    monkeypatch.setattr(sdpa, "grouped_attention", lambda *a: calls.append(1) or original(*a))
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(1, 8, 1, 16, generator=gen)
    key = torch.randn(1, 2, 30, 16, generator=gen)
    value = torch.randn(1, 2, 30, 16, generator=gen)
    visible = torch.rand(1, 1, 1, 30, generator=gen) < 0.6
    want = naive_attention(query, key, value, visible, 0.25)
    torch.testing.assert_close(sdpa.sdpa_attention(query, key, value, visible, 0.25), want, atol=1e-5, rtol=1e-5)
    assert calls == []
    with sdpa._EAGER_SHORT:
        torch.testing.assert_close(sdpa.sdpa_attention(query, key, value, visible, 0.25), want, atol=1e-5, rtol=1e-5)
        assert calls == [1]
        sdpa.sdpa_attention(query, key, value, None, 0.25)  # no mask: SDPA
        assert calls == [1]
