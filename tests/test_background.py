"""completion="background": the worker, preemption, cancel, errors, interrupted generate, freed model, exit."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import weakref

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from handmade import _conv, _extend, _text, _tiny_model  # noqa: E402

from hf_raincheck import DeferredPrefillCache, RaincheckConfig, complete_deferred, enable_raincheck  # noqa: E402
from hf_raincheck.conversation import cache_argument, output_cache  # noqa: E402
from hf_raincheck.generation import background  # noqa: E402

EXACT = dict(atol=1e-5, rtol=0)
N1 = 7  # answer length of turn 1: decode steps 5 and 6 carry 2 deferred tokens each, 22 - 4 = 18 stay pending
CFG = dict(retention=0.3, chunk_size=2, guard_tokens=4, completion_chunk_size=3)
QUESTION = _text(4, torch.Generator().manual_seed(2)).tolist()
TIMEOUT = 60  # seconds; only reached if the code under test is broken


@pytest.fixture(scope="module")
def model():
    return enable_raincheck(_tiny_model("eager"))


def two_images():
    return _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4])


def num_layers(model):
    return len(model.model.language_model.layers)


def generate(model, inputs, n, cfg, past=None, **kw):
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True)
    kwargs.update(kw)
    if past is not None:
        kwargs.update(cache_argument(past))
    with torch.no_grad():
        return model.generate(**inputs, raincheck_config=cfg, **kwargs)


def spy_writes(cache):
    """Logical slots written by every forward on `cache` (layer 0), from any thread."""
    writes = []
    update = cache.update

    def spy(key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            writes.extend(cache.forward_context.write_slots.tolist())
        return update(key_states, value_states, layer_idx, *args, **kwargs)

    cache.update = spy
    return writes


def turn_two(model, inputs, out, cfg):
    conv2 = _extend(inputs, out.sequences[0, inputs["input_ids"].shape[1]:].tolist() + QUESTION)
    return conv2, generate(model, conv2, 3, cfg, past=output_cache(out))


@pytest.fixture(scope="module")
def blocking_reference(model):
    """Turn 1 with completion="blocking", then turn 2: the result every other order of events must reproduce."""
    inputs = two_images()
    cfg = RaincheckConfig(completion="blocking", **CFG)
    out = generate(model, inputs, N1, cfg)
    cache = output_cache(out)
    assert cache.pending == 0 and cache.stats.during_decode == 4 and cache.stats.after_answer == 18
    _, out2 = turn_two(model, inputs, out, cfg)
    return out.sequences, torch.stack(out2.logits)


def check_consistent(cache):
    """The plan's progress, the filled mask and token_ids agree: no deferred token lost or doubled."""
    plan = cache.plan
    filled = cache.filled
    deferred = plan.deferred
    assert int(filled[deferred].sum()) == plan.restored
    assert bool(filled[deferred[: plan.restored]].all()) and not bool(filled[deferred[plan.restored:]].any())
    others = torch.ones(cache.length, dtype=torch.bool)
    others[deferred] = False
    assert bool(filled[others].all())


@pytest.fixture
def worker_pauses_after_first_chunk(monkeypatch):
    """The worker's first chunk runs, then it waits (holding the lock) until someone asks it to stop."""
    first_chunk_done = threading.Event()
    calls = []
    original = background.prefill_pending

    def pausing(state, cache, budget, chunk_size):
        done = original(state, cache, budget, chunk_size)
        calls.append(done)
        if len(calls) == 1:
            first_chunk_done.set()
            assert cache.completion_worker.stop_requested.wait(TIMEOUT), "nobody stopped the paused worker"
        return done

    monkeypatch.setattr(background, "prefill_pending", pausing)
    return first_chunk_done, calls


# ---------------------------------------------------------------- default, completion, equality with blocking
def test_background_is_the_default_completion():
    assert RaincheckConfig().completion == "background"
    with pytest.raises(ValueError, match=r"RaincheckConfig\.completion must be one of \['background', 'blocking', "
                                         r"'next_turn'\], got 'later'"):
        RaincheckConfig(completion="later")


def test_background_completion_reaches_zero_and_matches_blocking(model, blocking_reference):
    sequences, logits2 = blocking_reference
    inputs = two_images()
    cfg = RaincheckConfig(**CFG)
    cache = DeferredPrefillCache(num_layers(model))
    writes = spy_writes(cache)
    out = generate(model, inputs, N1, cfg, past=cache)
    assert out.sequences.tolist() == sequences.tolist()
    assert cache.turn_stats[0].pending_at_answer_end == 18
    assert cache.wait(timeout=TIMEOUT) is True
    assert not cache.completion_running and cache.pending == 0 and bool(cache.filled.all())
    assert cache.stats.after_answer == 18 and cache.completion_worker is None
    record = cache.turn_stats[0]
    assert (record.deferred, record.restored_during_decode, record.restored_after_answer) == (22, 4, 18)
    L = inputs["input_ids"].shape[1]
    assert sorted(writes) == list(range(L + N1 - 1))  # every slot exactly once
    _, out2 = turn_two(model, inputs, out, cfg)
    torch.testing.assert_close(torch.stack(out2.logits), logits2, **EXACT)
    assert cache.turn_stats[1].restored_in_prefill == 0
    assert cache.wait() is True  # nothing to wait for


# ---------------------------------------------------------------- preemption and cancel
def test_new_generate_preempts_the_worker_and_folds_the_rest(model, blocking_reference,
                                                             worker_pauses_after_first_chunk):
    first_chunk_done, calls = worker_pauses_after_first_chunk
    _, logits2 = blocking_reference
    inputs = two_images()
    cfg = RaincheckConfig(**CFG)
    cache = DeferredPrefillCache(num_layers(model))
    writes = spy_writes(cache)
    out = generate(model, inputs, N1, cfg, past=cache)
    assert first_chunk_done.wait(TIMEOUT)
    assert cache.completion_running and cache.pending == 18 - 3
    assert cache.wait(timeout=0.01) is False  # still running (paused)
    _, out2 = turn_two(model, inputs, out, cfg)  # stops the worker after its first chunk, folds the other 15
    assert calls == [3] and not cache.completion_running
    assert cache.turn_stats[0].restored_after_answer == 3 and cache.turn_stats[1].restored_in_prefill == 15
    assert cache.pending == 0 and bool(cache.filled.all())
    L = inputs["input_ids"].shape[1]
    conv_len = L + N1 + len(QUESTION) + 2
    assert sorted(writes) == list(range(conv_len))  # every slot, every deferred token, exactly once
    torch.testing.assert_close(torch.stack(out2.logits), logits2, **EXACT)


def test_cancel_leaves_pending_exact_and_the_next_turn_matches(model, blocking_reference,
                                                               worker_pauses_after_first_chunk):
    first_chunk_done, calls = worker_pauses_after_first_chunk
    _, logits2 = blocking_reference
    inputs = two_images()
    cfg = RaincheckConfig(**CFG)
    cache = DeferredPrefillCache(num_layers(model))
    writes = spy_writes(cache)
    out = generate(model, inputs, N1, cfg, past=cache)
    assert first_chunk_done.wait(TIMEOUT)
    cache.cancel()
    assert calls == [3] and not cache.completion_running
    assert cache.pending == 15 and cache.plan.restored == 7 and cache.stats.after_answer == 3
    check_consistent(cache)
    assert cache.wait() is False  # nothing runs, tokens still pending
    cache.cancel()  # idempotent
    _, out2 = turn_two(model, inputs, out, cfg)
    assert cache.turn_stats[1].restored_in_prefill == 15 and cache.pending == 0
    L = inputs["input_ids"].shape[1]
    assert sorted(writes) == list(range(L + N1 + len(QUESTION) + 2))
    torch.testing.assert_close(torch.stack(out2.logits), logits2, **EXACT)


def test_complete_deferred_stops_the_worker_then_completes(model, worker_pauses_after_first_chunk):
    first_chunk_done, calls = worker_pauses_after_first_chunk
    cache = DeferredPrefillCache(num_layers(model))
    writes = spy_writes(cache)
    generate(model, two_images(), N1, RaincheckConfig(**CFG), past=cache)
    assert first_chunk_done.wait(TIMEOUT)
    assert complete_deferred(model, cache) == 15
    assert calls == [3] and cache.pending == 0 and bool(cache.filled.all())
    assert sorted(writes) == list(range(two_images()["input_ids"].shape[1] + N1 - 1))


# ---------------------------------------------------------------- worker errors
@pytest.mark.parametrize("next_use", ["generate", "complete_deferred", "wait"])
def test_worker_error_is_raised_on_next_use_then_the_cache_works(model, blocking_reference, next_use):
    _, logits2 = blocking_reference
    inputs = two_images()
    cfg = RaincheckConfig(**CFG)
    cache = DeferredPrefillCache(num_layers(model))
    update = cache.update
    failures = []

    def failing(key_states, value_states, layer_idx, *args, **kwargs):
        # the worker's second chunk fails half-way through its forward (layer 0 already written)
        if threading.current_thread().name == "raincheck-completion" and layer_idx == 1 and cache.plan.restored == 7:
            failures.append(cache.forward_context.write_slots.tolist())
            raise FloatingPointError("injected failure")
        return update(key_states, value_states, layer_idx, *args, **kwargs)

    cache.update = failing
    out = generate(model, inputs, N1, cfg, past=cache)
    worker = cache.completion_worker
    assert worker.join(TIMEOUT) and worker.outcome == "failed" and len(failures) == 1
    assert cache.pending == 15 and not cache.completion_running
    check_consistent(cache)
    conv2 = _extend(inputs, out.sequences[0, inputs["input_ids"].shape[1]:].tolist() + QUESTION)
    with pytest.raises(RuntimeError, match="background completion of this cache's deferred tokens failed "
                                           r"\(FloatingPointError: injected failure\).*15 tokens still pending") as err:
        if next_use == "generate":
            generate(model, conv2, 3, cfg, past=cache)
        elif next_use == "complete_deferred":
            complete_deferred(model, cache)
        else:
            cache.wait()
    assert isinstance(err.value.__cause__, FloatingPointError)
    assert cache.pending == 15 and cache.length == inputs["input_ids"].shape[1] + N1 - 1  # nothing happened
    check_consistent(cache)
    # raised once; the cache goes on
    if next_use == "complete_deferred":
        assert complete_deferred(model, cache) == 15
    out2 = generate(model, conv2, 3, cfg, past=cache)
    assert cache.pending == 0 and bool(cache.filled.all())
    torch.testing.assert_close(torch.stack(out2.logits), logits2, **EXACT)


# ---------------------------------------------------------------- an interrupted generate
class Interrupt:
    """A stopping criterion that raises KeyboardInterrupt once the answer has `after` tokens."""

    def __init__(self, prompt_len, after):
        self.prompt_len, self.after, self.seen = prompt_len, after, None

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] - self.prompt_len >= self.after:
            self.seen = input_ids.clone()
            raise KeyboardInterrupt
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("completion", ["background", "blocking"])
def test_interrupted_generate_leaves_a_consistent_cache(model, completion):
    from transformers import StoppingCriteriaList

    inputs = two_images()
    L = inputs["input_ids"].shape[1]
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, guard_tokens=2, completion=completion, completion_chunk_size=4)
    cache = DeferredPrefillCache(num_layers(model))
    writes = spy_writes(cache)
    stop = Interrupt(L, after=6)  # y_6 sampled; decode steps 1..5 ran, steps 3..5 carried 2 deferred tokens each
    with pytest.raises(KeyboardInterrupt):
        generate(model, inputs, 12, cfg, past=cache, stopping_criteria=StoppingCriteriaList([stop]))
    assert cache.active_turn is None and not cache.completion_running  # nothing completes after an interrupt
    assert cache.token_ids == stop.seen[0, :-1].tolist()  # prompt + y_1..y_5 (y_6 was never fed)
    assert cache.plan.restored == 6 and cache.pending == 22 - 6 and cache.stats.after_answer == 0
    assert cache.turn_stats[0].pending_at_answer_end == 16
    check_consistent(cache)
    assert sorted(writes) == sorted(set(writes)) and len(writes) == L - 16 + 5
    # the same state as an uninterrupted answer of 6 tokens: the conversation continues from cache.token_ids
    plain = generate(model, inputs, 6, RaincheckConfig(retention=0.3, chunk_size=2, guard_tokens=2,
                                                       completion="next_turn"))
    assert plain.sequences[0].tolist() == stop.seen[0].tolist()
    conv2 = dict(input_ids=torch.tensor([cache.token_ids + QUESTION]))
    conv2["attention_mask"] = torch.ones_like(conv2["input_ids"])
    a = generate(model, conv2, 3, cfg, past=cache)
    b = generate(model, conv2, 3, cfg, past=output_cache(plain))
    assert cache.pending == 0 and bool(cache.filled.all()) and sorted(writes) == list(range(L + 5 + 4 + 2))
    assert cache.turn_stats[1].restored_in_prefill == 16
    torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), **EXACT)


# ---------------------------------------------------------------- model or cache freed, interpreter exit
def test_worker_stops_cleanly_when_the_model_is_freed():
    doomed = enable_raincheck(_tiny_model("eager", seed=3))
    inputs = two_images()
    cache = DeferredPrefillCache(num_layers(doomed))
    with cache.lock:  # the worker waits for the lock, holding no reference to the model
        out = generate(doomed, inputs, N1, RaincheckConfig(**CFG), past=cache)
        worker = cache.completion_worker
        assert worker.running and cache.pending == 18
        model_ref = weakref.ref(doomed)
        del doomed, out
        gc.collect()
        assert model_ref() is None, "the worker (or the cache) keeps the model alive"
    assert worker.join(TIMEOUT) and worker.outcome == "model freed" and worker.error is None
    assert cache.wait() is False and cache.pending == 18 and not cache.completion_running
    check_consistent(cache)
    other = enable_raincheck(_tiny_model("eager"))
    conv = dict(input_ids=torch.tensor([cache.token_ids + QUESTION]))
    with pytest.raises(ValueError, match="DeferredPrefillCache whose model was freed"):
        generate(other, conv, 2, RaincheckConfig(**CFG), past=cache)


def test_worker_stops_when_nobody_holds_the_cache(model):
    cache = DeferredPrefillCache(num_layers(model))
    lock = cache.lock
    with lock:  # the worker takes the cache for its first chunk, then finds it gone
        generate(model, two_images(), N1, RaincheckConfig(**CFG), past=cache)
        worker = cache.completion_worker
        cache_ref = weakref.ref(cache)
        del cache
    assert worker.join(TIMEOUT) and worker.outcome == "cache freed" and worker.restored == 3
    assert cache_ref() is None


EXIT_SCRIPT = r"""
import atexit, sys, threading
sys.path.insert(0, {tests!r})
state = {{}}
atexit.register(lambda: print("outcome:", state["worker"].outcome, "restored:", state["worker"].restored, flush=True))
import torch
from handmade import _conv, _tiny_model
from hf_raincheck import RaincheckConfig, enable_raincheck
from hf_raincheck.conversation import output_cache
from hf_raincheck.generation import background

original = background.prefill_pending
first_chunk_done = threading.Event()
def paused(state_, cache, budget, chunk):
    done = original(state_, cache, budget, chunk)
    first_chunk_done.set()
    cache.completion_worker.stop_requested.wait(120)  # only the exit handler stops it
    return done
background.prefill_pending = paused
model = enable_raincheck(_tiny_model("eager"))
inputs = _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4])
out = model.generate(**inputs, raincheck_config=RaincheckConfig(retention=0.3, chunk_size=2, guard_tokens=4,
                     completion_chunk_size=3), max_new_tokens=7, min_new_tokens=7, return_dict_in_generate=True)
state["worker"] = output_cache(out).completion_worker
assert first_chunk_done.wait(120)
print("pending at exit:", output_cache(out).pending, flush=True)
"""


def test_worker_stops_cleanly_at_interpreter_exit(tmp_path):
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT.format(tests=os.path.dirname(__file__)))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.splitlines() == ["pending at exit: 15", "outcome: interpreter exit restored: 3"]


# ---------------------------------------------------------------- a hybrid model (Gated DeltaNet layers)
def test_qwen3_5_background_and_preemption_match_blocking(worker_pauses_after_first_chunk):
    from handmade_qwen3_5 import tiny_qwen3_5

    first_chunk_done, calls = worker_pauses_after_first_chunk
    hybrid = enable_raincheck(tiny_qwen3_5("eager"))
    inputs = two_images()
    results = {}
    for mode in ("blocking", "preempt", "wait"):  # only the first worker chunk of the test pauses (preempt)
        cfg = RaincheckConfig(completion="blocking" if mode == "blocking" else "background", pruning="uniform", **CFG)
        cache = DeferredPrefillCache(len(hybrid.model.language_model.layers))
        out = generate(hybrid, inputs, N1, cfg, past=cache)
        if mode == "preempt":
            assert first_chunk_done.wait(TIMEOUT) and cache.completion_running
        elif mode == "wait":
            assert cache.wait(TIMEOUT) and cache.stats.after_answer == 18
        _, out2 = turn_two(hybrid, inputs, out, cfg)
        assert cache.pending == 0 and bool(cache.filled.all())
        results[mode] = (cache.turn_stats[1].restored_in_prefill, torch.stack(out2.logits))
    assert calls[0] == 3 and [r[0] for r in results.values()] == [0, 15, 0]
    torch.testing.assert_close(results["wait"][1], results["blocking"][1], **EXACT)
    torch.testing.assert_close(results["preempt"][1], results["blocking"][1], atol=2e-5, rtol=1e-4)


def test_qwen3_5_forward_failing_half_way_leaves_the_gdn_state_untouched():
    """A failure after the GDN layers advanced (raised in the full-attention layer 2) is rolled back: in the
    worker (raised on the next call) and in a decode step interrupted by KeyboardInterrupt."""
    from handmade_qwen3_5 import tiny_qwen3_5

    hybrid = enable_raincheck(tiny_qwen3_5("eager"))
    inputs = two_images()
    L = inputs["input_ids"].shape[1]
    tol = dict(atol=2e-5, rtol=1e-4)

    def failing_cache(when):
        cache = DeferredPrefillCache(len(hybrid.model.language_model.layers))
        update = cache.update

        def failing(key_states, value_states, layer_idx, *args, **kwargs):
            if when(cache):
                raise when.error
            return update(key_states, value_states, layer_idx, *args, **kwargs)

        cache.update = failing
        return cache

    def second_turn(cache, cfg):
        conv = dict(input_ids=torch.tensor([cache.token_ids + QUESTION]))
        return torch.stack(generate(hybrid, conv, 3, cfg, past=cache).logits)

    # the worker fails in its second chunk
    blocking = RaincheckConfig(completion="blocking", pruning="uniform", **CFG)
    reference = output_cache(generate(hybrid, inputs, N1, blocking))
    expected = second_turn(reference, blocking)

    def in_worker(cache):
        return threading.current_thread().name == "raincheck-completion" and cache.plan.restored == 7
    in_worker.error = FloatingPointError("injected")
    cfg = RaincheckConfig(pruning="uniform", **CFG)
    cache = failing_cache(in_worker)
    generate(hybrid, inputs, N1, cfg, past=cache)
    with pytest.raises(RuntimeError, match="background completion of this cache's deferred tokens failed"):
        cache.wait(TIMEOUT)
    assert cache.pending == 15
    torch.testing.assert_close(second_turn(cache, cfg), expected, **tol)

    # decode step 6 (feeding y_6, carrying 2 deferred tokens) is interrupted inside the forward
    def in_step_six(cache):
        return cache.forward_context is not None and int(cache.forward_context.write_slots[-1]) == L + 5
    in_step_six.error = KeyboardInterrupt()
    cfg = RaincheckConfig(completion="next_turn", pruning="uniform", **CFG)
    cache = failing_cache(in_step_six)
    with pytest.raises(KeyboardInterrupt):
        generate(hybrid, inputs, N1, cfg, past=cache)
    assert cache.length == L + 5 and cache.plan.restored == 2 and not cache.completion_running
    check_consistent(cache)
    same = output_cache(generate(hybrid, inputs, 6, cfg))  # an answer that ended right before step 6
    assert same.token_ids == cache.token_ids and same.plan.restored == 2
    torch.testing.assert_close(second_turn(cache, cfg), second_turn(same, cfg), **tol)
