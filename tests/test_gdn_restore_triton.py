"""The fused GDN restoration kernel (`hf_raincheck.gdn_state.restore_triton`) against the plain reference.

GPU tests (CI deselects them); they also run on the CPU under Triton's interpreter:
``TRITON_INTERPRET=1 python -m pytest -m triton tests/test_gdn_restore_triton.py``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import TRITON_MARKS  # noqa: E402

from hf_raincheck.gdn_state.naive import naive_gated_delta, naive_join  # noqa: E402

pytestmark = TRITON_MARKS


@pytest.fixture(scope="module")
def device(triton_device) -> torch.device:
    return triton_device


def restore_chunk(*args):
    from hf_raincheck.gdn_state.restore_triton import restore_chunk as kernel  # needs Triton

    return kernel(*args)


def _rows(t, hk, hv, dk, dv, dtype, seed, padding=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, hk, dk, generator=gen)
    k = torch.randn(1, t, hk, dk, generator=gen)
    v = torch.randn(1, t, hv, dv, generator=gen)
    g = -torch.rand(1, t, hv, generator=gen) * 0.5
    beta = torch.rand(1, t, hv, generator=gen)
    if padding:  # the last rows are padding: the identity on the state
        g[:, t - padding:] = 0
        beta[:, t - padding:] = 0
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)


@pytest.mark.parametrize("t, padding", [(1, 0), (5, 0), (7, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restore_chunk_equals_the_reference(device, t, padding, dtype):
    """Outputs, the new prefix state and the joined live state equal the plain reference (fp64) of the rows from
    the prefix state followed by ``S_live + P (S_new - S_old)``; P's columns of the live state stay as they were."""
    hk, hv, dk, dv = 2, 4, 16, 32
    q, k, v, g, beta = _rows(t, hk, hv, dk, dv, dtype, seed=t + padding, padding=padding)
    gen = torch.Generator().manual_seed(99)
    prefix = torch.randn(1, hv, dk, dv, generator=gen)
    live_s = torch.randn(1, hv, dk, dv, generator=gen)
    transition = torch.randn(1, hv, dk, dk, generator=gen) * 0.3
    live = torch.cat([live_s, transition], dim=-1)
    want_out, want_prefix = naive_gated_delta(q, k, v, g, beta, prefix)
    want_live = naive_join(live_s.double(), transition.double(), prefix.double(), want_prefix)
    if padding:  # padding rows change nothing: the same as the real rows alone
        _, real_prefix = naive_gated_delta(q[:, :t - padding], k[:, :t - padding], v[:, :t - padding],
                                           g[:, :t - padding], beta[:, :t - padding], prefix)
        torch.testing.assert_close(want_prefix, real_prefix)
    prefix_d, live_d = prefix.to(device), live.to(device)
    out = restore_chunk(*(x.to(device) for x in (q, k, v, g, beta)), prefix_d, live_d)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    assert out.dtype == dtype and out.shape == (1, t, hv, dv)
    torch.testing.assert_close(out.cpu().double(), want_out, **tol)
    torch.testing.assert_close(prefix_d.cpu().double(), want_prefix, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(live_d[..., :dv].cpu().double(), want_live, atol=1e-4, rtol=1e-4)
    assert torch.equal(live_d[..., dv:].cpu(), transition)


def test_restore_chunk_names_what_it_cannot_take(device):
    q, k, v, g, beta = _rows(3, 2, 4, 16, 24, torch.float32, seed=0)
    with pytest.raises(ValueError, match="powers of two"):
        restore_chunk(q, k, v, g, beta, torch.zeros(1, 4, 16, 24), torch.zeros(1, 4, 16, 40))
    q, k, v, g, beta = _rows(3, 2, 4, 16, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="prefix must be"):
        restore_chunk(q, k, v, g, beta, torch.zeros(1, 4, 16, 16), torch.zeros(1, 4, 16, 16))


def test_compiled_fused_steps_with_the_kernel_equal_eager(device, monkeypatch):
    """``HF_RAINCHECK_GDN_RESTORE_KERNEL=triton``: a tiny Qwen3.5's compiled fused steps restore through the kernel
    (every fused step calls it once per GDN layer) and give eager's logits, tokens and GDN states, the last chunk
    a partial one (its padding rows are the identity)."""
    from test_compiled_steps import TOL, run, two_images

    import hf_raincheck.gdn_state.kernels as kernels
    from hf_raincheck import RaincheckConfig, enable_raincheck
    from hf_raincheck.gdn_state import restore_triton
    from handmade_qwen3_5 import tiny_qwen3_5
    from helpers import new_tokens

    launches = []

    class Counted:  # the kernel, its launches counted
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    kernel = restore_triton._restore_chunk_kernel
    monkeypatch.setattr(restore_triton, "_restore_chunk_kernel", Counted())
    monkeypatch.setattr(kernels, "RESTORE_KERNEL", True)
    from hf_raincheck.attention import sdpa

    # (the grouped softmax's triton_op cannot be traced under the interpreter: the attention layers take torch's)
    monkeypatch.setattr(sdpa, "_SOFTMAX_KERNEL_ON_CPU", False)
    torch._dynamo.reset()
    model = enable_raincheck(tiny_qwen3_5("eager").to(device))
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking")
    inputs = {k: v.to(device) for k, v in two_images().items()}
    eager = run(model, inputs, 10, cfg, static=False)
    assert launches == []  # eager steps keep their own path
    compiled = run(model, inputs, 10, cfg)
    restored = compiled.past_key_values.turn_stats[-1].restored_during_decode
    fused_steps = -(-restored // cfg.chunk_size)  # full chunks, then the last partial one
    gdn_layers = len(model._raincheck_state.adapter.gdn_modules())
    assert fused_steps >= 2 and len(launches) == fused_steps * gdn_layers
    assert new_tokens(compiled, inputs) == new_tokens(eager, inputs)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), **TOL)
    for i, state in eager.past_key_values.gdn_states.items():
        torch.testing.assert_close(compiled.past_key_values.gdn_states[i].recurrent, state.recurrent, **TOL)
    torch._dynamo.reset()
