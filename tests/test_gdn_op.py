"""``hf_raincheck::gated_delta`` (`hf_raincheck.gdn_state.ops`): the GDN kernel call as one custom op, so compiled
static steps hold one opaque node per call instead of the traced kernels (CPU: torch kernels, dynamo fullgraph)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch._dynamo
from transformers.generation.configuration_utils import CompileConfig

sys.path.insert(0, os.path.dirname(__file__))

from handmade import _conv  # noqa: E402
from helpers import generate, new_tokens  # noqa: E402

import hf_raincheck.gdn_state.kernels as kernels  # noqa: E402
from hf_raincheck import RaincheckConfig, enable_raincheck  # noqa: E402
from hf_raincheck.conversation import output_cache  # noqa: E402
from hf_raincheck.gdn_state import advance, gated_delta  # noqa: E402

HK, HV, K, V = 2, 4, 16, 12
CASES = {"decode_row": (1, True), "chunk_of_7": (7, True), "no_state": (5, False)}


def factors(t, with_state, seed=0, dtype=torch.float32, width=V):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, HK, K, generator=gen).to(dtype)
    k = torch.randn(1, t, HK, K, generator=gen).to(dtype)
    v = torch.randn(1, t, HV, V, generator=gen).to(dtype)
    g = -torch.rand(1, t, HV, generator=gen)
    beta = torch.rand(1, t, HV, generator=gen).to(dtype)
    state = torch.randn(1, HV, K, width, generator=gen) if with_state else None
    return q, k, v, g, beta, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_op_equals_gated_delta(case, dtype):
    q, k, v, g, beta, state = factors(*CASES[case], dtype=dtype)
    out, final = torch.ops.hf_raincheck.gated_delta(q, k, v, g, beta, state, "torch")
    ref_out, ref_final = gated_delta("torch", q, k, v, g, beta, state)
    assert out.shape == (1, CASES[case][0], HV, V) and out.dtype == dtype
    assert final.shape == (1, HV, K, V) and final.dtype == torch.float32
    assert torch.equal(out, ref_out) and torch.equal(final, ref_final)


@pytest.mark.parametrize("t", [1, 7])
def test_opaque_advance_carries_the_transition_map_alike(t):
    q, k, v, g, beta, stacked = factors(t, True, seed=2, width=V + K)
    out, final = advance("torch", q, k, v, g, beta, stacked, carry=K, opaque=True)
    ref_out, ref_final = advance("torch", q, k, v, g, beta, stacked, carry=K)
    assert out.shape == (1, t, HV, V) and final.shape == (1, HV, K, V + K)
    assert torch.equal(out, ref_out) and torch.equal(final, ref_final)


@pytest.mark.parametrize("t", [1, 7])
def test_in_place_advance_leaves_what_advance_returns_in_the_buffer(t):
    """``advance_`` (``hf_raincheck::gated_delta_``, what compiled steps' decode rows call): the state buffer ends
    holding ``advance``'s final state (``[S | P]`` included), the outputs are ``advance``'s, the inputs untouched."""
    from hf_raincheck.gdn_state.ops import advance_

    q, k, v, g, beta, stacked = factors(t, True, seed=3, width=V + K)
    inputs = [x.clone() for x in (q, k, v, g, beta)]
    ref_out, ref_final = advance("torch", q, k, v, g, beta, stacked, carry=K)
    buffer = stacked.clone()
    pointer = buffer.data_ptr()
    out = advance_("torch", q, k, v, g, beta, buffer, carry=K)
    assert buffer.data_ptr() == pointer and torch.equal(buffer, ref_final) and not torch.equal(buffer, stacked)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(inputs, (q, k, v, g, beta)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_in_place_opcheck(dtype):
    """Schema (the state is declared mutated), fake outputs and AOT dispatch of ``hf_raincheck::gated_delta_``."""
    q, k, v, g, beta, state = factors(1, True, seed=4, dtype=dtype)
    torch.library.opcheck(torch.ops.hf_raincheck.gated_delta_.default, (q, k, v, g, beta, state, "torch"))


def _join_operands(batch=3, seed=5):
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(batch, HV, K, V + K, generator=gen)
    delta = torch.randn(batch, HV, K, V, generator=gen)
    return state, delta


def test_in_place_join_adds_p_tail_times_delta_in_the_buffer():
    """``join_`` (``hf_raincheck::join_``, compiled steps' join): ``S += P_tail delta`` in the buffer's first V
    columns, P_tail untouched, the same bits as the eager join's ``baddbmm`` (`GDNLayerState.join`) and within
    rounding of the plain product; a row whose delta is 0 (it carried nothing) keeps its state bit for bit."""
    from hf_raincheck.gdn_state.ops import join_

    state, delta = _join_operands()
    delta[1] = 0.0
    before = state.clone()
    pointer = state.data_ptr()
    join_(state, delta)
    assert state.data_ptr() == pointer
    eager = torch.baddbmm(before[..., :V].reshape(-1, K, V), before[..., V:].reshape(-1, K, K),
                          delta.reshape(-1, K, V)).view(3, HV, K, V)
    assert torch.equal(state[..., :V], eager)
    torch.testing.assert_close(state[..., :V], before[..., :V] + before[..., V:] @ delta, rtol=1e-5, atol=1e-5)
    assert torch.equal(state[..., V:], before[..., V:]) and torch.equal(state[1], before[1])
    assert not torch.equal(state[0], before[0])


def test_join_of_a_view_updates_the_view_and_nothing_else():
    """A state that is a view (not one contiguous buffer) takes the plain product, still in place; the rest of its
    storage is left alone."""
    from hf_raincheck.gdn_state.ops import join_

    state, delta = _join_operands()
    storage = torch.cat([state, torch.full((3, HV, K, 5), 7.0)], dim=-1)
    view = storage[..., : V + K]
    expected = view[..., :V] + view[..., V:] @ delta
    join_(view, delta)
    torch.testing.assert_close(storage[..., :V], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(storage[..., V + K:], torch.full((3, HV, K, 5), 7.0))


def test_join_opcheck():
    """Schema (the state is declared mutated), fake outputs and AOT dispatch of ``hf_raincheck::join_``."""
    torch.library.opcheck(torch.ops.hf_raincheck.join_.default, _join_operands())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_opcheck(case, dtype):
    """Schema, fake (meta) outputs against the real ones, and AOT dispatch (static and dynamic shapes)."""
    args = (*factors(*CASES[case], dtype=dtype), "torch")
    torch.library.opcheck(torch.ops.hf_raincheck.gated_delta.default, args)


def test_op_imports_and_runs_without_fla():
    """fla-core absent (its import blocked): the op still registers and runs the torch kernels."""
    code = (
        "import sys; sys.modules['fla'] = None\n"
        "import torch\n"
        "from hf_raincheck.gdn_state import ops, fla_available\n"
        "assert not fla_available()\n"
        "q = torch.randn(1, 3, 2, 8); v = torch.randn(1, 3, 2, 4); g = -torch.rand(1, 3, 2)\n"
        "out, final = torch.ops.hf_raincheck.gated_delta(q, q, v, g, torch.rand(1, 3, 2), None, 'torch')\n"
        "assert out.shape == (1, 3, 2, 4) and final.shape == (1, 2, 8, 4)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_compiled_auto_resolves_like_everywhere_else(monkeypatch):
    from hf_raincheck.generation.decode import compiled_gdn_backend

    monkeypatch.setattr(kernels, "fla_available", lambda: True)
    assert compiled_gdn_backend("auto", torch.device("cuda")) == "fla"
    assert compiled_gdn_backend("auto", torch.device("cpu")) == "torch"
    assert compiled_gdn_backend("torch", torch.device("cuda")) == "torch"
    monkeypatch.setattr(kernels, "fla_available", lambda: False)
    assert compiled_gdn_backend("auto", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="fla-core"):
        compiled_gdn_backend("fla", torch.device("cuda"))


# ---------------------------------------------------------------------------------------------------- compiled
@pytest.fixture(scope="module")
def hybrid():
    from handmade_qwen3_5 import tiny_qwen3_5

    return enable_raincheck(tiny_qwen3_5("eager"))


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_compiled_steps_hold_the_op_not_the_traced_kernels(hybrid):
    """Compiled Qwen3.5 steps (dynamo, fullgraph) give eager's tokens, and each graph holds one op node per GDN
    kernel call (3 GDN layers: a decode step the decode row's ``hf_raincheck::gated_delta_`` each; a fused step that
    and the window with its join left pending, ``hf_raincheck::lazy_window_``), no join (``hf_raincheck::join_``:
    the fused steps' joins are folded in outside the graphs), and none of the torch kernels' ops."""
    graphs = []

    def recorder(gm, example_inputs, **options):  # options: CompileConfig's mode
        graphs.append(gm)
        return gm.forward

    config = CompileConfig(backend=recorder, fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking")
    inputs = _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4], seed=0)
    eager = generate(hybrid, inputs, 12, cfg)
    compiled = generate(hybrid, inputs, 12, cfg, cache_implementation="static", compile_config=config)
    assert new_tokens(compiled, inputs) == new_tokens(eager, inputs)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), atol=2e-5, rtol=1e-4)

    layers = sum(t == "linear_attention" for t in hybrid.config.text_config.layer_types)
    ops, windows, joins, kernel_ops = [], [], [], []
    for gm in graphs:
        targets = [str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        ops.append(sum("hf_raincheck.gated_delta" in t for t in targets))
        windows.append(sum("hf_raincheck.lazy_window_" in t for t in targets))
        joins.append(sum("hf_raincheck.join_" in t for t in targets))
        kernel_ops.append([t for t in targets if "solve_triangular" in t or "l2norm" in t or "cumsum" in t])
    assert len(graphs) == 2
    assert sorted(zip(windows, ops)) == [(0, layers), (layers, layers)]
    assert joins == [0, 0]
    assert kernel_ops == [[] for _ in graphs]


def test_one_chunk_kernel_takes_every_window():
    """fla backend, rows from a state: the one-chunk Triton kernel takes 2-64 rows at every batch size, with 32 V
    columns per program where its programs (batch row x value head x column block) fit the GPU's SMs and 64 past
    that; one row (the recurrent kernel's), longer windows and V that the blocks do not divide stay with fla (0)."""
    pytest.importorskip("triton")  # the kernel's module (its tiling constants)
    columns = kernels.one_chunk_block_columns
    assert columns(63, 1, 32, 128, 132) == 32  # Qwen3.5-9B's heads at batch 1 on an H200: 128 programs
    assert columns(2, 1, 32, 128, 132) == 32 and columns(64, 1, 32, 128, 132) == 32
    assert columns(1, 1, 32, 128, 132) == 0 and columns(65, 1, 32, 128, 132) == 0
    assert columns(63, 2, 32, 128, 132) == 64 and columns(63, 16, 32, 128, 132) == 64  # past one wave
    assert columns(63, 1, 32, 128, 100) == 64  # a smaller GPU
    assert columns(5, 4, 4, 16, 132) == 16  # the tests' tiny Qwen3.5: one block of V = 16
    assert columns(5, 1, 2, 48, 132) == 0  # ragged column blocks (V = 48) stay with fla
    assert columns(63, 1, 32, 96, 132) == 32 and columns(63, 2, 32, 96, 132) == 0  # 3 x 32; 64 does not divide 96


def test_tail_kernel_columns_fill_one_wave():
    """A first prefill's tail from ``[S_b | I]`` (V + K state columns): 32 columns per program where its programs
    fit the GPU's SMs, 64 past that where 64 divide V and K, else 32 (the tail takes the kernel either way)."""
    pytest.importorskip("triton")
    columns = kernels.tail_block_columns
    assert columns(1, 32, 128, 128, 132) == 64  # Qwen3.5-9B's heads: 256 programs of 32 columns, 128 of 64
    assert columns(1, 16, 128, 128, 132) == 32  # 128 programs of 32: one wave
    assert columns(1, 32, 128, 96, 132) == 32 and columns(1, 32, 96, 128, 132) == 32  # 64 divides neither
    assert columns(1, 4, 16, 16, 132) == 16  # the tests' tiny Qwen3.5


# ------------------------------------------------------------------------------------------ lazy window (torch)
def _lazy_operands(t, seed=6):
    """A fused step's GDN operands: `t` window rows and a checkpoint, the decode row and the live ``[S | P_tail]``."""
    window = factors(t, True, seed=seed)
    row = factors(1, True, seed=seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    transition = torch.eye(K).expand(1, HV, K, K) * 0.9 + 0.05 * torch.randn(1, HV, K, K, generator=gen)
    live = torch.cat([row[5], transition], dim=-1).contiguous()
    return window[:5], window[5].contiguous(), row[:5], live


@pytest.mark.parametrize("t", [1, 4])
def test_lazy_window_equals_the_joined_step_and_folds_to_its_state(t):
    """``ops.lazy_window_`` (the torch path: CPU, no one-chunk kernel) over two fused steps against the joined steps
    (window, join, then the decode row): the same window and decode-row outputs, the same checkpoint, and folding
    the pending difference (`join_pending_`) gives the joined live state and zeroes it."""
    from hf_raincheck.gdn_state.ops import advance_, join_pending_, join_prefix_, lazy_window_

    window, prefix, row, live = _lazy_operands(t)
    joined = dict(prefix=prefix.clone(), live=live.clone())
    lazy = dict(prefix=prefix.clone(), live=live.clone(), pending=torch.zeros_like(prefix))
    for step in range(2):
        if step:
            window, _, row, _ = _lazy_operands(t, seed=20)
        out, new_prefix = advance("torch", *window, joined["prefix"])
        join_prefix_(joined["live"], joined["prefix"], new_prefix)
        want_live = advance_("torch", *row, joined["live"], K)
        got, got_live = lazy_window_("torch", *window, lazy["prefix"], lazy["pending"], lazy["live"], *row)
        torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_live, want_live, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lazy["prefix"], joined["prefix"], rtol=0, atol=0)
    assert lazy["pending"].abs().max() > 0
    join_pending_(lazy["live"], lazy["pending"])
    torch.testing.assert_close(lazy["live"], joined["live"], rtol=1e-5, atol=1e-6)
    assert not lazy["pending"].any()


def test_lazy_window_opcheck():
    """Schema (checkpoint and pending declared mutated), fake outputs and AOT dispatch of
    ``hf_raincheck::lazy_window_``."""
    window, prefix, row, live = _lazy_operands(4)
    decode = torch.cat([torch.randn(1, 1, HV, V), torch.randn(1, 1, HV, K)], dim=-1)
    torch.library.opcheck(torch.ops.hf_raincheck.lazy_window_.default,
                          (*window, prefix, torch.zeros_like(prefix), decode, "torch"))


@pytest.mark.parametrize("completion", ["next_turn", "blocking"])
def test_compiled_fused_steps_leave_nothing_pending_between_calls(hybrid, completion):
    """Compiled steps leave their windows' joins pending while they run (`ops.lazy_window_`); every ``generate`` call
    ends with them folded in: after an answer that stopped with deferred rows left (``next_turn``) or restored them
    (``blocking``), every GDN layer's pending difference is zero and its live state equals the eager steps', and the
    second turn on the cache gives the eager second turn's tokens and logits."""
    config = CompileConfig(backend="eager", fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, pruning="uniform", completion=completion)
    inputs = _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4], seed=1)
    runs = {}
    for kind, kw in (("eager", {}), ("compiled", dict(cache_implementation="static", compile_config=config))):
        out1 = generate(hybrid, inputs, 6, cfg, **kw)
        cache = output_cache(out1)
        states = {idx: layer.recurrent.clone() for idx, layer in cache.gdn_states.items()}
        if kind == "compiled":
            pendings = [layer.pending for layer in cache.gdn_states.values()]
            assert all(p is not None for p in pendings) and not any(p.any() for p in pendings)
            assert completion == "blocking" or cache.pending > 0
        ids = torch.cat([out1.sequences, torch.tensor([[5, 6, 7]])], dim=1)
        turn2 = dict(inputs, input_ids=ids, attention_mask=torch.ones_like(ids),
                     mm_token_type_ids=torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(ids[:, inputs[
                         "input_ids"].shape[1]:])], dim=1))
        out2 = generate(hybrid, turn2, 4, cfg, past=cache, **kw)
        runs[kind] = (states, out2, turn2)
    for idx, state in runs["eager"][0].items():
        torch.testing.assert_close(runs["compiled"][0][idx], state, rtol=1e-4, atol=2e-5)
    assert new_tokens(runs["compiled"][1], runs["compiled"][2]) == new_tokens(runs["eager"][1], runs["eager"][2])
    torch.testing.assert_close(torch.stack(runs["compiled"][1].logits), torch.stack(runs["eager"][1].logits),
                               atol=2e-5, rtol=1e-4)
