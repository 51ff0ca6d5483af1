"""Raincheck on a hybrid Qwen3.5 (Gated DeltaNet + full attention), against plain generate and the reference."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from handmade import _conv, _extend, _video_conv  # noqa: E402
from helpers import generate, new_tokens  # noqa: E402
from handmade_qwen3_5 import tiny_qwen3_5  # noqa: E402
from reference_qwen3_5 import build_schedule, reference_logits  # noqa: E402

from hf_raincheck import RaincheckConfig, complete_deferred, enable_raincheck  # noqa: E402
from hf_raincheck.conversation import output_cache  # noqa: E402

TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def model():
    return enable_raincheck(tiny_qwen3_5("eager"))


def two_images(seed=0):
    return _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4], seed=seed)


def logits(out):
    return torch.stack(out.logits)[:, 0]


def cfg(**kw):
    base = dict(retention=0.3, guard_tokens=2, chunk_size=3, pruning="uniform", completion="blocking")
    base.update(kw)
    return RaincheckConfig(**base)


# ---------------------------------------------------------------- plain generate
@pytest.mark.parametrize("make_inputs", [two_images, _video_conv], ids=["two_images", "image_video"])
@pytest.mark.parametrize("config", [RaincheckConfig(retention=1.0), RaincheckConfig(policy="full")], ids=["rho1", "full"])
def test_retention_one_and_full_reproduce_plain_generate(model, make_inputs, config):
    inputs = make_inputs()
    plain = generate(model, inputs, 10)
    rc = generate(model, inputs, 10, config)
    assert new_tokens(rc, inputs) == new_tokens(plain, inputs)
    torch.testing.assert_close(logits(rc), logits(plain), **TOL)
    cache = output_cache(rc)
    assert cache.total_deferred == 0 and bool(cache.filled.all())
    assert sorted(cache.gdn_states) == [0, 1, 3]
    assert all(s.prefix is None for s in cache.gdn_states.values())


def test_reference_without_deferral_is_plain_generate(model):
    """Guards the reference itself: no plan, prefill + decode rows -> transformers' own logits."""
    inputs = two_images()
    n = 6
    plain = generate(model, inputs, n)
    conv = _extend(inputs, new_tokens(plain, inputs))
    sched = build_schedule(inputs["input_ids"].shape[1], [], n)
    ref = reference_logits(model, conv, sched.forwards, [])
    torch.testing.assert_close(ref.at_many(sched.logit_rows), logits(plain), **TOL)


# ---------------------------------------------------------------- against the reference
def _check_two_turns(model, inputs, config, n1=8, n2=3, turn2_media=None):
    """Turn 1 with a plan, turn 2 (text, or a new image) on the same cache; both compared with the reference."""
    length = inputs["input_ids"].shape[1]
    out1 = generate(model, inputs, n1, config)
    cache = output_cache(out1)
    plan1 = cache.plans[0]
    d1, b1 = plan1.deferred.tolist(), plan1.boundary
    sched1 = build_schedule(
        length, d1, n1, chunk_size=config.chunk_size, guard_tokens=config.guard_tokens,
        completion=config.completion, completion_chunk_size=config.completion_chunk_size, policy=config.policy,
    )
    assert cache.pending == len(sched1.pending)
    conv = _extend(inputs, new_tokens(out1, inputs))
    if turn2_media is None:
        conv2 = _extend(conv, [5, 6, 7])
    else:
        conv2 = turn2_media(conv)
    out2 = generate(model, conv2, n2, config, past=cache)
    plans = [(d1, b1)]
    d2 = []
    if len(cache.plans) > 1:
        plan2 = cache.plans[1]
        d2 = plan2.deferred.tolist()
        plans.append((d2, plan2.boundary))
    length2 = conv2["input_ids"].shape[1]
    sched2 = build_schedule(
        length2, d2, n2, chunk_size=config.chunk_size, guard_tokens=config.guard_tokens,
        completion="blocking", completion_chunk_size=config.completion_chunk_size,
        new_start=length + n1 - 1, pending_before=sched1.pending, policy=config.policy,
    )
    full = _extend(conv2, new_tokens(out2, conv2))
    ref = reference_logits(model, full, sched1.forwards + sched2.forwards, plans, config.visibility)
    torch.testing.assert_close(logits(out1), ref.at_many(sched1.logit_rows), **TOL)
    torch.testing.assert_close(logits(out2), ref.at_many(sched2.logit_rows), **TOL)
    return cache, out2


@pytest.mark.parametrize(
    "config",
    [
        cfg(),  # restoration during decode, the rest blocking
        cfg(completion="next_turn"),  # the rest folded into turn 2's prefill
        cfg(chunk_size=1, guard_tokens=0, completion="next_turn"),
        cfg(chunk_size=31, guard_tokens=16, completion_chunk_size=4),  # everything after the answer
        cfg(visibility="causal", completion="next_turn"),
        cfg(pruning="random", retention=0.5, chunk_size=5),
    ],
    ids=["blocking", "next_turn", "chunk1", "after_answer", "causal", "random50"],
)
def test_steps_and_next_turn_match_reference(model, config):
    cache, _ = _check_two_turns(model, two_images(), config)
    assert cache.pending == 0
    assert all(s.prefix is None for s in cache.gdn_states.values())  # checkpoints freed once restored


def _add_image(conv):
    """Turn 2 brings a new image (grid 1x8x8) after some text."""
    gen = torch.Generator().manual_seed(11)
    new = _conv([(1, 8, 8)], [2, 3], seed=12)
    ids = torch.cat([conv["input_ids"], new["input_ids"]], dim=1)
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=torch.cat([conv["mm_token_type_ids"], new["mm_token_type_ids"]], dim=1),
        pixel_values=torch.cat([conv["pixel_values"], torch.randn(64, 1536, generator=gen)]),
        image_grid_thw=torch.cat([conv["image_grid_thw"], new["image_grid_thw"]]),
    )


@pytest.mark.parametrize("completion", ["next_turn", "blocking"])
def test_new_image_in_turn_two_while_turn_one_pending(model, completion):
    """Turn 1's leftover D is folded into turn 2's prefill, which also checkpoints turn 2's own boundary."""
    config = cfg(completion=completion)
    cache, _ = _check_two_turns(model, two_images(), config, n1=6, n2=8, turn2_media=_add_image)
    assert len(cache.plans) == 2 and cache.plans[1].total_deferred > 0 and cache.pending == 0


def test_video_matches_reference(model):
    _check_two_turns(model, _video_conv(), cfg(retention=0.5, completion="next_turn"))


def test_hard_matches_reference(model):
    cache, _ = _check_two_turns(model, two_images(), cfg(policy="hard"))
    assert cache.dropped == 22 and not cache.gdn_states[0].prefix


# ---------------------------------------------------------------- bookkeeping
def test_restored_state_does_not_depend_on_completion_chunks(model):
    """Rule 5: after the answer, completing D in any chunking gives the same GDN states and next turn."""
    inputs = two_images()
    runs = []
    for completion_chunk, split in [(1, None), (5, None), (256, None), (4, 7)]:
        config = cfg(completion="next_turn", completion_chunk_size=completion_chunk)
        out = generate(model, inputs, 1, config)
        cache = output_cache(out)
        if split is not None:
            complete_deferred(model, cache, max_tokens=split)
        complete_deferred(model, cache)
        assert cache.pending == 0
        conv2 = _extend(inputs, new_tokens(out, inputs) + [9, 8, 7])
        runs.append((cache, logits(generate(model, conv2, 2, config, past=cache))))
    base_cache, base_logits = runs[0]
    for cache, next_logits in runs[1:]:
        torch.testing.assert_close(next_logits, base_logits, **TOL)
        for i, s in cache.gdn_states.items():
            torch.testing.assert_close(s.recurrent, base_cache.gdn_states[i].recurrent, **TOL)
            torch.testing.assert_close(s.conv, base_cache.gdn_states[i].conv, **TOL)


def test_deferred_entries_do_not_depend_on_decode_schedule(model):
    """Deferred rows see the prefix and earlier deferred rows only, so their KV is the same whatever the chunking
    during decode (the answers themselves may differ: they see D at different steps)."""
    inputs = two_images()
    caches = []
    for chunk, guard in [(1, 0), (3, 2), (7, 1), (31, 16)]:
        out = generate(model, inputs, 6, cfg(chunk_size=chunk, guard_tokens=guard))
        caches.append(output_cache(out))
    deferred = caches[0].plans[0].deferred
    for cache in caches[1:]:
        torch.testing.assert_close(cache.layers[2].keys[:, :, deferred], caches[0].layers[2].keys[:, :, deferred], **TOL)
        torch.testing.assert_close(
            cache.layers[2].values[:, :, deferred], caches[0].layers[2].values[:, :, deferred], **TOL
        )


def test_every_deferred_token_prefilled_once(model, monkeypatch):
    from hf_raincheck.cache import SlotLayer

    writes = []
    original = SlotLayer.write

    def counting(self, key_states, value_states, slots, kv_len):
        if self is counted_layer[0]:
            writes.extend(slots.tolist())
        return original(self, key_states, value_states, slots, kv_len)

    counted_layer = [None]
    monkeypatch.setattr(SlotLayer, "write", counting)
    inputs = two_images()
    config = cfg(completion="next_turn", chunk_size=2)
    cache = None
    from hf_raincheck import DeferredPrefillCache

    cache = DeferredPrefillCache(4)
    counted_layer[0] = cache.layers[2]
    out = generate(model, inputs, 6, config, past=cache)
    assert cache.pending > 0
    complete_deferred(model, cache, max_tokens=3)
    conv = _extend(_extend(inputs, new_tokens(out, inputs)), [4, 4])
    generate(model, conv, 2, config, past=cache)
    deferred = cache.plans[0].deferred.tolist()
    assert sorted(w for w in writes if w in set(deferred)) == deferred
    assert len(writes) == len(set(writes))
    assert cache.pending == 0 and bool(cache.filled.all())


@pytest.mark.parametrize("selector", ["mmtok", "hiprune", "divprune", "visionzip", "uniform", "random"])
@pytest.mark.parametrize("policy", ["hard", "raincheck"])
def test_every_selector_runs_on_qwen3_5(model, selector, policy):
    config = RaincheckConfig(policy=policy, pruning=selector, guard_tokens=1, chunk_size=4, completion="blocking")
    for inputs in (two_images(), _video_conv()):
        cache = output_cache(generate(model, inputs, 4, config))
        kept = cache.plans[0].kept
        assert cache.total_deferred > 0 and cache.pending == 0
        assert torch.equal(kept, kept.sort().values)


def test_static_cache_matches_dynamic(model):
    inputs = two_images()
    config = cfg(completion="next_turn")
    dynamic = generate(model, inputs, 8, config)
    with torch.no_grad():
        static = model.generate(
            **inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
            return_dict_in_generate=True, raincheck_config=config, cache_implementation="static",
        )
    assert new_tokens(static, inputs) == new_tokens(dynamic, inputs)
    torch.testing.assert_close(logits(static), logits(dynamic), **TOL)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
def test_unfused_control_matches_reference_with_split_forwards(model, family):
    """``fused=False``: each carried chunk is a forward of its own before the decode row (same semantics)."""
    from handmade import _tiny_model
    from reference_qwen3_vl import reference_logits as reference_vl

    net, reference = (model, reference_logits) if family == "qwen3_5" else (enable_raincheck(_tiny_model()), reference_vl)
    inputs = two_images()
    length = inputs["input_ids"].shape[1]
    config = cfg(fused=False, completion="next_turn")
    out = generate(net, inputs, 8, config)
    plan = output_cache(out).plans[0]
    sched = build_schedule(length, plan.deferred, 8, chunk_size=3, guard_tokens=2, completion="next_turn")
    forwards = []
    for fwd in sched.forwards:
        if len(fwd) > 1 and fwd[-1] >= length:  # a fused step: chunk, then the decode row alone
            forwards += [fwd[:-1], fwd[-1:]]
        else:
            forwards.append(fwd)
    ref = reference(net, _extend(inputs, new_tokens(out, inputs)), forwards, [(plan.deferred, plan.boundary)])
    torch.testing.assert_close(logits(out), ref.at_many(sched.logit_rows), **TOL)
    fused = generate(net, inputs, 8, cfg(completion="next_turn"))
    assert output_cache(out).stats == output_cache(fused).stats


def _profiled_decode_steps(model, monkeypatch, inputs, config, steps):
    """Runs `generate` with each eager decode step under torch's profiler (a call of the GDN kernel recorded as one
    event, as `benchmarks/step_ops.py` counts it) -> ``[(kind, events)]``, kind ``"fused"`` (a deferred chunk
    carried), ``"pending"`` or ``"restored"``."""
    import hf_raincheck.generation.enable as enable_module
    from hf_raincheck.gdn_state import kernels

    original, original_kernel = enable_module.decode_step, kernels.gated_delta
    profiled_steps = []

    def gdn_kernel(*args, **kwargs):
        with torch.profiler.record_function("gdn_state.kernels.gated_delta"):
            return original_kernel(*args, **kwargs)

    def profiled(adapter, cache, turn, token):
        plan = cache.plan
        restored = plan.restored if plan is not None else None
        pending = plan is not None and plan.pending > 0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            logits = original(adapter, cache, turn, token)
        kind = "fused" if plan is not None and plan.restored != restored else "pending" if pending else "restored"
        profiled_steps.append((kind, prof.events()))
        return logits

    monkeypatch.setattr(enable_module, "decode_step", profiled)
    monkeypatch.setattr(kernels, "gated_delta", gdn_kernel)
    generate(model, inputs, steps, config)
    return profiled_steps


def test_eager_fused_steps_read_no_tensor_value_on_the_host(model, monkeypatch):
    """An eager decode step that carries a deferred chunk reads no tensor value on the host (no
    ``_local_scalar_dense``: ``.item()``, ``int(tensor)``; on a GPU each is a host-device synchronisation, and the
    GPU test of steps without one runs only there). Counted on the CPU with torch's profiler."""
    steps = _profiled_decode_steps(model, monkeypatch, two_images(), cfg(), 8)
    fused_syncs = [sum(e.name == "aten::_local_scalar_dense" for e in events) for kind, events in steps
                   if kind == "fused"]
    assert len(fused_syncs) >= 2 and fused_syncs == [0] * len(fused_syncs), fused_syncs


def test_eager_fused_step_operators_per_gdn_layer(model, monkeypatch):
    """Eager steps are host-bound on a GPU (a launch per operator), and a fused step runs every GDN layer over its
    deferred rows too: its kernel operators (as `benchmarks/step_ops.py` counts them) beyond those of a step after
    restoration (its GDN layers' extra operators and the step's own rows and mask) stay within a bound."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from step_ops import _kernel_events

    steps = _profiled_decode_steps(model, monkeypatch, two_images(), cfg(completion="next_turn"), 14)
    counts = {}
    for kind, events in steps:
        counts.setdefault(kind, []).append(len(_kernel_events(events)))
    assert set(counts) == {"fused", "pending", "restored"}, counts
    extra = max(counts["fused"]) - max(counts["restored"])
    # 3 GDN layers + 1 attention layer: 67 before the fused GDN layers ran one short conv for both segments and
    # the join as one product-and-add (`gdn_rows_forward`, `GDNLayerState.join`)
    assert extra <= 40, (counts, extra)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
def test_default_chunk_size_follows_the_model(model, family):
    """``chunk_size="auto"`` (the default): a fused step carries 63 deferred tokens on a model with Gated DeltaNet
    layers, 31 on an attention-only one; the cache keeps the config as given."""
    if family == "qwen3_vl":
        from handmade import _tiny_model

        model = enable_raincheck(_tiny_model("eager"))
    inputs = _conv([(1, 24, 24)], [3, 4])  # 144 visual tokens, 100 deferred at retention 0.3
    config = RaincheckConfig(pruning="uniform", completion="next_turn")
    out = generate(model, inputs, 18, config)  # decode steps 1..17: step 17 is the only one past the guard (16)
    cache = output_cache(out)
    chunk = RaincheckConfig.CHUNK_GDN if family == "qwen3_5" else RaincheckConfig.CHUNK_ATTENTION
    assert cache.config is config and config.for_model(family == "qwen3_5").chunk_size == chunk
    assert cache.turn_stats[-1].restored_during_decode == chunk
    assert cache.pending == 100 - chunk
