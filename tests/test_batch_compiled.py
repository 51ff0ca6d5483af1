"""Compiled static batches (``cache_implementation="static"``, B > 1 rows; Qwen3-VL, Qwen2.5-VL and Qwen3.5, whose
Gated DeltaNet layers run every row on its own states inside the graph): the decode and fused steps of every row in
one compiled graph per batch size and step kind (`generation/shared_static.py`).

On the CPU dynamo compiles with the eager backend and ``fullgraph=True`` (a graph break fails the test), as
tests/test_compiled_steps.py does for one row. Every row of a mixed left-padded batch (images of different sizes,
two images, a text-only row, different lengths) must equal its own batch-1 compiled run and the dynamic shared
engine (greedy tokens, step logits within the tolerance, caches, accounting), on the next turn too; rows that stop
early keep restoring; the graphs are built once per batch size and reused across steps, turns, plans and
conversations.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_raincheck import RaincheckConfig, enable_raincheck
from hf_raincheck.cache.batched import BatchedDeferredPrefillCache
from hf_raincheck.conversation import cache_argument, output_cache
from hf_raincheck.generation.shared_static import StaticBatchStep
from hf_raincheck.testing import load_tiny_qwen2_5_vl, load_tiny_qwen3_5, load_tiny_qwen3_vl, make_image
from test_batch import CONVERSATIONS, _gen, _inputs, _messages, _next_turn_batch, assert_same_cache
from test_compiled_steps import compile_config, graphs

TOL = dict(atol=2e-5, rtol=1e-4)
N = 8


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl", "qwen3_5"])
def family(request, tiny_vl_path, tiny_qwen2_5_vl_path, tiny_qwen3_5_path):
    if request.param == "qwen3_vl":
        model, processor = load_tiny_qwen3_vl(tiny_vl_path)
    elif request.param == "qwen3_5":
        model, processor = load_tiny_qwen3_5(tiny_qwen3_5_path)
    else:
        model, processor = load_tiny_qwen2_5_vl(tiny_qwen2_5_vl_path)
    return enable_raincheck(model), processor


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture
def steps(monkeypatch):
    """Every compiled batch step run: ``(batch size, carry counts, live rows, fused window)`` (the window: deferred
    rows per batch row of the graph that ran, None for a decode-only step)."""
    seen = []
    original = StaticBatchStep.__call__

    def recording(self, adapter, group, bturn, tokens, live, counts):
        graph = self.compiled
        windows = []

        def spy(*args):
            windows.append(args[-1] if args[5] is not None else None)  # (args[5]: the padded store, or None)
            return graph(*args)

        self.compiled = spy
        try:
            return original(self, adapter, group, bturn, tokens, live, counts)
        finally:
            self.compiled = graph
            seen.append((group.batch_size, list(counts), list(live), windows[0] if windows else None))

    monkeypatch.setattr(StaticBatchStep, "__call__", recording)
    return seen


def compiled(model, inputs, cfg, n=N, **kw):
    return _gen(model, inputs, cfg, n=n, output_logits=True, cache_implementation="static",
                compile_config=compile_config(), **kw)


def assert_same_row(row, ref):
    """`assert_same_cache`, with Gated DeltaNet states compared as what they hold: the recurrent state and the conv
    window always, the prefix checkpoint and P_tail where both caches keep them (a compiled step keeps P_tail's
    columns even with nothing pending, the fixed layout; a dynamic cache drops them then)."""
    if not ref.gdn_states:
        assert_same_cache(row, ref)
        return
    n = ref.length
    for a, b in zip(row.layers, ref.layers):
        assert a.is_initialized == b.is_initialized
        if b.is_initialized:
            torch.testing.assert_close(a.keys[:, :, :n], b.keys[:, :, :n], **TOL)
            torch.testing.assert_close(a.values[:, :, :n], b.values[:, :, :n], **TOL)
    assert row.gdn_states.keys() == ref.gdn_states.keys()
    for idx, state in ref.gdn_states.items():
        mine = row.gdn_states[idx]
        torch.testing.assert_close(mine.recurrent, state.recurrent, **TOL)
        torch.testing.assert_close(mine.conv, state.conv, **TOL)
        assert (mine.prefix is None) == (state.prefix is None)
        if state.prefix is not None:
            torch.testing.assert_close(mine.prefix.recurrent, state.prefix.recurrent, **TOL)
            torch.testing.assert_close(mine.prefix.conv, state.prefix.conv, **TOL)
            torch.testing.assert_close(mine.transition, state.transition, **TOL)


def assert_rows_equal(out, ref, width, rows, ref_width=None, ref_rows=None, eos=None):
    """Rows `rows` of batch output `out` equal rows `ref_rows` of `ref` (tokens, and step logits while the row
    runs: up to its `eos`; a stopped row's logits are padding's)."""
    ref_width = width if ref_width is None else ref_width
    for i, j in zip(rows, rows if ref_rows is None else ref_rows):
        new = ref.sequences[j, ref_width:].tolist()
        assert out.sequences[i, width:width + len(new)].tolist() == new, f"row {i}"
        ran = new.index(eos) + 1 if eos in new else len(new)
        for step, (a, b) in enumerate(zip(out.logits[:ran], ref.logits[:ran])):
            torch.testing.assert_close(a[i], b[j], **TOL, msg=f"row {i} step {step}")


FOLLOW = [{"role": "user", "content": [{"type": "image", "image": make_image(9, (64, 96))},
                                       {"type": "text", "text": "And this one?"}]}]


def test_compiled_static_batch_equals_batch1_and_the_shared_engine(family, steps):
    """A mixed batch, two turns (the second with a new image in every row: new plans, and what each row left
    pending folded into its prefill), then new conversations: every row equals its batch-1 compiled run and the
    dynamic shared engine; two graphs in all (decode-only and fused, at B = 4), never recompiled."""
    model, processor = family
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="next_turn")
    batch = _inputs(processor, CONVERSATIONS)
    width = batch["input_ids"].shape[1]
    alone_runs = []
    for conversation in CONVERSATIONS:  # each row alone, compiled at B = 1 (graphs of their own)
        alone = _inputs(processor, [conversation])
        alone_runs.append((alone, compiled(model, alone, cfg)))
    before = graphs()
    out = compiled(model, batch, cfg)
    assert graphs() == before + 2
    fused = [s for s in steps if s[0] == len(CONVERSATIONS) and any(s[1])]
    assert len(steps) == N - 1 and fused  # every decode step of the batch ran compiled, fused ones among them
    group = output_cache(out)
    assert isinstance(group, BatchedDeferredPrefillCache) and group.static
    eager = _gen(model, batch, cfg, n=N, output_logits=True)  # the dynamic shared engine
    assert torch.equal(out.sequences, eager.sequences)
    assert_rows_equal(out, eager, width, range(len(CONVERSATIONS)))
    for i, (alone, ref) in enumerate(alone_runs):
        assert_rows_equal(out, ref, width, [i], alone["input_ids"].shape[1], [0])
        row = group.rows[i]
        assert group.row_turn_stats[i] == output_cache(ref).turn_stats == output_cache(eager).row_turn_stats[i]
        assert row.token_ids == output_cache(ref).token_ids
        assert_same_row(row, output_cache(eager).rows[i])
        assert_same_row(row, output_cache(ref))
        record = row.turn_stats[0]  # exactly once: carried during decode, or still pending
        assert record.deferred == record.restored_during_decode + record.pending_at_answer_end == row.total_deferred
    assert group.row_pending == output_cache(eager).row_pending and group.row_pending[1] > 0
    capacity = group.capacity

    # turn 2: every row continues (the batch cache passed back), each with a new image
    rows = list(range(len(CONVERSATIONS)))
    turn2 = _next_turn_batch(processor, batch, out, rows, FOLLOW)
    pending = group.row_pending
    out2 = compiled(model, turn2, cfg, **cache_argument(group))
    eager2 = _gen(model, turn2, cfg, n=N, output_logits=True, **cache_argument(output_cache(eager)))
    width2 = turn2["input_ids"].shape[1]
    assert output_cache(out2) is group and group.capacity == capacity
    assert torch.equal(out2.sequences, eager2.sequences)
    assert_rows_equal(out2, eager2, width2, rows)
    assert group.row_turn_stats == output_cache(eager2).row_turn_stats
    for i, row in enumerate(group.rows):
        assert row.turn_stats[1].restored_in_prefill == pending[i]
        ref_plans = output_cache(eager2).row_plans[i]
        assert [p.deferred.tolist() for p in row.plans] == [p.deferred.tolist() for p in ref_plans]
        assert_same_row(row, output_cache(eager2).rows[i])
    assert any(any(s[1]) for s in steps[len(fused):])
    assert graphs() == before + 2  # the same two graphs: other plans, another turn
    # one graph per step kind's function (`decode.CompiledByStepKind`: a decode step checks only its own guards)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from hf_raincheck.generation import shared_static

    for body in (shared_static._batch_decode_step_graph, shared_static._batch_fused_step_graph):
        assert len(_debug_get_cache_entry_list(body.__code__)) == 1, body.__name__

    # ... and every row's turn 2 equals its batch-1 compiled conversation's turn 2 (graphs at B = 1 of their own)
    for i, (alone, ref) in enumerate(alone_runs):
        alone2 = _next_turn_batch(processor, alone, ref, [0], FOLLOW)
        ref2 = compiled(model, alone2, cfg, **cache_argument(output_cache(ref)))
        assert_rows_equal(out2, ref2, width2, [i], alone2["input_ids"].shape[1], [0])
        assert group.row_turn_stats[i] == output_cache(ref2).turn_stats
        assert_same_row(group.rows[i], output_cache(ref2))
    before = graphs()

    # new conversations of the same batch size and capacity (other images, other plans): still the same graphs
    others = [_messages([make_image(5, (96, 64))], "Shapes?"), _messages([], "Hello there"),
              _messages([make_image(6), make_image(7, (64, 64))], "Which is brighter?"),
              _messages([make_image(8)], "Count the colours, please")]
    batch3 = _inputs(processor, others)
    out3 = compiled(model, batch3, cfg)
    assert output_cache(out3).capacity == capacity and graphs() == before
    eager3 = _gen(model, batch3, cfg, n=N, output_logits=True)
    assert_rows_equal(out3, eager3, batch3["input_ids"].shape[1], range(len(others)))



@pytest.mark.parametrize("completion", ["blocking", "next_turn"])
def test_rows_stopping_early_keep_restoring_in_compiled_steps(family, steps, completion):
    """A row that stops early (EOS) is fed nothing more but keeps restoring its deferred tokens in the compiled
    fused steps (``blocking``), or leaves them for its next turn (``next_turn``), exactly as the dynamic shared
    engine; every row's deferred tokens are prefilled exactly once; a binding ``step_deferred_budget`` cuts the
    carries as there."""
    model, processor = family
    conversations = [CONVERSATIONS[1], CONVERSATIONS[0], CONVERSATIONS[3]]
    batch = _inputs(processor, conversations)
    width = batch["input_ids"].shape[1]
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=1, completion=completion, step_deferred_budget=4)
    probe = _gen(model, batch, cfg, n=N)
    new = probe.sequences[:, width:].tolist()
    stop = next(t for t in new[0][1:4] if t not in new[1] and t not in new[2])  # row 0 stops early, the others not
    kw = dict(eos_token_id=stop, pad_token_id=0)
    out = compiled(model, batch, cfg, n=N + 4, **kw)
    eager = _gen(model, batch, cfg, n=N + 4, output_logits=True, **kw)
    assert torch.equal(out.sequences, eager.sequences)
    assert_rows_equal(out, eager, width, range(len(conversations)), eos=stop)
    stopped = [s for s in steps if not s[2][0]]
    assert stopped and any(s[1][0] for s in stopped) == (completion == "blocking")  # restoring after its stop
    assert any(sum(s[1]) == 4 and any(0 < c < 3 for c in s[1]) for s in steps)  # the budget did bind
    # each row carries at most ceil(4 / 3) = 2 a step, so the fused graph is [3, 2 + 1], not [3, chunk_size + 1]
    assert {s[3] for s in steps if any(s[1])} == {2} and max(max(s[1]) for s in steps) == 2
    group, ref = output_cache(out), output_cache(eager)
    assert group.row_turn_stats == ref.row_turn_stats and group.row_pending == ref.row_pending
    # Qwen3.5: the fused steps left their GDN joins pending, and the call's end folded every one in
    assert bool(group.gdn_buffers) == bool(group.rows[0].gdn_states)
    assert all("pending" in b and not b["pending"].any() for b in group.gdn_buffers.values())
    for i, row in enumerate(group.rows):
        record = row.turn_stats[0]
        assert record.deferred == record.restored_during_decode + record.pending_at_answer_end > 0
        assert row.token_ids == ref.rows[i].token_ids
        if completion == "blocking":
            assert record.restored_after_answer == record.pending_at_answer_end and row.pending == 0
            assert bool(row.filled_prefix(row.length).all())  # every slot restored once, nothing else marked
        else:
            assert row.pending == record.pending_at_answer_end
        assert_same_row(row, ref.rows[i])
    assert int(group.filled.sum()) == sum(int(r.filled_prefix(r.length).sum()) for r in group.rows)  # no scratch


def test_eager_steps_between_compiled_ones(family, steps):
    """A custom schedule whose carry sometimes exceeds ``chunk_size``: those steps run the eager shared step on the
    same buffers (Qwen3.5: building new GDN states, which the next compiled step copies back into the batch's
    buffers), the others compiled; every row equals the dynamic shared engine, at every step and in its cache."""
    model, processor = family
    carries = [0, 2, 7, 1, 3, 9, 0, 2, 5, 3]
    schedule = lambda step, pending: min(pending, carries[step - 1] if step <= len(carries) else 3)  # noqa: E731
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, schedule=schedule, completion="blocking")
    batch = _inputs(processor, CONVERSATIONS)
    out = compiled(model, batch, cfg, n=10)
    eager = _gen(model, batch, cfg, n=10, output_logits=True)
    assert len(steps) < 9 and any(any(s[1]) for s in steps)  # some steps compiled, fused among them, some eager
    assert torch.equal(out.sequences, eager.sequences)
    assert_rows_equal(out, eager, batch["input_ids"].shape[1], range(len(CONVERSATIONS)))
    group, ref = output_cache(out), output_cache(eager)
    assert group.row_turn_stats == ref.row_turn_stats
    for row, ref_row in zip(group.rows, ref.rows):
        assert_same_row(row, ref_row)


def test_an_interrupted_compiled_step_rolls_every_row_back(family, monkeypatch):
    """Ctrl-C after a compiled fused step marked its slots inside the graph (while its progress is being counted):
    every row's transaction puts the row back as before the step (filled mask, plan progress, tokens, counters),
    and the rows' locks are free. Qwen3.5: the step had updated the rows' GDN states in place, which no rollback
    restores, so the rows then refuse to continue, with an error that says why (rule 8)."""
    import dataclasses

    import hf_raincheck.generation.shared_static as shared_static

    model, processor = family
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=1, completion="next_turn")
    batch = _inputs(processor, CONVERSATIONS[:3])
    before = []
    original = StaticBatchStep.__call__

    def snapshot(self, adapter, group, bturn, tokens, live, counts):
        if any(counts):
            before.append([(r.filled_prefix(group.capacity).clone(), [p.restored for p in r.plans], r.token_ids,
                            dataclasses.astuple(r.stats), [dataclasses.astuple(t) for t in r.turn_stats])
                           for r in group.rows])
        return original(self, adapter, group, bturn, tokens, live, counts)

    count_restored = shared_static.count_restored

    def interrupted_at_the_second_fused_step(cache, plan, count):
        if len(before) == 2:
            raise KeyboardInterrupt
        count_restored(cache, plan, count)

    group = BatchedDeferredPrefillCache([None] * 3)
    monkeypatch.setattr(StaticBatchStep, "__call__", snapshot)
    monkeypatch.setattr(shared_static, "count_restored", interrupted_at_the_second_fused_step)
    with pytest.raises(KeyboardInterrupt):
        compiled(model, batch, cfg, **cache_argument(group))
    assert len(before) == 2
    for row, (filled, restored, tokens, stats, turns) in zip(group.rows, before[-1]):
        assert torch.equal(row.filled_prefix(group.capacity), filled)
        assert [p.restored for p in row.plans] == restored and row.token_ids == tokens
        assert dataclasses.astuple(row.stats) == stats and [dataclasses.astuple(t) for t in row.turn_stats] == turns
        assert row.lock.acquire(blocking=False)
        row.lock.release()
    assert group.active_turn is None and group.forward_context is None
    if model.config.model_type == "qwen3_5":  # rule 8's one exception: the step had updated GDN states in place
        with pytest.raises(RuntimeError, match="cannot continue: a compiled static batch step was interrupted"):
            compiled(model, batch, cfg, **cache_argument(group))


def test_a_new_static_batch_takes_a_freed_batchs_buffers(family):
    """A freed static batch's buffers (KV, filled mask, padded store) go to the static buffer pool once no row
    cache views them, so the next batch of the same size and capacity takes those very tensors (its CUDA graphs
    replay instead of recording again); a row kept after its batch keeps its entries: its buffers are not handed
    out."""
    import gc

    model, processor = family
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=1, completion="next_turn")
    batch = _inputs(processor, CONVERSATIONS)
    run = lambda: compiled(model, batch, cfg, n=6)  # noqa: E731
    out = run()
    first = dict(output_cache(out).pooled)  # (held: their memory cannot be reused by chance)
    assert {"filled", "store.embeds"} <= first.keys() and any(k.endswith(".keys") for k in first)
    assert output_cache(out).store_buffers["embeds"] is first["store.embeds"]
    kept = output_cache(out).split()[1]
    keys = next(layer.keys for layer in kept.layers if layer.is_initialized)
    before = keys[:, :, : kept.length].clone()
    del out
    gc.collect()
    again = run()
    second = dict(output_cache(again).pooled)
    assert not any(second[k] is first[k] for k in second)  # row 1 still views the first batch's buffers
    torch.testing.assert_close(keys[:, :, : kept.length], before, atol=0, rtol=0)
    del kept, keys, again
    gc.collect()
    third = run()
    assert all(t is second[k] or t is first[k] for k, t in output_cache(third).pooled.items())
    assert output_cache(third).pooled.keys() == second.keys()


def test_a_row_still_viewing_a_freed_batchs_gdn_states_keeps_them(tiny_qwen3_5_path):
    """Qwen3.5: a row moved to another batch's KV buffers keeps viewing its freed static batch's GDN state buffers
    until its next forward replaces them; those buffers stay out of the pool meanwhile (the next static batch of
    the same shape takes others, the row's states are intact), and go back once no row views them."""
    import gc

    model, processor = load_tiny_qwen3_5(tiny_qwen3_5_path)
    model = enable_raincheck(model)
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=1, completion="next_turn")
    batch = _inputs(processor, CONVERSATIONS)
    out = compiled(model, batch, cfg, n=6)
    rows = output_cache(out).split()
    first = {name: t for name, t in output_cache(out).pooled.items() if name.startswith("gdn")}
    assert first and all(any(s.state.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                                 for t in first.values()) for s in rows[1].gdn_states.values())
    moved = BatchedDeferredPrefillCache(rows)  # (a dynamic batch: the rows' KV move to its buffers, GDN states not)
    moved.share_buffers(max(r.length for r in rows))
    saved = {idx: (s.state.clone(), s.conv.clone()) for idx, s in rows[1].gdn_states.items()}
    del out
    gc.collect()
    again = compiled(model, batch, cfg, n=6)
    second = {name: t for name, t in output_cache(again).pooled.items() if name.startswith("gdn")}
    assert second.keys() == first.keys() and not any(second[k] is first[k] for k in second)
    for idx, (state, conv) in saved.items():
        assert torch.equal(rows[1].gdn_states[idx].state, state) and torch.equal(rows[1].gdn_states[idx].conv, conv)
    for row in rows:
        row.detach_shared()  # (its own GDN states now: the first batch's buffers are free)
    del again
    gc.collect()
    third = compiled(model, batch, cfg, n=6)
    assert all(t is first[k] or t is second[k] for k, t in output_cache(third).pooled.items() if k in first)


class _CountingDict(dict):
    """A row's ``gdn_states`` that counts lookups (`sync_gdn_states` visiting the row)."""

    lookups = 0

    def __getitem__(self, key):
        type(self).lookups += 1
        return super().__getitem__(key)


def test_gdn_states_sync_skips_the_rows_until_a_state_is_rebound(tiny_qwen3_5_path):
    """Qwen3.5: `BatchedDeferredPrefillCache.sync_gdn_states` runs before every compiled batch step; when no GDN state
    anywhere rebound a tensor since its last call it returns without visiting the rows (a compiled step updates the
    batch buffers in place), and once one row's state is rebound (an eager forward builds new tensors) it copies
    that row back into the batch buffer and points the row at its view again."""
    model, processor = load_tiny_qwen3_5(tiny_qwen3_5_path)
    model = enable_raincheck(model)
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=1, completion="next_turn")
    out = compiled(model, _inputs(processor, CONVERSATIONS), cfg, n=6)
    group = output_cache(out)
    buffers = group.sync_gdn_states()
    for row in group.rows:
        row.gdn_states = _CountingDict(row.gdn_states)
    _CountingDict.lookups = 0
    assert group.sync_gdn_states() is buffers and _CountingDict.lookups == 0  # nothing rebound: the rows not visited
    idx = sorted(buffers)[0]
    layer = group.rows[2].gdn_states[idx]
    view = buffers[idx]["views"][2]["state"]
    assert layer.state is view
    rebound = layer.state + 1.0  # what an eager forward does: a new tensor
    layer.state = rebound
    _CountingDict.lookups = 0
    group.sync_gdn_states()
    assert _CountingDict.lookups > 0 and layer.state is view and torch.equal(view, rebound)
    _CountingDict.lookups = 0
    group.sync_gdn_states()
    assert _CountingDict.lookups == 0


class _FirstToken(StoppingCriteria):
    """Stops every row after its first token (benchmarks/batch.py's first-token calls)."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.ones((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("policy", ["full", "hard", "raincheck"])
def test_a_first_token_call_of_a_static_qwen3_5_batch_runs_only_its_prefill(tiny_qwen3_5_path, steps, monkeypatch,
                                                                              policy):
    """Qwen3.5, a static batch's call that ends after its first token (a TTFT call): no compiled step runs and the
    rows' pending stores are not copied into the batch's padded store buffers (its first fused step copies them);
    the prefill's GDN kernels run each row's rows on its V value columns, not V + K: nothing is pending before a
    first prefill, so P_tail's columns ride along only after a Raincheck row's boundary (its tail). Afterwards every
    row's GDN states are in the fixed layout (P_tail = I where nothing is pending) with the dynamic shared engine's
    states and checkpoints, and the batch's next call runs its compiled steps like the dynamic engine."""
    from hf_raincheck.gdn_state import kernels

    model, processor = load_tiny_qwen3_5(tiny_qwen3_5_path)
    model = enable_raincheck(model)
    text = model.config.get_text_config()
    value_dim, key_dim = text.linear_value_head_dim, text.linear_key_head_dim
    n_gdn = sum(t == "linear_attention" for t in text.layer_types)
    calls = []
    original = kernels.gated_delta

    def recording(backend, q, k, v, g, beta, state, *args, **kwargs):
        calls.append((q.shape[0], q.shape[1], v.shape[-1]))
        return original(backend, q, k, v, g, beta, state, *args, **kwargs)

    cfg = RaincheckConfig(policy=policy, retention=0.3, chunk_size=3, guard_tokens=1, completion="next_turn")
    batch = _inputs(processor, CONVERSATIONS)
    first = StoppingCriteriaList([_FirstToken()])
    monkeypatch.setattr(kernels, "gated_delta", recording)
    out = compiled(model, batch, cfg, stopping_criteria=first)
    monkeypatch.setattr(kernels, "gated_delta", original)
    ref = _gen(model, batch, cfg, stopping_criteria=first)
    group, ref_group = output_cache(out), output_cache(ref)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert steps == [] and group.store_buffers is None
    wide = [(batch_rows, rows, width) for batch_rows, rows, width in calls if width != value_dim]
    assert all(width == value_dim + key_dim for _, _, width in wide)
    tails = [row.length - row.plan.boundary for row in group.rows if row.plan is not None and row.plan.pending]
    # the rows with a boundary run their tails together, right-aligned: one call per layer over the longest tail
    assert [(batch_rows, rows) for batch_rows, rows, _ in wide] == n_gdn * ([(len(tails), max(tails))] if tails else [])
    assert bool(tails) == (policy == "raincheck")
    for row, ref_row in zip(group.rows, ref_group.rows):
        assert row.plan is None or row.plan.pending == (ref_row.plan.pending if ref_row.plan else 0)
        for idx, state in row.gdn_states.items():
            assert state.fixed and state.carry == key_dim
            if state.prefix is None:  # nothing pending: P_tail = I
                eye = torch.eye(key_dim).expand_as(state.transition)
                torch.testing.assert_close(state.transition, eye, atol=0, rtol=0)
        assert_same_row(row, ref_row)
    # the next call continues every row (its pending tokens folded into its prefill) through compiled steps
    nxt = _next_turn_batch(processor, batch, out, range(len(CONVERSATIONS)), FOLLOW)
    again = compiled(model, nxt, cfg, **cache_argument(group))
    ref_again = _gen(model, nxt, cfg, n=N, **cache_argument(ref_group), output_logits=True)
    assert_rows_equal(again, ref_again, nxt["input_ids"].shape[1], range(len(CONVERSATIONS)))
    assert steps


def row_write_case(device="cpu"):
    """``(buffer, slots, states, expected)`` of a batch's KV write: three rows, each writing four entries to slots of
    its own, ``expected`` the buffer after the writes (a reference loop)."""
    generator = torch.Generator().manual_seed(0)
    buffer = torch.randn(3, 2, 37, 8, generator=generator)
    slots = torch.tensor([[0, 5, 6, 36], [1, 2, 3, 4], [30, 10, 20, 9]])
    states = torch.randn(3, 2, 4, 8, generator=generator)
    expected = buffer.clone()
    for b in range(3):
        for r in range(4):
            expected[b, :, slots[b, r]] = states[b, :, r]
    return tuple(t.to(device) for t in (buffer, slots, states, expected))


def test_row_writes_store_only_the_written_entries_when_compiled():
    """`write_rows_` (a batch's KV writes: row b's entries to its own slots) gives the reference writes eager and
    compiled by Inductor, and the compiled kernel stores only the written entries: no loop over the whole buffer
    (``scatter_`` on a graph input compiled to a copy of the buffer, the scatter and a copy back)."""
    from torch._inductor.utils import run_and_get_code

    from hf_raincheck.cache.batched import write_rows_

    buffer, slots, states, expected = row_write_case()
    eager = buffer.clone()
    assert write_rows_(eager, slots, states) is eager
    assert torch.equal(eager, expected)

    compiled = buffer.clone()
    _, (code, *_) = run_and_get_code(torch.compile(write_rows_, backend="inductor", fullgraph=True), compiled, slots,
                                     states)
    assert torch.equal(compiled, expected)
    assert f"{buffer.numel()}L" not in code, "the compiled write runs over the whole buffer"
