"""Gated DeltaNet state maps: the fast paths (`hf_raincheck.gdn_state.kernels`) against the per-token reference."""

from __future__ import annotations

import pytest
import torch

from hf_raincheck.gdn_state import GDNLayerState, advance, gated_delta
from hf_raincheck.gdn_state.naive import naive_gated_delta, naive_join, naive_transition

HK, HV, K, V = 2, 4, 16, 12


def factors(t, seed=0, dtype=torch.float32, slow=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, HK, K, generator=gen)
    k = torch.randn(1, t, HK, K, generator=gen)
    v = torch.randn(1, t, HV, V, generator=gen)
    g = -torch.rand(1, t, HV, generator=gen) * (0.1 if slow else 3.0)
    beta = torch.rand(1, t, HV, generator=gen)
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def state(seed=1, width=V):
    return torch.randn(1, HV, K, width, generator=torch.Generator().manual_seed(seed))


def _gdn_module():
    """A Gated DeltaNet layer of a tiny Qwen3.5 (eager) and the family's glue."""
    from handmade_qwen3_5 import tiny_qwen3_5

    from hf_raincheck.models.qwen3_5 import Qwen3_5GDNGlue

    model = tiny_qwen3_5("eager")
    module = next(layer.linear_attn for layer in model.model.language_model.layers if hasattr(layer, "linear_attn"))
    return module, Qwen3_5GDNGlue()


@pytest.mark.parametrize("t, with_state", [(37, True), (37, False), (1, True), (64, True)])
def test_torch_kernels_match_naive(t, with_state):
    q, k, v, g, beta = factors(t)
    s0 = state() if with_state else None
    out, final = gated_delta("torch", q, k, v, g, beta, s0)
    ref_out, ref_final = naive_gated_delta(q, k, v, g, beta, s0)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final.double(), ref_final, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t", [1, 5, 70])
def test_advance_carries_the_transition_product(t):
    q, k, v, g, beta = factors(t, seed=3)
    s0, p0 = state(), state(seed=4, width=K)
    out, stacked = advance("torch", q, k, v, g, beta, torch.cat([s0, p0], dim=-1), carry=K)
    final, p = stacked[..., :V], stacked[..., V:]
    ref_out, ref_final = naive_gated_delta(q, k, v, g, beta, s0)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final.double(), ref_final, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p.double(), naive_transition(k, g, beta, HV, p0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t, cut", [(70, 66), (70, 1), (70, 69), (130, 64), (5, 2)])
@pytest.mark.parametrize("with_state", [True, False], ids=["state", "zeros"])
def test_advance_split_equals_the_per_token_reference(t, cut, with_state):
    """`advance_split` (the rows before a boundary from the state, then the tail from ``[S_b | I]``) against the
    definitions: the rows per token from the state, the state at the boundary, and P_tail."""
    from hf_raincheck.gdn_state.ops import advance_split

    q, k, v, g, beta = factors(t, seed=8, slow=False)
    s0 = state(seed=9) if with_state else None
    out, boundary, live = advance_split("torch", q, k, v, g, beta, s0, cut)
    ref_out, ref_final = naive_gated_delta(q, k, v, g, beta, s0)
    ref_boundary = naive_gated_delta(*(x[:, :cut] for x in (q, k, v, g, beta)), s0)[1]
    ref_transition = naive_transition(k[:, cut:], g[:, cut:], beta[:, cut:], HV)
    assert out.shape == (1, t, HV, V) and boundary.shape == (1, HV, K, V) and live.shape == (1, HV, K, V + K)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(boundary.double(), ref_boundary, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(live[..., :V].double(), ref_final, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(live[..., V:].double(), ref_transition, atol=1e-5, rtol=1e-5)


def _recompute_tail(prefix, tail):
    """The live state by definition: the tail's recorded factors replayed from `prefix` (float64, per token)."""
    q, k, v, g, beta = tail
    return naive_gated_delta(q, k, v, g, beta, prefix)[1]


def test_join_equals_tail_recomputation_float64():
    prefix_old = state(seed=5).double()
    tail = factors(40, seed=6, dtype=torch.float64)
    live_old = _recompute_tail(prefix_old, tail)
    transition = naive_transition(tail[1], tail[3], tail[4], HV)
    prefix_new = prefix_old + 0.5 * state(seed=7).double()
    joined = naive_join(live_old, transition, prefix_old, prefix_new)
    expected = _recompute_tail(prefix_new, tail)
    assert (joined - expected).abs().max().item() < 1e-10 * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize("tail_len", [1, 17, 96])
def test_online_transition_and_join_float32(tail_len):
    """The package's path: P_tail built online (one call per step, as decode steps do), then `GDNLayerState.join`;
    against recomputing the tail from the new prefix state in float64. Relative error <= 1e-5."""
    prefix_old = state(seed=8)
    tail = factors(tail_len, seed=9)
    layer = GDNLayerState()
    layer.set_state(prefix_old.clone(), V)
    layer.conv = torch.zeros(1, 1, 4)
    layer.checkpoint(0, HV, K, V, (1, 1, 4), prefix_old.device, torch.float32)
    assert layer.carry == K
    for i in range(tail_len):  # decode-like: one row per call
        row = [x[:, i : i + 1] for x in tail]
        _, stacked = advance("torch", *row, layer.state, carry=layer.carry)
        layer.set_state(stacked, V)
    # restore a chunk of deferred rows from the prefix, then join
    chunk = factors(9, seed=10)
    _, prefix_new = advance("torch", *chunk, layer.prefix.recurrent)
    layer.join(prefix_new)
    expected = _recompute_tail(naive_gated_delta(*chunk, prefix_old)[1], tail)
    rel = (layer.recurrent.double() - expected).abs().max() / expected.abs().max()
    assert rel.item() <= 1e-5



@pytest.mark.parametrize("most", [1, 64])
def test_fla_rows_from_a_state_take_the_recurrent_kernel_up_to_the_limit(monkeypatch, most):
    """`kernels.FLA_RECURRENT_MAX_ROWS` routes fla calls (decode rows, fused-step chunks) to the recurrent kernel;
    the torch backend keeps transformers' rule (one row); rows without a state always take the chunked kernel."""
    import hf_raincheck.gdn_state.kernels as kernels

    calls = []

    def fake(name):
        def fn(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel):
            calls.append(name)
            return v, torch.zeros(1)
        return fn

    monkeypatch.setattr(kernels, "FLA_RECURRENT_MAX_ROWS", most)
    monkeypatch.setitem(kernels._FUNCTIONS, "fla", (fake("chunk"), fake("recurrent")))
    monkeypatch.setitem(kernels._FUNCTIONS, "torch", (fake("torch chunk"), fake("torch recurrent")))
    state = torch.zeros(1, 2, 4, 4)
    for backend in ("fla", "torch"):
        for rows in (1, 31, 64, 65):
            x = torch.zeros(1, rows, 2, 4)
            kernels.gated_delta(backend, x, x, x, x[..., 0], x[..., 0], state)
        kernels.gated_delta(backend, x, x, x, x[..., 0], x[..., 0], None)
    fla_31 = "recurrent" if most >= 31 else "chunk"
    assert calls == ["recurrent", fla_31, fla_31, "chunk", "chunk",
                     "torch recurrent", "torch chunk", "torch chunk", "torch chunk", "torch chunk"]


@pytest.mark.parametrize("compiled_most", [1, 64])
def test_eager_fla_calls_take_the_recurrent_kernel_up_to_their_own_limit(monkeypatch, compiled_most):
    """Eager `advance` calls (prefill tails, eager fused steps: host-bound) route fla rows from a state by
    `FLA_EAGER_RECURRENT_MAX_ROWS`; calls through the custom op (compiled steps) by `FLA_RECURRENT_MAX_ROWS`."""
    import hf_raincheck.gdn_state.kernels as kernels
    import hf_raincheck.gdn_state.ops as ops

    calls = []

    def fake(name):
        def fn(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel):
            calls.append(name)
            return v.clone(), torch.zeros(v.shape[0], v.shape[2], q.shape[-1], v.shape[-1])
        return fn

    monkeypatch.setattr(kernels, "FLA_RECURRENT_MAX_ROWS", compiled_most)
    monkeypatch.setattr(kernels, "FLA_EAGER_RECURRENT_MAX_ROWS", 40)
    monkeypatch.setitem(kernels._FUNCTIONS, "fla", (fake("chunk"), fake("recurrent")))
    state = torch.zeros(1, 2, 4, 4)
    for opaque in (False, True):
        for rows in (1, 31, 41):
            x = torch.zeros(1, rows, 2, 4)
            ops.advance("fla", x, x, x, x[..., 0], x[..., 0], state, opaque=opaque)
    op_31 = "recurrent" if compiled_most >= 31 else "chunk"
    op_41 = "recurrent" if compiled_most >= 41 else "chunk"
    assert calls == ["recurrent", "recurrent", "chunk", "recurrent", op_31, op_41]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, extra", [(1, 0), (5, 0), (31, 0), (3, 7)])
def test_conv_tail_equals_transformers_conv(dtype, n, extra):
    """`conv_tail` (compiled steps' short conv as elementwise products) against transformers' conv (`conv_full`) on
    the last `n` positions of ``[window | rows]`` (and of a longer input: `extra` columns before the window)."""
    module, glue = _gdn_module()
    module = module.to(dtype)
    _, _, _, channels, kernel = glue.dims(module)
    full = torch.randn(3, channels, extra + kernel + n, generator=torch.Generator().manual_seed(n)).to(dtype)
    with torch.no_grad():
        got = glue.conv_tail(module, full.transpose(1, 2), n)  # channels last
        want = glue.conv_full(module, full)[:, -n:]
    assert got.shape == want.shape == (3, n, channels) and got.dtype == want.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    else:  # both sum in float32 and round once to bfloat16 before the activation: at most a rounding step apart
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)


def _batch_rows(glue, module, batch: int, gen) -> list[dict]:
    """Each row's states of one GDN layer as a compiled static batch holds them (``state`` ``[S | P_tail]`` with
    P_tail near the identity, ``conv``, ``prefix``, ``prefix_conv``), random from `gen`."""
    heads, key_dim, value_dim, channels, kernel = glue.dims(module)
    eye = torch.eye(key_dim).expand(1, heads, key_dim, key_dim)
    return [dict(state=torch.cat([0.3 * torch.randn(1, heads, key_dim, value_dim, generator=gen),
                                  eye + 0.05 * torch.randn(1, heads, key_dim, key_dim, generator=gen)], dim=-1),
                 conv=torch.randn(1, channels, kernel, generator=gen),
                 prefix=0.3 * torch.randn(1, heads, key_dim, value_dim, generator=gen),
                 prefix_conv=torch.randn(1, channels, kernel, generator=gen)) for _ in range(batch)]


@pytest.mark.parametrize("chunk", [None, 5])
def test_batch_graph_step_matches_the_per_row_reference(chunk):
    """`gdn_batch_forward_graph` (a compiled static batch step's GDN layer, run eagerly here) against the per-row,
    per-token reference: rows with different carry counts (none, some, a whole chunk), live and stopped rows; a row
    that carries nothing and stopped keeps its states bit for bit. A fused step leaves its joins pending: the
    states compared are the folded ones (`ops.join_pending_`)."""
    from hf_raincheck.gdn_state import GDNBatchGraphStep, gdn_batch_forward_graph
    from hf_raincheck.gdn_state.naive import naive_batch_graph_step
    from hf_raincheck.gdn_state.ops import join_pending_

    module, glue = _gdn_module()
    counts, live = [0, 2, 5, 0], [True, False, True, False]
    batch = len(counts)
    gen = torch.Generator().manual_seed(7)
    rows = _batch_rows(glue, module, batch, gen)
    total = 1 if chunk is None else chunk + 1
    hidden = torch.randn(batch, total, module.hidden_size, generator=gen)
    buffers = {name: torch.cat([r[name] for r in rows]) for name in rows[0]}
    step = GDNBatchGraphStep(layers={}, backend="torch", live=torch.tensor(live), lazy=chunk is not None)
    if chunk is not None:
        step.count = torch.tensor(counts)
        step.valid = torch.arange(chunk)[None, :] < step.count[:, None]
        buffers["pending"] = torch.zeros_like(buffers["prefix"])
    with torch.no_grad():
        out = gdn_batch_forward_graph(glue, module, hidden, buffers, step)
        ref_out, ref_rows = naive_batch_graph_step(glue, module, hidden, rows, counts, live, chunk)
    if chunk is not None:
        assert not buffers["pending"][0].any() and not buffers["pending"][3].any()  # rows that carried nothing
        join_pending_(buffers["state"], buffers["pending"])
    for b in range(batch):
        real = list(range(counts[b] if chunk is not None else 0)) + ([total - 1] if live[b] else [])
        torch.testing.assert_close(out[b, real], ref_out[b, real], atol=1e-5, rtol=1e-4)
        for name, tensor in ref_rows[b].items():
            torch.testing.assert_close(buffers[name][b : b + 1].double(), tensor.double(), atol=1e-5, rtol=1e-4,
                                       msg=f"row {b} {name}")
    for name in rows[0]:  # the idle row: nothing carried, nothing fed
        assert torch.equal(buffers[name][3:], rows[3][name])


def test_batch_graph_steps_leave_their_joins_pending_until_the_fold():
    """Three fused steps of `gdn_batch_forward_graph` in a row, nothing folded between them, against the per-row
    reference (which joins at every step): rows carrying different counts from step to step (a row that stops
    carrying keeps its pending sum), live and stopped rows. Every real position's output equals the reference's at
    every step (the decode rows read ``S + P_tail pending``), the checkpoints, P_tail and both conv windows equal
    it throughout, and folding ``S += P_tail pending`` (`ops.join_pending_`) gives its live states."""
    from hf_raincheck.gdn_state import GDNBatchGraphStep, gdn_batch_forward_graph
    from hf_raincheck.gdn_state.naive import naive_batch_graph_step
    from hf_raincheck.gdn_state.ops import join_pending_

    module, glue = _gdn_module()
    value_dim = glue.dims(module)[2]
    gen = torch.Generator().manual_seed(5)
    batch, chunk = 3, 4
    rows = _batch_rows(glue, module, batch, gen)
    buffers = {name: torch.cat([r[name] for r in rows]) for name in rows[0]}
    buffers["pending"] = torch.zeros_like(buffers["prefix"])
    plan = [([2, 4, 0], [True, True, False]), ([0, 3, 1], [True, False, False]), ([4, 0, 2], [True, True, True])]
    with torch.no_grad():
        for counts, live in plan:
            hidden = torch.randn(batch, chunk + 1, module.hidden_size, generator=gen)
            step = GDNBatchGraphStep(layers={}, backend="torch", live=torch.tensor(live), lazy=True)
            step.count = torch.tensor(counts)
            step.valid = torch.arange(chunk)[None, :] < step.count[:, None]
            out = gdn_batch_forward_graph(glue, module, hidden, buffers, step)
            ref_out, rows = naive_batch_graph_step(glue, module, hidden, rows, counts, live, chunk)
            for b in range(batch):
                real = list(range(counts[b])) + ([chunk] if live[b] else [])
                torch.testing.assert_close(out[b, real], ref_out[b, real], atol=1e-5, rtol=1e-4)
                for name in ("conv", "prefix", "prefix_conv"):
                    torch.testing.assert_close(buffers[name][b : b + 1].double(), rows[b][name].double(), atol=1e-5,
                                               rtol=1e-4, msg=f"row {b} {name}")
                torch.testing.assert_close(buffers["state"][b : b + 1, ..., value_dim:].double(),
                                           rows[b]["state"][..., value_dim:].double(), atol=1e-5, rtol=1e-4)
    assert buffers["pending"].abs().amax() > 0.01  # (the live states differ from the reference's until the fold)
    join_pending_(buffers["state"], buffers["pending"])
    for b in range(batch):
        torch.testing.assert_close(buffers["state"][b : b + 1].double(), rows[b]["state"].double(), atol=1e-5,
                                   rtol=1e-4, msg=f"row {b} state")
    assert not buffers["pending"].any()


def test_decode_rows_together_equal_each_row_alone():
    """`gdn_decode_rows_forward` (the decode rows of an eager shared step in one call of each piece) against
    `gdn_rows_forward` row by row (itself checked against the reference above): rows with P_tail, without, and one
    whose plan just finished (P_tail dropped before its row); outputs and every new state, and the old states are
    left untouched (a rollback keeps them)."""
    import copy

    from hf_raincheck.gdn_state import GDNLayerState, GDNStep, gdn_rows_forward
    from hf_raincheck.gdn_state.batch_rows import gdn_decode_rows_forward

    module, glue = _gdn_module()
    heads, key_dim, value_dim, channels, kernel = glue.dims(module)
    gen = torch.Generator().manual_seed(11)
    layers, steps = [], []
    for carry, track in [(key_dim, True), (0, False), (key_dim, False), (0, False)]:
        layer = GDNLayerState()
        live = 0.3 * torch.randn(1, heads, key_dim, value_dim, generator=gen)
        if carry:
            live = torch.cat([live, torch.eye(key_dim) + 0.05 * torch.randn(1, heads, key_dim, key_dim, generator=gen)],
                             dim=-1)
        layer.set_state(live, value_dim)
        layer.conv = torch.randn(1, channels, kernel, generator=gen)
        layers.append(layer)
        steps.append(GDNStep(restore_plan=None, num_restore=0, checkpoint_plan=None, checkpoint_at=0, track=track,
                             backend="torch"))
    alone = copy.deepcopy(layers)
    old = [(layer.state, layer.state.clone(), layer.conv, layer.conv.clone()) for layer in layers]
    hidden = torch.randn(len(layers), 1, module.hidden_size, generator=gen)
    with torch.no_grad():
        out = gdn_decode_rows_forward(glue, module, hidden, layers, steps)
        ref = torch.cat([gdn_rows_forward(glue, module, hidden[j : j + 1], alone[j], steps[j])
                         for j in range(len(layers))])
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    for j, (layer, expected) in enumerate(zip(layers, alone)):
        assert layer.carry == expected.carry == (key_dim if j == 0 else 0), j
        torch.testing.assert_close(layer.state, expected.state, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(layer.conv, expected.conv, atol=1e-6, rtol=1e-5)
    for state, state_before, conv, conv_before in old:
        assert torch.equal(state, state_before) and torch.equal(conv, conv_before)


def _prefill_rows(fixed_first: bool):
    """Live states for `test_prefill_rows_together_equal_each_row_alone`: (state, carry, conv, track, fixed) per row."""
    return [
        ("none", 0, False, True, fixed_first),  # a first turn (no state, no window)
        ("state", 0, True, True, False),  # a later turn without a pending plan
        ("state", "K", True, True, False),  # a pending plan's P_tail, extended by the rows
        ("state", "K", True, False, False),  # a plan that just finished: P_tail dropped before the rows
        ("state", "K", True, True, True),  # a fixed layout carrying P_tail = something
    ]


def _row_layer(what: str, carry, conv: bool, fixed: bool, dims, gen):
    """One row's `GDNLayerState` for the batched-rows tests: no state (``what == "none"``) or a random live state,
    with P_tail columns (near the identity) when `carry`, and a random conv window when `conv`."""
    from hf_raincheck.gdn_state import GDNLayerState

    heads, key_dim, value_dim, channels, kernel = dims
    layer = GDNLayerState(fixed=fixed)
    if what == "state":
        live = 0.3 * torch.randn(1, heads, key_dim, value_dim, generator=gen)
        if carry:
            live = torch.cat([live, torch.eye(key_dim) + 0.05 * torch.randn(1, heads, key_dim, key_dim,
                                                                               generator=gen)], dim=-1)
        layer.set_state(live, value_dim)
    if conv:
        layer.conv = torch.randn(1, channels, kernel, generator=gen)
    return layer


def _rows_together_equal_rows_alone(forward, glue, module, layers, alone, steps, starts, width, gen):
    """Runs `forward` (a batched GDN rows forward) on right-aligned rows with NaN padding and `gdn_rows_forward` on
    each row alone (`alone`: deep copies of `layers`); compares outputs (padding outputs zero), live states, conv
    windows and whether a prefix checkpoint exists."""
    from hf_raincheck.gdn_state import gdn_rows_forward

    hidden = torch.randn(len(layers), width, module.hidden_size, generator=gen)
    for j, s in enumerate(starts):
        hidden[j, :s] = float("nan")  # padding positions reach no real row, whatever they hold
    with torch.no_grad():
        out = forward(glue, module, hidden, starts, layers, steps)
        refs = [gdn_rows_forward(glue, module, hidden[j : j + 1, s:], alone[j], steps[j])
                for j, s in enumerate(starts)]
    for j, (s, ref) in enumerate(zip(starts, refs)):
        torch.testing.assert_close(out[j : j + 1, s:], ref, atol=1e-5, rtol=1e-4, msg=f"row {j}")
        assert not out[j, :s].any(), f"row {j}: padding outputs"
    for j, (layer, expected) in enumerate(zip(layers, alone)):
        assert layer.carry == expected.carry and layer.value_dim == expected.value_dim, j
        torch.testing.assert_close(layer.state, expected.state, atol=1e-5, rtol=1e-4, msg=f"row {j} state")
        torch.testing.assert_close(layer.conv, expected.conv, atol=1e-6, rtol=1e-5, msg=f"row {j} conv")
        assert (layer.prefix is None) == (expected.prefix is None), j


@pytest.mark.parametrize("first_turn_only", [False, True])
def test_prefill_rows_together_equal_each_row_alone(first_turn_only):
    """`gdn_prefill_rows_forward` (the rows of a shared prefill that continue a live state: no deferred rows, no new
    plan's boundary, in one call of each piece) against `gdn_rows_forward` row by row: mixed lengths right-aligned
    in one padded batch (one row, rows shorter than the conv kernel, rows across the torch kernel's 64-row chunks),
    first turns (no state; a fixed layout's first forward gets P_tail = I after it), states with and without
    P_tail, a plan that just finished; outputs (padding positions zero), every new state and conv window, and the
    old states are left untouched (a rollback keeps them). Padding positions hold NaN: none reaches a real row."""
    import copy

    from hf_raincheck.gdn_state import GDNStep
    from hf_raincheck.gdn_state.batch_rows import gdn_prefill_rows_forward

    module, glue = _gdn_module()
    gen = torch.Generator().manual_seed(13)
    kinds = _prefill_rows(fixed_first=True)
    lengths = [130, 1, 70, 2, 64]
    if first_turn_only:
        kinds = [("none", 0, False, True, fixed) for fixed in (False, True, False, True)]
        lengths = [3, 130, 1, 65]
    layers, steps = [], []
    for what, carry, conv, track, fixed in kinds:
        layers.append(_row_layer(what, carry, conv, fixed, glue.dims(module), gen))
        steps.append(GDNStep(restore_plan=None, num_restore=0, checkpoint_plan=None, checkpoint_at=0, track=track,
                             backend="torch"))
    alone = copy.deepcopy(layers)
    old = [(layer.state, None if layer.state is None else layer.state.clone(), layer.conv,
            None if layer.conv is None else layer.conv.clone()) for layer in layers]
    width = max(lengths)
    starts = [width - t for t in lengths]
    _rows_together_equal_rows_alone(gdn_prefill_rows_forward, glue, module, layers, alone, steps, starts, width, gen)
    for state, state_before, conv, conv_before in old:
        assert state is None or torch.equal(state, state_before)
        assert conv is None or torch.equal(conv, conv_before)


@pytest.mark.parametrize("first_turn_only", [False, True])
def test_checkpoint_rows_together_equal_each_row_alone(first_turn_only):
    """`gdn_checkpoint_rows_forward` (the rows of a shared prefill with a new plan's boundary inside: Raincheck's
    first turn with images, in one call of each piece) against `gdn_rows_forward` row by row: mixed lengths, cuts
    and tails (shorter than the conv kernel, across the torch kernel's 64-row chunks), first turns (a fixed layout
    too), a later turn with and without a pending plan's P_tail (dropped at the new boundary), a plan released right
    after its boundary; outputs (padding positions zero), live states, conv windows and the new checkpoints.
    Padding positions hold NaN: none reaches a real row."""
    import copy

    from hf_raincheck.gdn_state import GDNStep
    from hf_raincheck.gdn_state.batch_rows import gdn_checkpoint_rows_forward

    module, glue = _gdn_module()
    gen = torch.Generator().manual_seed(17)
    # (state, carry, conv, track, fixed), rows, rows before the boundary
    kinds = [(("none", 0, False, True, True), 130, 100), (("state", 0, True, True, False), 5, 2),
             (("state", "K", True, True, False), 90, 1), (("state", 0, True, False, False), 40, 20),
             (("state", "K", True, True, True), 75, 70)]
    if first_turn_only:
        kinds = [(("none", 0, False, True, False), 3, 1), (("none", 0, False, True, True), 140, 66),
                 (("none", 0, False, True, False), 20, 19)]
    layers, steps = [], []
    for (what, carry, conv, track, fixed), _, cut in kinds:
        layers.append(_row_layer(what, carry, conv, fixed, glue.dims(module), gen))
        steps.append(GDNStep(restore_plan=None, num_restore=0, checkpoint_plan=1000 + len(steps), checkpoint_at=cut,
                             track=track, backend="torch"))
    alone = copy.deepcopy(layers)
    lengths = [rows for _, rows, _ in kinds]
    width = max(lengths)
    starts = [width - t for t in lengths]
    _rows_together_equal_rows_alone(gdn_checkpoint_rows_forward, glue, module, layers, alone, steps, starts, width,
                                    gen)
    for layer, expected in zip(layers, alone):
        if expected.prefix is not None:
            assert layer.prefix.plan_id == expected.prefix.plan_id
            torch.testing.assert_close(layer.prefix.recurrent, expected.prefix.recurrent, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(layer.prefix.conv, expected.prefix.conv, atol=1e-6, rtol=1e-5)


def _restoring_row(plan_id: int, count: int, track: bool, fixed: bool, dims, gen):
    """One row of a fused step restoring `count` deferred rows of plan `plan_id`: its `GDNLayerState` (a live state
    with P_tail, a random conv window and a random prefix checkpoint) and its `GDNStep`."""
    from hf_raincheck.gdn_state import GDNStep, PrefixCheckpoint

    heads, key_dim, value_dim, channels, kernel = dims
    layer = _row_layer("state", "K", True, fixed, dims, gen)
    layer.prefix = PrefixCheckpoint(plan_id=plan_id,
                                    recurrent=0.3 * torch.randn(1, heads, key_dim, value_dim, generator=gen),
                                    conv=torch.randn(1, channels, kernel, generator=gen))
    return layer, GDNStep(restore_plan=plan_id, num_restore=count, checkpoint_plan=None, checkpoint_at=0, track=track,
                          backend="torch")


@pytest.mark.parametrize("rows", ["decode", "stopped", "uniform"])
def test_restore_rows_together_equal_each_row_alone(rows):
    """`gdn_restore_rows_forward` (the rows of an eager fused decode step that restore deferred rows: each row's next
    chunk from its own prefix checkpoint, the join, then its decode row, in one call of each piece) against
    `gdn_rows_forward` row by row: chunks of different sizes (one row, fewer rows than the conv kernel, a full
    chunk), a plan that finishes with this step (P_tail dropped before the decode row), a fixed layout, and rows
    that stopped (deferred rows only, no decode row); every row carrying as many rows and decoding (no padding: the
    common step at large batches); outputs (padding positions zero), live states, conv windows
    and the prefix checkpoints (state and window at the new end of the restored rows). Padding holds NaN."""
    import copy

    from hf_raincheck.gdn_state.batch_rows import gdn_restore_rows_forward

    module, glue = _gdn_module()
    gen = torch.Generator().manual_seed(19)
    # (deferred rows, decode row, track, fixed)
    kinds = [(31, True, True, False), (1, True, True, False), (2, True, False, False), (17, True, True, True),
             (9, True, False, True)]
    if rows == "stopped":
        kinds += [(5, False, True, False), (31, False, False, False)]
    if rows == "uniform":
        kinds = [(8, True, True, False), (8, True, True, False), (8, True, False, False), (8, True, True, True)]
    layers, steps, lengths = [], [], []
    for j, (count, decode, track, fixed) in enumerate(kinds):
        layer, step = _restoring_row(2000 + j, count, track, fixed, glue.dims(module), gen)
        layers.append(layer)
        steps.append(step)
        lengths.append(count + decode)
    alone = copy.deepcopy(layers)
    old = [(layer.state.clone(), layer.conv.clone(), layer.prefix.recurrent.clone(), layer.prefix.conv.clone())
           for layer in layers]
    before = [(layer.state, layer.conv, layer.prefix.recurrent, layer.prefix.conv) for layer in layers]
    width = max(lengths)
    starts = [width - t for t in lengths]
    _rows_together_equal_rows_alone(gdn_restore_rows_forward, glue, module, layers, alone, steps, starts, width, gen)
    for j, (layer, expected) in enumerate(zip(layers, alone)):
        if expected.prefix is not None:
            assert layer.prefix.plan_id == expected.prefix.plan_id
            torch.testing.assert_close(layer.prefix.recurrent, expected.prefix.recurrent, atol=1e-5, rtol=1e-4,
                                       msg=f"row {j} prefix state")
            torch.testing.assert_close(layer.prefix.conv, expected.prefix.conv, atol=1e-6, rtol=1e-5,
                                       msg=f"row {j} prefix window")
    for tensors, copies in zip(before, old):  # the old tensors untouched (a rollback keeps them)
        for t, c in zip(tensors, copies):
            assert torch.equal(t, c)


def test_rows_restoring_then_running_a_prompt_together_equal_each_row_alone(monkeypatch):
    """A shared forward's rows that restore deferred rows and then run a prompt (a next turn folding the rows still
    pending: `_restore_then_prompt_rows`, the restore and prompt pieces each batched) against `gdn_rows_forward`
    row by row: different deferred counts and prompt lengths, a plan that finishes (P_tail released before the
    prompt) and one that keeps tracking, a prompt with a new plan's boundary inside it (its checkpoint), a fixed
    layout; next to a decode row and a row of a kind of its own. Outputs (padding zero), live states, conv windows
    and checkpoints; padding holds NaN; the old tensors untouched. The deferred rows of all such rows run in one
    kernel call per GDN layer (not one per row)."""
    import copy

    from hf_raincheck.gdn_state import GDNStep
    from hf_raincheck.gdn_state import batch_rows
    from hf_raincheck.gdn_state.shared_layer import SharedGDNSteps, gdn_shared_forward

    module, glue = _gdn_module()
    dims = glue.dims(module)
    gen = torch.Generator().manual_seed(31)
    # (deferred rows, prompt rows, track, fixed, boundary inside the prompt)
    kinds = [(5, 7, False, False, None), (31, 3, True, False, None), (2, 9, True, False, 4), (17, 2, False, True, None),
             (3, 6, True, True, 2)]
    layers, steps, lengths = [], [], []
    for j, (count, prompt, track, fixed, cut) in enumerate(kinds):
        layer, step = _restoring_row(3000 + j, count, track, fixed, dims, gen)
        if cut is not None:
            step = GDNStep(restore_plan=step.restore_plan, num_restore=count, checkpoint_plan=4000 + j,
                           checkpoint_at=cut, track=True, backend="torch")
        layers.append(layer)
        steps.append(step)
        lengths.append(count + prompt)
    # a decode-only row and a lone restore-then-decode row beside them (kinds of their own)
    layers.append(_row_layer("state", 0, True, False, dims, gen))
    steps.append(GDNStep(None, 0, None, 0, False, "torch"))
    lengths.append(1)
    layer, step = _restoring_row(5000, 4, True, False, dims, gen)
    layers.append(layer)
    steps.append(step)
    lengths.append(5)
    alone = copy.deepcopy(layers)
    old = [[t.clone() for t in (layer.state, layer.conv)] for layer in layers]
    before = [(layer.state, layer.conv) for layer in layers]
    width = max(lengths)
    calls = []
    real = batch_rows.advance
    monkeypatch.setattr(batch_rows, "advance", lambda *a, **kw: calls.append(tuple(a[1].shape[:2])) or real(*a, **kw))

    def shared(glue, module, hidden, starts, layers, steps):
        rows = [(start, step, lambda idx, layer=layer: layer) for start, step, layer in zip(starts, steps, layers)]
        return gdn_shared_forward(glue, module, hidden, SharedGDNSteps(rows=rows))

    _rows_together_equal_rows_alone(shared, glue, module, layers, alone, steps, [width - t for t in lengths], width,
                                    gen)
    assert (len(kinds), max(count for count, *_ in kinds)) in calls  # every row's deferred rows in one call
    for j, (layer, expected) in enumerate(zip(layers, alone)):
        if expected.prefix is not None:
            assert layer.prefix.plan_id == expected.prefix.plan_id, j
            torch.testing.assert_close(layer.prefix.recurrent, expected.prefix.recurrent, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(layer.prefix.conv, expected.prefix.conv, atol=1e-6, rtol=1e-5)
    for tensors, copies in zip(before, old):
        for t, c in zip(tensors, copies):
            assert torch.equal(t, c)


def test_a_fused_step_of_restoring_rows_makes_one_kernel_call_per_gdn_layer(monkeypatch):
    """An eager shared fused step whose rows all restore deferred rows and decode runs each GDN layer's deferred
    rows in one kernel call and the decode rows in one more (not two per row)."""
    from hf_raincheck.gdn_state import batch_rows
    from hf_raincheck.gdn_state.shared_layer import SharedGDNSteps, gdn_shared_forward

    module, glue = _gdn_module()
    gen = torch.Generator().manual_seed(23)
    calls = []
    real = batch_rows.advance
    monkeypatch.setattr(batch_rows, "advance", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    rows = []
    counts = [4, 3, 4, 2]
    for j, count in enumerate(counts):
        layer, step = _restoring_row(j, count, True, False, glue.dims(module), gen)
        rows.append((5 - count - 1, step, lambda idx, layer=layer: layer))
    hidden = torch.randn(len(counts), 5, module.hidden_size, generator=gen)
    with torch.no_grad():
        gdn_shared_forward(glue, module, hidden, SharedGDNSteps(rows=rows))
    assert [tuple(shape[:2]) for shape in calls] == [(4, 5), (4, 1)]


@pytest.mark.parametrize("kind", ["decode", "restore"])
def test_batched_gdn_step_host_work_does_not_grow_with_the_rows(kind, monkeypatch):
    """Eager steps are host-bound on a GPU: the batched GDN pieces of a shared step (decode rows; rows restoring
    deferred rows then decoding) call the same number of aten operators from Python for 2 rows as for 8 (each row's
    new states are views made by one `split` per tensor, not a slice per row), counted as `benchmarks/step_ops.py`
    counts them."""
    import os

    from hf_raincheck.gdn_state import GDNStep
    from hf_raincheck.gdn_state.batch_rows import gdn_decode_rows_forward, gdn_restore_rows_forward

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from step_ops import _top

    module, glue = _gdn_module()
    gen = torch.Generator().manual_seed(29)

    def calls(n: int) -> int:
        rows = [_restoring_row(j, 3, True, False, glue.dims(module), gen) for j in range(n)]
        layers, steps = [layer for layer, _ in rows], [step for _, step in rows]
        if kind == "decode":
            steps = [GDNStep(restore_plan=None, num_restore=0, checkpoint_plan=None, checkpoint_at=0, track=True,
                             backend="torch")] * n
            forward = lambda hidden: gdn_decode_rows_forward(glue, module, hidden, layers, steps)  # noqa: E731
        else:
            forward = lambda hidden: gdn_restore_rows_forward(glue, module, hidden, [0] * n, layers, steps)  # noqa
        hidden = torch.randn(n, 1 if kind == "decode" else 4, module.hidden_size, generator=gen)
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            forward(hidden)
        return _top(prof.events())

    calls(2)  # (first calls build persistent zeros: `ops.zero_like`)
    assert calls(8) == calls(2)


def test_stacked_rows_reuses_the_tensor_a_split_came_from():
    """`stacked_rows` equals ``torch.cat`` always, and is the very tensor whose `split` gave the rows when they are all
    of its rows in order (a batch's GDN states from one step to the next: no copy per GDN layer and step)."""
    from hf_raincheck.gdn_state.batch_rows import stacked_rows

    whole = torch.randn(4, 3, 5)
    rows = list(whole.split(1))
    assert stacked_rows(rows) is whole
    for other in (rows[::-1], rows[:3], rows[1:], [rows[0], rows[1].clone(), rows[2], rows[3]],
                  list(whole[:, :, :4].split(1)), [r.clone() for r in rows]):
        got = stacked_rows(other)
        assert got is not whole and torch.equal(got, torch.cat(other))
    assert stacked_rows(rows[:1]) is rows[0]
