"""fla-core's recurrent kernel launched by the package against fla's own public function, bit for bit: on a state
buffer in place (`kernels.gated_delta_`, the decode rows of compiled static steps) and into a new final state
(`kernels.gated_delta`, the recurrent calls of eager forwards, without the public function's host work).

GPU tests (CI's main suite deselects them); they also run on the CPU under Triton's interpreter, where fla-core's
kernels run too: ``TRITON_INTERPRET=1 python -m pytest -m triton tests/test_gdn_inplace_fla.py`` with fla-core
importable (.ci/run puts it in a directory of its own on ``PYTHONPATH``: installed in the test environment it would
make transformers' own Qwen3.5 layers take fla's kernels on the CPU). Skipped without fla-core.
"""

from __future__ import annotations

import pytest
import torch

import hf_raincheck.gdn_state.kernels as kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.triton,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Triton is not supported on current platform:UserWarning"),
]

HK, HV, K, V = 2, 4, 16, 8  # grouped value heads, as Qwen3.5's (H_v = 2 H_k)


@pytest.fixture(scope="module")
def device(triton_device) -> torch.device:
    pytest.importorskip("fla.ops.gated_delta_rule", reason="needs fla-core (pip install 'hf_raincheck[gpu]')")
    return triton_device


def factors(batch, rows, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, rows, HK, K, generator=gen)
    k = torch.randn(batch, rows, HK, K, generator=gen)
    v = torch.randn(batch, rows, HV, V, generator=gen)
    g = -torch.exp(torch.empty(batch, rows, HV).uniform_(-5.0, -1.0, generator=gen))
    beta = torch.rand(batch, rows, HV, generator=gen)
    return [x.to(device, dtype if x is not g else torch.float32) for x in (q, k, v, g, beta)]


def initial_state(carry, device, seed=1):
    """``[3, H_v, K, V]`` float32, with `carry` columns of a transition map next to it (``[S | P]``)."""
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(3, HV, K, V, generator=gen)
    if carry:
        transition = torch.eye(K).expand(3, HV, K, K) + 0.01 * torch.randn(3, HV, K, K, generator=gen)
        state = torch.cat([state, transition], -1)
    return state.to(device)


def public_recurrent(q, k, v, g, beta, state):
    """fla-core's public recurrent function (the reference): ``(out, final state)``."""
    recurrent = kernels.functions("fla")[1]
    return recurrent(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                     use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("carry", [0, K], ids=["S", "S|P"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_in_place_kernel_equals_fla_bit_for_bit(device, monkeypatch, dtype, rows, carry):
    from hf_raincheck.gdn_state.ops import advance, advance_

    assert kernels._fla_recurrent_kernel() is not None, "fla-core's recurrent kernel signature changed"
    q, k, v, g, beta = factors(3, rows, dtype, device)
    state = initial_state(carry, device)
    ref_out, ref_final = public_recurrent(*padded(q, k, v, g, beta, carry), state.clone())
    buffer = state.clone()
    pointer = buffer.data_ptr()

    def no_fallback(*args, **kwargs):
        raise AssertionError("gated_delta_ fell back to the public function")

    monkeypatch.setattr(kernels, "gated_delta", no_fallback)
    out = kernels.gated_delta_("fla", *padded(q, k, v, g, beta, carry), buffer)
    assert buffer.data_ptr() == pointer
    assert torch.equal(buffer, ref_final) and not torch.equal(buffer, state)
    assert out.dtype == v.dtype and torch.equal(out, ref_out)
    monkeypatch.undo()
    if rows > 1:  # (compiled steps call the op for decode rows; `advance` takes fla's chunked kernel above 1 row)
        return
    # through the custom op, as compiled steps call it, against `advance` (the out-of-place call it replaces)
    ref_out, ref_final = advance("fla", q, k, v, g, beta, state.clone(), carry, opaque=True)
    buffer = state.clone()
    assert torch.equal(advance_("fla", q, k, v, g, beta, buffer, carry), ref_out)
    assert torch.equal(buffer, ref_final)


@pytest.mark.parametrize("carry", [0, K], ids=["S", "S|P"])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_eager_recurrent_calls_launch_the_kernel_into_a_new_state(device, monkeypatch, dtype, rows, carry):
    """`kernels.gated_delta` with fla's recurrent kernel (eager forwards: up to `FLA_EAGER_RECURRENT_MAX_ROWS` rows
    from a state) launches it itself: the public function's outputs and final state bit for bit, the initial state
    only read, and fla's public functions never called."""
    q, k, v, g, beta = padded(*factors(3, rows, dtype, device, seed=4), carry)
    state = initial_state(carry, device, seed=5)
    ref_out, ref_final = public_recurrent(q, k, v, g, beta, state.clone())
    before = state.clone()

    def public(*args, **kwargs):
        raise AssertionError("gated_delta called fla's public function")

    kernels.functions("fla")
    monkeypatch.setitem(kernels._FUNCTIONS, "fla", (public, public))
    out, final = kernels.gated_delta("fla", q, k, v, g, beta, state,
                                     recurrent_rows=kernels.FLA_EAGER_RECURRENT_MAX_ROWS)
    assert torch.equal(state, before) and final.data_ptr() != state.data_ptr()
    assert final.dtype == torch.float32 and torch.equal(final, ref_final.float())
    assert out.dtype == ref_out.dtype and torch.equal(out, ref_out)


def padded(q, k, v, g, beta, carry):
    """The values with `carry` zero columns, as `advance` feeds a ``[S | P]`` state."""
    if carry:
        v = torch.cat([v, v.new_zeros(*v.shape[:-1], carry)], -1)
    return q, k, v, g, beta


def test_a_state_that_is_not_a_contiguous_buffer_takes_the_public_function(device):
    q, k, v, g, beta = factors(2, 1, torch.float32, device, seed=2)
    wide = torch.randn(2, HV, K, 2 * V, generator=torch.Generator().manual_seed(3)).to(device)
    view = wide[..., :V]  # a strided view: the kernel's pointer arithmetic assumes [B, H_v, K, V] contiguous
    ref_out, ref_final = public_recurrent(q, k, v, g, beta, view.contiguous())
    rest = wide[..., V:].clone()
    out = kernels.gated_delta_("fla", q, k, v, g, beta, view)
    assert torch.equal(view, ref_final) and torch.equal(out, ref_out) and torch.equal(wide[..., V:], rest)
