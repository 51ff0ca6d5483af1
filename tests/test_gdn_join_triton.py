"""The fused step's GDN join kernel (`hf_raincheck.gdn_state.join_triton`) against the float64 reference
(`naive.naive_join`) and the torch path it replaces (`ops.join_` and a copy).

GPU tests (CI deselects them); they also run on the CPU under Triton's interpreter:
``TRITON_INTERPRET=1 python -m pytest -m triton tests/test_gdn_join_triton.py``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import TRITON_MARKS  # noqa: E402

from hf_raincheck.gdn_state import ops  # noqa: E402
from hf_raincheck.gdn_state.naive import naive_join  # noqa: E402

pytestmark = TRITON_MARKS


@pytest.fixture(scope="module")
def device(triton_device) -> torch.device:
    return triton_device


def _case(batch, heads, key_dim, value_dim, device, seed, state_layout="contiguous"):
    gen = torch.Generator().manual_seed(seed)
    if state_layout == "heads_first":  # a [B, H_v, ...] view of a [H_v, B, ...] buffer: other strides
        state = torch.randn(heads, batch, key_dim, value_dim + key_dim, generator=gen).transpose(0, 1)
    else:
        state = torch.randn(batch, heads, key_dim, value_dim + key_dim, generator=gen)
    old = torch.randn(batch, heads, key_dim, value_dim, generator=gen)
    new = old + torch.randn(batch, heads, key_dim, value_dim, generator=gen)
    return state.to(device), old.to(device), new.to(device)


def _reference(state, old, new):
    value_dim = old.shape[-1]
    return naive_join(state[..., :value_dim].double(), state[..., value_dim:].double(), old.double(), new.double())


def _tolerance(key_dim):
    # fp32 accumulation of key_dim products of unit-scale entries (plain TF32 misses it by ~100x: see below)
    return dict(atol=2e-6 * key_dim, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 2, 16, 16), (2, 3, 32, 64), (3, 2, 24, 40), (1, 4, 128, 128),
                                   (2, 1, 64, 200)])
@pytest.mark.parametrize("layout", ["contiguous", "heads_first"])
def test_join_prefix_equals_the_reference(device, shape, layout):
    """``S += P_tail (new - old)`` within fp32 accuracy; ``old`` becomes ``new`` bit for bit; P_tail untouched."""
    from hf_raincheck.gdn_state.join_triton import join_prefix_

    batch, heads, key_dim, value_dim = shape
    if device.type == "cpu" and key_dim * value_dim > 64 * 64 and layout != "contiguous":
        pytest.skip("large head dims: slow under the interpreter (the contiguous case covers them)")
    state, old, new = _case(*shape, device, seed=sum(shape), state_layout=layout)
    want = _reference(state, old, new)
    tail = state[..., value_dim:].clone()
    join_prefix_(state, old, new)
    torch.testing.assert_close(state[..., :value_dim].double(), want, **_tolerance(key_dim))
    assert torch.equal(old, new)
    assert torch.equal(state[..., value_dim:], tail)


def test_join_prefix_writes_only_its_buffers(device):
    """Views of larger buffers: only the viewed rows change (the strides are the views' own)."""
    from hf_raincheck.gdn_state.join_triton import join_prefix_

    state_buffer, old_buffer, new = _case(3, 2, 16, 32, device, seed=7)
    state_before, old_before = state_buffer.clone(), old_buffer.clone()
    state, old = state_buffer[1:2], old_buffer[1:2]
    want = _reference(state, old, new[1:2])
    join_prefix_(state, old, new[1:2])
    torch.testing.assert_close(state[..., :32].double(), want, **_tolerance(16))
    for buffer, before in ((state_buffer, state_before), (old_buffer, old_before)):
        assert torch.equal(buffer[0], before[0]) and torch.equal(buffer[2], before[2])


def test_ops_join_prefix_takes_the_kernel_and_equals_the_torch_path(device, monkeypatch):
    """`ops.join_prefix_` runs the kernel where Triton runs; the torch path (`join_` on the difference, a copy)
    gives the same values."""
    assert ops._join_prefix_kernel is not None  # Triton imports here: ops took the kernel at import
    calls = []
    original = ops._join_prefix_kernel
    monkeypatch.setattr(ops, "_join_prefix_kernel", lambda *a: calls.append(1) or original(*a))
    state, old, new = _case(2, 2, 32, 32, device, seed=3)
    by_torch = [t.clone() for t in (state, old)]
    ops.join_prefix_(state, old, new)
    assert calls == [1]
    monkeypatch.setattr(ops, "_join_prefix_kernel", None)
    ops.join_prefix_(*by_torch, new)
    assert calls == [1]
    torch.testing.assert_close(state, by_torch[0], **_tolerance(32))
    assert torch.equal(old, by_torch[1])


def test_plain_tf32_would_fail_the_tolerance(device):
    """The tolerance above tells fp32 from TF32: the kernel's product with plain TF32 inputs (a 10-bit mantissa)
    misses it, so the default's three-product TF32 (or fp32) is what passes."""
    if device.type != "cuda":
        pytest.skip("the interpreter computes the product in fp32 whatever the precision")
    from hf_raincheck.gdn_state.join_triton import launch_join_prefix

    state, old, new = _case(2, 4, 128, 128, device, seed=11)
    want = _reference(state, old, new)
    plain = state.clone()
    launch_join_prefix(plain, old.clone(), new, precision="tf32")
    with pytest.raises(AssertionError):
        torch.testing.assert_close(plain[..., :128].double(), want, **_tolerance(128))


def test_join_prefix_compiles_in_place(device):
    """Traced inside an Inductor-compiled function (fullgraph), the op mutates its buffers as it does eagerly, and
    in place: the compiled code copies neither buffer (an opaque op's declared mutation of graph inputs is kept in
    place; a copy of the ``[S | P_tail]`` state would cost a pass over it per GDN layer)."""
    from torch._inductor.utils import run_and_get_code

    batch, heads, dim = (4, 8, 128) if device.type == "cuda" else (2, 2, 16)
    state, old, new = _case(batch, heads, dim, dim, device, seed=5)
    eager = [t.clone() for t in (state, old)]
    ops.join_prefix_(*eager, new)

    @torch.compile(fullgraph=True, backend="inductor")
    def step(s, o, n):
        ops.join_prefix_(s, o, n * 1.0)

    _, code = run_and_get_code(step, state, old, new)
    torch.testing.assert_close(state, eager[0], atol=0, rtol=0)
    assert torch.equal(old, eager[1])
    text = "\n".join(code)
    assert "hf_raincheck.join_prefix_" in text  # the op itself, called on the graph's inputs
    assert "copy_" not in text and "clone" not in text, text


def test_bad_inputs_are_refused(device):
    from hf_raincheck.gdn_state.join_triton import join_prefix_

    state, old, new = _case(1, 2, 16, 16, device, seed=1)
    with pytest.raises(ValueError, match="state must be"):
        join_prefix_(state[..., :-1], old, new)
    with pytest.raises(ValueError, match="fp32 states only"):
        join_prefix_(state, old.double(), new.double())
