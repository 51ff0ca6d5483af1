"""Each state change of a turn commits whole or not at all (`DeferredPrefillCache.transaction`).

Targeted versions of the windows a line-level interrupt found (tests/test_interrupts.py injects at every line):
an interrupt after a forward but inside its bookkeeping leaves the cache exactly as before the call or step, and
the README's recovery (continue with ``cache.token_ids`` + the new turn) then equals an uninterrupted run.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from fault_injection import Injector, LineRecorder, distinct_points, package_files  # noqa: E402
from handmade import _conv, _extend, _tiny_model  # noqa: E402
from helpers import generate, new_tokens  # noqa: E402

from hf_raincheck import DeferredPrefillCache, RaincheckConfig, complete_deferred, enable_raincheck  # noqa: E402
from hf_raincheck.generation import background  # noqa: E402
from hf_raincheck.generation.state import raincheck_state  # noqa: E402

EXACT = dict(atol=0, rtol=0)
CFG = dict(retention=0.3, chunk_size=2, guard_tokens=1, pruning="uniform")


@pytest.fixture(scope="module")
def model():
    return enable_raincheck(_tiny_model("eager"))


def new_cache(model):
    return DeferredPrefillCache(raincheck_state(model, "test").adapter.num_cache_layers())


def summary(cache) -> dict:
    return dict(
        length=cache.length, token_ids=list(cache.token_ids), stats=asdict(cache.stats),
        turn_stats=[asdict(t) for t in cache.turn_stats], plans=[(p.total_deferred, p.restored) for p in cache.plans],
        pending=cache.pending, holes=cache.holes, filled=cache.filled.tolist(), media_grids=dict(cache.media_grids),
        rope_delta=cache.rope_delta,
        gdn={i: s.snapshot() for i, s in cache.gdn_states.items()},
    )


def assert_same(a: dict, b: dict) -> None:
    for key in a:
        if key == "media_grids":
            assert a[key].keys() == b[key].keys() and all(torch.equal(a[key][k], b[key][k]) for k in a[key])
        elif key == "gdn":
            assert a[key].keys() == b[key].keys()
        else:
            assert a[key] == b[key], key


def turns(seed=0):
    """Turn 1: text, one image (16 placeholders, 11 of them deferred), text."""
    return _conv([(1, 8, 8)], [3, 4], seed=seed)


def second_turn(first, answer):
    """Turn 1, its answer, two text tokens and a new image with text: the whole conversation's inputs."""
    grown = _extend(_extend(first, answer), [7, 8])
    image = _conv([(1, 8, 8)], [2, 3], seed=5)
    out = dict(grown)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        out[key] = torch.cat([grown[key], image[key]], dim=1)
    out["pixel_values"] = torch.cat([first["pixel_values"], image["pixel_values"]])
    out["image_grid_thw"] = torch.cat([first["image_grid_thw"], image["image_grid_thw"]])
    return out


class Once:
    """Raises KeyboardInterrupt at the `at`-th call of the wrapped method (counted from 1), after it ran when
    `after` (the bookkeeping half-done), else before."""

    def __init__(self, monkeypatch, owner, name, at, after=True, when=None):
        self.calls = 0
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if when is not None and not when(*args, **kwargs):
                return original(*args, **kwargs)
            self.calls += 1
            if self.calls == at and not after:
                raise KeyboardInterrupt
            result = original(*args, **kwargs)
            if self.calls == at:
                raise KeyboardInterrupt
            return result

        monkeypatch.setattr(owner, name, wrapped)


def test_an_interrupted_prefill_commit_leaves_the_cache_as_before(model, monkeypatch):
    """The window of `_turn_step`: tokens, plan, grids, turn record and counters recorded, then an interrupt.
    Turn 2 folds turn 1's pending tokens and adds a new image; interrupted inside its prefill's bookkeeping (the
    folded tokens counted, the new plan and record in), the cache is as after turn 1, and redoing turn 2 with the
    whole conversation's processor outputs equals the uninterrupted run."""
    cfg = RaincheckConfig(completion="next_turn", **CFG)
    first = turns()
    reference = new_cache(model)
    out1 = generate(model, first, 4, cfg, past=reference)
    conv2 = second_turn(first, new_tokens(out1, first))
    expected = generate(model, conv2, 4, cfg, past=reference)

    cache = new_cache(model)
    generate(model, first, 4, cfg, past=cache)
    before = summary(cache)
    assert cache.pending > 0
    Once(monkeypatch, DeferredPrefillCache, "record_restored", at=1,
         when=lambda self, when, count: when == "during_prefill")
    with pytest.raises(KeyboardInterrupt):
        generate(model, conv2, 4, cfg, past=cache)
    assert_same(summary(cache), before)
    monkeypatch.undo()
    again = generate(model, conv2, 4, cfg, past=cache)
    torch.testing.assert_close(torch.stack(again.logits), torch.stack(expected.logits), **EXACT)
    assert_same(summary(cache), summary(reference))


def test_an_interrupted_decode_step_is_not_half_counted(model, monkeypatch):
    """The window of `decode_step` (and `run_rows`): the step's chunk restored and counted, then an interrupt
    before the fed token is recorded. The step is undone whole: the cache equals an answer one token shorter, and
    continuing from ``cache.token_ids`` equals the uninterrupted conversation."""
    cfg = RaincheckConfig(completion="next_turn", **CFG)
    first = turns()
    cache = new_cache(model)
    # decode step 3 carries a chunk (guard 1); it is interrupted after it was counted
    Once(monkeypatch, DeferredPrefillCache, "append_fed_token", at=3)
    with pytest.raises(KeyboardInterrupt):
        generate(model, first, 6, cfg, past=cache)
    monkeypatch.undo()
    shorter = new_cache(model)
    generate(model, first, 3, cfg, past=shorter)  # steps 1..2 fed (y_1, y_2), y_3 sampled and not fed
    assert_same(summary(cache), summary(shorter))
    assert cache.turn_stats[0].pending_at_answer_end == cache.pending
    follow = _extend(first, cache.token_ids[first["input_ids"].shape[1]:] + [7, 8])
    a = generate(model, follow, 3, cfg, past=cache)
    b = generate(model, follow, 3, cfg, past=shorter)
    torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), **EXACT)


def test_an_interrupted_completion_chunk_is_still_pending(model, monkeypatch):
    """A completion chunk interrupted after its counters: the chunk is still pending, nothing counted."""
    cfg = RaincheckConfig(completion="next_turn", **CFG)
    cache = new_cache(model)
    generate(model, turns(), 3, cfg, past=cache)
    before = summary(cache)
    Once(monkeypatch, DeferredPrefillCache, "record_restored", at=1)
    with pytest.raises(KeyboardInterrupt):
        complete_deferred(model, cache, max_tokens=2)
    assert_same(summary(cache), before)
    monkeypatch.undo()
    assert complete_deferred(model, cache) == before["pending"] and cache.holes == 0


def test_token_ids_read_never_duplicates_the_tail(model):
    """`token_ids` folds the decode tokens still on the device into the host list in one assignment: an
    interrupt at any line of the read leaves the old pair or the new one, and a later read is exact."""
    cfg = RaincheckConfig(completion="next_turn", **CFG)
    first = turns()

    def answered():
        cache = new_cache(model)
        out = generate(model, first, 4, cfg, past=cache)
        return cache, out.sequences[0, :-1].tolist()

    files = package_files("cache/deferred_cache.py")
    cache, expected = answered()
    recorder = LineRecorder(files)
    with recorder:
        assert cache.token_ids == expected
    points = distinct_points(recorder.events, "all")
    assert len(points) >= 3
    for point in points:
        cache, expected = answered()
        injector = Injector(files, point)
        with pytest.raises(KeyboardInterrupt):
            with injector:
                cache.token_ids
        assert injector.fired
        assert cache.length == len(expected) and cache.token_ids == expected, point


def test_a_worker_whose_start_was_interrupted_is_not_waited_for(model, monkeypatch):
    """The worker is recorded on the cache before its thread starts; if the start is interrupted, nobody waits
    for a thread that never ran, and the next call folds what is pending."""
    cfg = RaincheckConfig(completion="background", **CFG)
    first = turns()
    cache = new_cache(model)
    Once(monkeypatch, background.BackgroundCompletion, "start", at=1, after=False)
    with pytest.raises(KeyboardInterrupt):
        out = generate(model, first, 3, cfg, past=cache)
    monkeypatch.undo()
    worker = cache.completion_worker
    assert worker is not None and not worker.started and not cache.completion_running
    assert cache.wait(5) is False and cache.pending > 0  # returns at once: nothing runs
    out = generate(model, _extend(first, cache.token_ids[first["input_ids"].shape[1]:] + [7]), 2,
                   RaincheckConfig(completion="blocking", **CFG), past=cache)
    assert out is not None and cache.pending == 0 and cache.holes == 0


# ---------------------------------------------------------------- compiled static steps
def _compile_config():
    from transformers.generation.configuration_utils import CompileConfig

    config = CompileConfig(backend="eager", fullgraph=True, dynamic=False)
    config._compile_all_devices = True  # compile on the CPU too (transformers' own switch)
    return config


def _interrupt_after_fused_step(monkeypatch):
    """KeyboardInterrupt right after the first compiled step that carried a chunk has run (its writes done, its
    bookkeeping not)."""
    from hf_raincheck.generation.decode import StaticStep

    original = StaticStep._run
    fired = []

    def run(self, cache, turn, count, token, slot, chunk):
        result = original(self, cache, turn, count, token, slot, chunk)
        if chunk is not None and not fired:
            fired.append(slot)
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(StaticStep, "_run", run)
    return fired


def _interrupted_compiled_answer(model, monkeypatch):
    """A first answer with compiled static steps, interrupted right after a fused step (dynamo reset first):
    returns (config, first turn, static generate kwargs, the interrupted cache)."""
    torch._dynamo.reset()
    cfg = RaincheckConfig(completion="next_turn", **CFG)
    first = turns()
    static = dict(cache_implementation="static", compile_config=_compile_config())
    cache = DeferredPrefillCache(raincheck_state(model, "test").adapter.num_cache_layers(), static=True)
    fired = _interrupt_after_fused_step(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        generate(model, first, 6, cfg, past=cache, **static)
    monkeypatch.undo()
    assert fired
    return cfg, first, static, cache


def test_an_interrupted_compiled_step_of_an_attention_model_is_undone(model, monkeypatch):
    """Attention-only model, compiled static steps: the step's KV writes land in slots it unmarks again, so the
    cache equals an answer one token shorter and the conversation goes on exactly."""
    cfg, first, static, cache = _interrupted_compiled_answer(model, monkeypatch)
    fed = cache.length - first["input_ids"].shape[1]
    shorter = DeferredPrefillCache(raincheck_state(model, "test").adapter.num_cache_layers(), static=True)
    generate(model, first, fed + 1, cfg, past=shorter, **static)
    assert_same(summary(cache), summary(shorter))
    follow = _extend(first, cache.token_ids[first["input_ids"].shape[1]:] + [7, 8])
    a = generate(model, follow, 3, cfg, past=cache, **static)
    b = generate(model, follow, 3, cfg, past=shorter, **static)
    torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), **EXACT)
    torch._dynamo.reset()


def test_an_interrupted_compiled_gdn_step_refuses_to_go_on(monkeypatch):
    """Qwen3.5, compiled static steps: they update the Gated DeltaNet states in place, which no rollback can undo;
    interrupted after such a step started, the cache refuses every later call with a clear error instead of
    continuing from states that do not match its bookkeeping."""
    from handmade_qwen3_5 import tiny_qwen3_5

    torch._dynamo.reset()
    hybrid = enable_raincheck(tiny_qwen3_5("eager"))
    cfg, first, static, cache = _interrupted_compiled_answer(hybrid, monkeypatch)
    follow = _extend(first, cache.token_ids[first["input_ids"].shape[1]:] + [7, 8])
    with pytest.raises(RuntimeError, match="generate: this DeferredPrefillCache cannot continue: a compiled static "
                                           "step was interrupted"):
        generate(hybrid, follow, 2, cfg, past=cache, **static)
    with pytest.raises(RuntimeError, match="complete_deferred: .* start a new conversation"):
        complete_deferred(hybrid, cache)
    torch._dynamo.reset()
