"""``attn_backend="flash"``: the gather layout and row-block split (attention/flash.py) on the naive reference of the
kernel contract (`naive_flash_kernel`), against the dense-mask reference; end to end against ``"eager"`` on tiny
models (dynamic and compiled static caches, both visibilities, later turns); the real kernels in a gpu test."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
from transformers.generation.configuration_utils import CompileConfig

sys.path.insert(0, os.path.dirname(__file__))

from handmade import _conv, _extend, _tiny_model, _video_conv  # noqa: E402
from helpers import generate, new_tokens  # noqa: E402

from hf_raincheck import RaincheckConfig, enable_raincheck  # noqa: E402
from hf_raincheck.attention import flash, naive_attention  # noqa: E402
from hf_raincheck.attention.naive import naive_flash_kernel  # noqa: E402
from hf_raincheck.conversation import output_cache  # noqa: E402
from hf_raincheck.generation.visibility import visible  # noqa: E402

TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture
def naive_kernel(monkeypatch):
    """The flash backend on the reference kernel (no flash_attn on the CPU)."""
    monkeypatch.setattr(flash, "_KERNEL", naive_flash_kernel)


def test_naive_kernel_is_bottom_right_causal_over_the_used_keys():
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 3, 4, 8, generator=gen), torch.randn(2, 9, 2, 8, generator=gen), torch.randn(2, 9, 2, 8, generator=gen)
    out = naive_flash_kernel(q, k, v, torch.tensor([5, 9], dtype=torch.int32), 0.4)
    for b, used in enumerate([5, 9]):
        mask = torch.ones(3, used, dtype=torch.bool).tril(used - 3)[None, None]
        ref = naive_attention(q[b:b + 1].transpose(1, 2), k[b:b + 1, :used].transpose(1, 2),
                              v[b:b + 1, :used].transpose(1, 2), mask, 0.4)
        torch.testing.assert_close(out[b:b + 1], ref, **TOL)
    torch.testing.assert_close(naive_flash_kernel(q, k, v, None, 0.4),
                               naive_flash_kernel(q, k, v, torch.tensor([9, 9], dtype=torch.int32), 0.4))


def _layout(seed, visibility, padding):
    """A random forward: cached slots with holes, a chunk of restored rows (maybe padded), live rows after."""
    gen = torch.Generator().manual_seed(seed)
    width, boundary = 48, 30
    filled = torch.zeros(width, dtype=torch.bool)
    filled[:36] = torch.rand(36, generator=gen) < 0.6  # holes: deferred slots still pending, dropped ones
    pending = (~filled[:boundary]).nonzero().flatten()
    chunk = pending[torch.randperm(len(pending), generator=gen)[:5]].sort().values  # restored rows, slot order
    deferred_slots = torch.zeros(width, dtype=torch.bool)
    deferred_slots[pending] = True
    live = torch.tensor([36, 37, 39])  # live rows after every cached slot (a hole at 38: a new turn's deferral)
    rows, valid = chunk, torch.ones(len(chunk), dtype=torch.bool)
    if padding:  # a compiled step's last chunk, padded with rows at scratch slots
        rows = torch.cat([chunk, torch.tensor([45, 46])])
        valid = torch.cat([valid, torch.zeros(2, dtype=torch.bool)])
    slots = torch.cat([rows, live])
    flags = torch.cat([valid, torch.zeros(len(live), dtype=torch.bool)])
    present = filled.clone().index_fill_(0, slots, True)
    dense = visible(present, slots, flags, boundary, deferred_slots, visibility)[None, None]
    return filled, slots, len(rows), valid if padding else None, boundary, dense, len(chunk)


@pytest.mark.parametrize("visibility", ["boundary", "causal"])
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_flash_layout_equals_the_dense_mask(naive_kernel, visibility, padding, seed):
    filled, slots, n_def, valid, boundary, dense, n_real = _layout(seed, visibility, padding)
    mask = flash.flash_mask(dense, filled, slots, n_def, valid, boundary, visibility)
    assert (mask.deferred_index is None) == (visibility == "causal")
    gen = torch.Generator().manual_seed(100 + seed)
    q, width = len(slots), filled.shape[0]
    query = torch.randn(1, 4, q, 8, generator=gen)
    key, value = torch.randn(1, 2, width, 8, generator=gen), torch.randn(1, 2, width, 8, generator=gen)
    out = flash.flash_attention(query, key, value, mask, 0.35)
    ref = naive_attention(query, key, value, dense, 0.35)
    real = torch.cat([torch.arange(n_real), torch.arange(n_def, q)])  # padding rows' outputs are never read
    torch.testing.assert_close(out[:, real], ref[:, real], **TOL)


def test_flash_without_flash_attn_says_what_to_install(monkeypatch):
    monkeypatch.setattr(flash, "_KERNEL", None)
    monkeypatch.setattr(flash, "_find_kernel", lambda: None)
    model = enable_raincheck(_tiny_model("eager"))
    with pytest.raises(ValueError, match="attn_backend='flash' needs the flash_attn package"):
        generate(model, _conv([(1, 8, 8)], [3, 2]), 2, RaincheckConfig(attn_backend="flash", pruning="uniform"))


@pytest.fixture(scope="module")
def vl():
    return enable_raincheck(_tiny_model("eager"))


@pytest.fixture(scope="module")
def hybrid():
    from handmade_qwen3_5 import tiny_qwen3_5

    return enable_raincheck(tiny_qwen3_5("eager"))


CONFIGS = {
    "blocking": RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking"),
    "causal": RaincheckConfig(retention=0.3, chunk_size=4, guard_tokens=1, pruning="uniform", completion="blocking",
                              visibility="causal"),
    "next_turn": RaincheckConfig(retention=0.5, chunk_size=3, guard_tokens=0, pruning="uniform",
                                 completion="next_turn"),
    "hard": RaincheckConfig(policy="hard", retention=0.3, pruning="uniform"),
    "full": RaincheckConfig(policy="full"),
}


def _compile_config():
    config = CompileConfig(backend="eager", fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    return config


# every config on Qwen3-VL; Qwen3.5 (whose GDN layers do not use the attention backend) with the two Raincheck ones
CASES = [("qwen3_vl", name) for name in CONFIGS] + [("qwen3_5", "blocking"), ("qwen3_5", "next_turn")]


@pytest.mark.parametrize("family,name", CASES, ids=[f"{f}-{n}" for f, n in CASES])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_flash_backend_equals_eager_end_to_end(naive_kernel, vl, hybrid, name, family, static):
    model = vl if family == "qwen3_vl" else hybrid
    cfg = CONFIGS[name]
    kw = dict(cache_implementation="static", compile_config=_compile_config()) if static else {}
    torch._dynamo.reset()
    inputs = _video_conv() if name == "next_turn" and family == "qwen3_vl" else _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4])
    eager = generate(model, inputs, 10, dataclasses.replace(cfg, attn_backend="eager"))
    fast = generate(model, inputs, 10, dataclasses.replace(cfg, attn_backend="flash"), **kw)
    assert new_tokens(fast, inputs) == new_tokens(eager, inputs)
    torch.testing.assert_close(torch.stack(fast.logits), torch.stack(eager.logits), **TOL)
    a, b = output_cache(fast), output_cache(eager)
    assert a.stats == b.stats and a.pending == b.pending
    # a later turn (what is still pending folds into its prefill) on either cache
    nxt = _extend(_extend(inputs, new_tokens(eager, inputs)), [7, 8, 9])
    eager2 = generate(model, nxt, 4, dataclasses.replace(cfg, attn_backend="eager"), past=b)
    fast2 = generate(model, nxt, 4, dataclasses.replace(cfg, attn_backend="flash"), past=a, **kw)
    torch.testing.assert_close(torch.stack(fast2.logits), torch.stack(eager2.logits), **TOL)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_flash_kernels_equal_sdpa_on_cuda():
    """flash_attn installed (flash-attn 2/3 or 4 on the H200): its kernel meets the reference contract, and
    Raincheck with attn_backend='flash' gives SDPA's tokens on a tiny bf16 model."""
    if not flash.available():
        pytest.skip("flash_attn is not installed")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 5, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, 300, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, 300, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    used = torch.tensor([211], dtype=torch.int32, device="cuda")
    torch.testing.assert_close(flash.kernel()(q, k, v, used, 0.1).float(),
                               naive_flash_kernel(q, k, v, used, 0.1).float(), atol=2e-2, rtol=2e-2)
    model = enable_raincheck(_tiny_model("eager").cuda().to(torch.bfloat16))
    inputs = {k: v.cuda() for k, v in _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4]).items()}
    cfg = CONFIGS["blocking"]
    ref = generate(model, inputs, 12, dataclasses.replace(cfg, attn_backend="sdpa"))
    out = generate(model, inputs, 12, dataclasses.replace(cfg, attn_backend="flash"))
    assert new_tokens(out, inputs) == new_tokens(ref, inputs)


def test_flash_kernels_refuse_float32_with_a_clear_error(monkeypatch):
    """The real kernels take half precision: a float32 model gets a ValueError naming the option (the wrappers
    check before calling flash_attn, here a stand-in module)."""
    import types

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_with_kvcache = lambda *a, **k: pytest.fail("called with float32")
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    flash._find_kernel.cache_clear()
    try:
        found = flash._find_kernel()
        q = torch.zeros(1, 2, 4, 8)
        with pytest.raises(ValueError, match="attn_backend='flash'.*float16 or bfloat16"):
            found(q, q, q, None, 0.3)
    finally:
        flash._find_kernel.cache_clear()
