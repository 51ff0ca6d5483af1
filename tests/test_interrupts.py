"""Ctrl-C anywhere in a turn's commit path: after the README's recovery the conversation is exact.

For every line event of ``hf_raincheck/generation/*.py`` and ``hf_raincheck/cache/*.py`` that the user thread runs
in turn 1 (which leaves a background worker paused after one chunk) and in turn 2 (which preempts that worker,
folds the rest into its prefill and adds a new image's plan), `tests/fault_injection.py` raises
``KeyboardInterrupt`` right before that line. The recovery is the README's ("Completion modes and the cache
between turns"): the cache stays consistent, ``cache.token_ids`` holds what was fed, and the conversation goes on
with ``cache.token_ids + new turn``. The run then ends with a text-only probe turn and `complete_deferred`.

The reference replays the same calls without the interrupt, the interrupted call replaced by what it observably
did: ``max_new_tokens`` = tokens it fed + 1 (or no call at all when its prompt never reached the cache), with
``completion="next_turn"`` followed by ``complete_deferred(max_tokens=<tokens it restored after its answer>)``.
Every later call's logits, the final KV entries and the counters (``length``, ``token_ids``, ``stats``,
``turn_stats``, ``total_deferred``, ``pending``, ``holes``, the filled mask) must equal the reference's; or the
recovery's first call raises a clear error (a ``RuntimeError`` / ``ValueError`` whose message says the cache was
left by an interrupted call).

Run one point (or every point whose id starts so):
    HF_RAINCHECK_INTERRUPT_POINT='turn2:generation/enable.py:281@bound>_generate>bound>_forward>_turn_step#1' \
        python -m pytest tests/test_interrupts.py -k 'qwen3_vl and any_line'
List the points: python tests/test_interrupts.py [qwen3_vl|qwen3_5]
Other files:     HF_RAINCHECK_INTERRUPT_FILES='generation/*.py,cache/*.py,gdn_state/*.py' (globs in hf_raincheck/)
The default tests inject at a deterministic spread of the distinct points (first and last occurrence of each
(phase, line, call stack)), HF_RAINCHECK_INTERRUPT_POINTS of them per model (default 240); ``-m slow`` runs
every distinct point.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from fault_injection import (  # noqa: E402
    Injector, LineRecorder, Point, distinct_points, failing_points, load_tiny, package_files, selected_points,
)

from hf_raincheck import (  # noqa: E402
    DeferredPrefillCache,
    RaincheckChat,
    RaincheckConfig,
    complete_deferred,
    enable_raincheck,
)
from hf_raincheck.conversation import cache_argument, next_turn_inputs  # noqa: E402
from hf_raincheck.generation import background  # noqa: E402
from hf_raincheck.testing import chat_inputs, make_image  # noqa: E402

# the package files whose lines are injection points (globs; HF_RAINCHECK_INTERRUPT_FILES="a/*.py,b.py" overrides)
TRACED = tuple(os.environ.get("HF_RAINCHECK_INTERRUPT_FILES", "generation/*.py,cache/*.py").split(","))
TOL = dict(atol=2e-5, rtol=1e-4)
TIMEOUT = 60  # seconds; reached only if the code under test is broken
# retention 0.3 of 16 merged tokens per image: 11 deferred; decode steps 2.. carry 2 each; the worker's chunk is 3
BASE = dict(retention=0.3, chunk_size=2, guard_tokens=1, completion_chunk_size=3, pruning="uniform")
TRACED_PHASES = ("turn1", "turn2")  # the probe turn is the recovery, not an injection target
DEFAULT_POINTS = int(os.environ.get("HF_RAINCHECK_INTERRUPT_POINTS", "240"))  # per model in the default test


@dataclass(frozen=True)
class Call:
    """One `generate` call of the dialogue: a user message, the answer length, the completion mode."""

    phase: str
    text: str
    image_seed: int | None
    max_new_tokens: int
    completion: str


DIALOGUE = (
    Call("turn1", "What is in the picture?", 1, 5, "background"),
    Call("turn2", "And in this one?", 2, 5, "background"),
    Call("probe", "Which one is brighter?", None, 2, "blocking"),
)


@dataclass
class Outcome:
    """What one run of the dialogue left: per call its logits, the final cache, what the interrupt did."""

    cache: DeferredPrefillCache
    logits: dict = field(default_factory=dict)  # phase -> [steps, V]
    replayed: list = field(default_factory=list)  # the calls as the reference must replay them
    interrupted: str | None = None  # phase of the interrupted call
    recovery_error: BaseException | None = None


class PausedWorkers:
    """Makes background workers deterministic: each runs exactly one chunk, then waits until it is stopped."""

    def __init__(self, monkeypatch):
        self.first_chunk = collections.defaultdict(threading.Event)
        self._lock = threading.Lock()
        original = background.prefill_pending

        def one_chunk_then_wait(state, cache, budget, chunk_size):
            done = original(state, cache, budget, chunk_size)
            worker = next(w for w in list(background._LIVE) if w._thread is threading.current_thread())
            with self._lock:
                event = self.first_chunk[worker]
            event.set()
            assert worker.stop_requested.wait(TIMEOUT), "nobody stopped the paused worker"
            return done

        monkeypatch.setattr(background, "prefill_pending", one_chunk_then_wait)

    def settle(self, cache: DeferredPrefillCache) -> None:
        """Waits until the cache's worker (if any) has run its one chunk (or ended)."""
        worker = cache.completion_worker
        if worker is None:
            return
        with self._lock:
            event = self.first_chunk[worker]
        deadline = time.monotonic() + TIMEOUT
        while not event.is_set() and worker.running:
            assert time.monotonic() < deadline, "the background worker never ran its first chunk"
            time.sleep(0.001)


_INPUTS: dict = {}


def _inputs(processor, call: Call, history: list[int] | None):
    key = (id(processor), call, None if history is None else tuple(history))
    if key not in _INPUTS:  # the processor's work is the same for every run that reaches the same call
        _INPUTS[key] = _process(processor, call, history)
    return dict(_INPUTS[key])


def _process(processor, call: Call, history: list[int] | None):
    content = [] if call.image_seed is None else [{"type": "image", "image": make_image(call.image_seed)}]
    message = {"role": "user", "content": content + [{"type": "text", "text": call.text}]}
    if history is None:
        return dict(chat_inputs(processor, [message]))
    return dict(next_turn_inputs(processor, torch.tensor([history]), [message]))


def _generate(model, inputs, cache, max_new_tokens: int, completion: str):
    cfg = RaincheckConfig(completion=completion, **BASE)
    with torch.no_grad():
        return model.generate(
            **inputs, **cache_argument(cache), raincheck_config=cfg, max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
        )


@dataclass(frozen=True)
class Step:
    """One call as run: ``skip`` (an interrupted call whose prompt never reached the cache) runs nothing;
    ``from_cache``: the next call continues from ``cache.token_ids`` (the README's recovery), not from the
    output's sequences; ``after_answer``: `complete_deferred` runs that many tokens after the call."""

    call: Call
    max_new_tokens: int
    completion: str
    after_answer: int | None = None
    from_cache: bool = False
    skip: bool = False
    keep_history: bool = False  # (with skip) the next call continues from the previous output, as RaincheckChat does


def plain_steps(completion: str | None = None) -> list[Step]:
    return [Step(c, c.max_new_tokens, completion if completion and c.phase != "probe" else c.completion)
            for c in DIALOGUE]


def run_dialogue(model, processor, workers: PausedWorkers, tracer=None, steps: list[Step] | None = None) -> Outcome:
    """The dialogue (`steps`, default `DIALOGUE`), its turns 1 and 2 traced by `tracer` (a `LineRecorder`, or an
    `Injector`: after its interrupt, the README's recovery)."""
    cache = DeferredPrefillCache(raincheck_num_layers(model))
    try:
        return _run_dialogue(model, processor, workers, tracer, steps, cache)
    except BaseException:
        stop_worker(cache)
        raise


def _run_dialogue(model, processor, workers, tracer, steps, cache) -> Outcome:
    outcome = Outcome(cache=cache)
    history = None
    for step in steps or plain_steps():
        call = step.call
        if step.skip:
            if not step.keep_history:
                history = list(cache.token_ids) if cache.length else None
            outcome.replayed.append(step)
            continue
        inputs = _inputs(processor, call, history)
        prompt_len = inputs["input_ids"].shape[1]
        after_before = cache.stats.after_answer
        try:
            if tracer is not None and outcome.interrupted is None and call.phase in TRACED_PHASES:
                tracer.phase = call.phase
                with tracer:
                    out = _generate(model, inputs, cache, step.max_new_tokens, step.completion)
            else:
                out = _generate(model, inputs, cache, step.max_new_tokens, step.completion)
        except KeyboardInterrupt:
            if outcome.interrupted is not None or not getattr(tracer, "fired", False):
                raise
            outcome.interrupted = call.phase
            check_left_usable(cache)
            workers.settle(cache)
            # the README's recovery: the cache holds what was fed; the next turn continues from cache.token_ids
            fed = cache.length - prompt_len
            if fed >= 0:  # the prompt reached the cache: an answer of fed + 1 tokens, then what was completed
                outcome.replayed.append(Step(call, fed + 1, "next_turn", cache.stats.after_answer - after_before,
                                             from_cache=True))
            else:  # the prompt never reached the cache: as if the call had not been made
                outcome.replayed.append(Step(call, 0, "next_turn", skip=True))
            history = list(cache.token_ids) if cache.length else None
            continue
        except (RuntimeError, ValueError) as error:
            if outcome.interrupted is None or "interrupt" not in str(error).lower():
                raise
            outcome.recovery_error = error  # a clear refusal to go on from a cache an interrupt left behind
            return outcome
        if step.after_answer is not None:
            complete_deferred(model, cache, max_tokens=step.after_answer)
        workers.settle(cache)
        outcome.logits[call.phase] = torch.stack(out.logits)[:, 0]
        outcome.replayed.append(step)
        history = list(cache.token_ids) if step.from_cache else out.sequences[0].tolist()
    complete_deferred(model, cache)
    return outcome


def check_left_usable(cache: DeferredPrefillCache) -> None:
    """After an interrupt: the cache's lock is free and any worker started is the cache's (else: stop, report)."""
    if cache.lock._is_owned():  # noqa: SLF001 - a lock left held would make every later user wait forever
        while cache.lock._is_owned():
            cache.lock.release()
        stop_worker(cache)
        raise AssertionError("the interrupted call left cache.lock held by its thread")
    orphans = [w for w in list(background._LIVE)
               if w._cache_ref() is cache and w is not cache.completion_worker and w._thread.is_alive()]
    if orphans:
        for worker in orphans:
            worker.stop()
        raise AssertionError("the interrupted call started a background worker that cache.completion_worker does not hold: "
                             "the next call cannot stop it and races it")


def chat_steps() -> list[Step]:
    """`DIALOGUE` as a `RaincheckChat` runs it: one config (``completion="background"``) for every turn."""
    return [Step(c, c.max_new_tokens, "background") for c in DIALOGUE]


def run_chat_dialogue(model, processor, workers: PausedWorkers, tracer=None) -> Outcome:
    """`DIALOGUE` through `RaincheckChat.ask`; after an interrupt, what the session does (it keeps the partial
    turn the cache holds, or nothing when the prompt never reached the cache) and the next `ask`."""
    chat = RaincheckChat(model, processor, RaincheckConfig(completion="background", **BASE), do_sample=False)
    outcome = Outcome(cache=None, logits=None)
    try:
        for step in chat_steps():
            call = step.call
            history = None if chat._sequences is None else chat._sequences[0].tolist()
            prompt_len = _inputs(processor, call, history)["input_ids"].shape[1]
            messages_before = len(chat.messages)
            after_before = chat.cache.stats.after_answer if chat.cache is not None else 0
            image = None if call.image_seed is None else make_image(call.image_seed)
            kwargs = dict(max_new_tokens=step.max_new_tokens, min_new_tokens=step.max_new_tokens)
            try:
                if tracer is not None and outcome.interrupted is None and call.phase in TRACED_PHASES:
                    tracer.phase = call.phase
                    with tracer:
                        chat.ask(call.text, images=image, **kwargs)
                else:
                    chat.ask(call.text, images=image, **kwargs)
            except KeyboardInterrupt:
                if outcome.interrupted is not None or not getattr(tracer, "fired", False):
                    raise
                outcome.interrupted = call.phase
                cache = chat.cache
                if cache is None:  # interrupted before the session made its cache
                    outcome.replayed.append(Step(call, 0, "next_turn", skip=True, keep_history=True))
                    continue
                check_left_usable(cache)
                workers.settle(cache)
                fed = cache.length - prompt_len
                if fed >= 0:
                    # the session keeps what the cache holds, or (interrupted after recording the answer) the answer
                    recorded = [] if chat._sequences is None else chat._sequences[0].tolist()
                    partial = recorded == cache.token_ids
                    whole = recorded[:-1] == cache.token_ids
                    assert (partial or whole) and len(chat.messages) == messages_before + 2, (
                        "the session did not record the interrupted turn the cache holds "
                        f"({len(chat.messages) - messages_before} messages added)")
                    outcome.replayed.append(Step(call, fed + 1, "next_turn", cache.stats.after_answer - after_before,
                                                 from_cache=partial))
                else:
                    assert len(chat.messages) == messages_before, "the session recorded a turn the cache does not hold"
                    assert (chat._sequences is None and history is None) or chat._sequences[0].tolist() == history
                    outcome.replayed.append(Step(call, 0, "next_turn", skip=True, keep_history=True))
                continue
            workers.settle(chat.cache)
            outcome.replayed.append(step)
        assert len(chat.messages) == 2 * len(chat.stats)
        assert [m["role"] for m in chat.messages] == ["user", "assistant"] * len(chat.stats)
        outcome.cache = chat.cache
        complete_deferred(model, chat.cache)
        return outcome
    except BaseException:
        if chat.cache is not None:
            stop_worker(chat.cache)
        raise


def stop_worker(cache: DeferredPrefillCache) -> None:
    """Lets a paused worker of `cache` end (a failed run must not leave it waiting)."""
    worker = cache.completion_worker
    if worker is not None:
        worker.stop()


def raincheck_num_layers(model) -> int:
    from hf_raincheck.generation.state import raincheck_state

    return raincheck_state(model, "test").adapter.num_cache_layers()


def cache_summary(cache: DeferredPrefillCache) -> dict:
    """The counters and bookkeeping that must match the reference exactly."""
    return dict(
        length=cache.length,
        token_ids=list(cache.token_ids),
        stats=asdict(cache.stats),
        turn_stats=[asdict(t) for t in cache.turn_stats],
        total_deferred=cache.total_deferred,
        pending=cache.pending,
        holes=cache.holes,
        filled=cache.filled.tolist(),
        plans=[(p.total_deferred, p.restored) for p in cache.plans],
    )


def compare(outcome: Outcome, reference: Outcome) -> str | None:
    """None when `outcome` equals `reference`, else what differs first."""
    mine, theirs = cache_summary(outcome.cache), cache_summary(reference.cache)
    for key in mine:
        if mine[key] != theirs[key]:
            return f"cache.{key} differs {_difference(mine[key], theirs[key])}"
    for phase, logits in reference.logits.items() if outcome.logits is not None else ():
        if phase == outcome.interrupted:
            continue  # its answer was cut short: the later calls' logits and the cache are what must agree
        got = outcome.logits.get(phase)
        if got is None:
            return f"no logits for {phase}"
        if got.shape != logits.shape or not torch.allclose(got, logits, **TOL):
            diff = (got - logits).abs().max().item() if got.shape == logits.shape else "shape"
            return f"{phase} logits differ from the reference (max abs diff {diff})"
    length = outcome.cache.length
    for index, (a, b) in enumerate(zip(outcome.cache.layers, reference.cache.layers)):
        if getattr(a, "keys", None) is None and getattr(b, "keys", None) is None:
            continue  # a Gated DeltaNet layer: its state is checked through the probe turn's logits
        for name in ("keys", "values"):
            x, y = getattr(a, name)[:, :, :length], getattr(b, name)[:, :, :length]
            if not torch.allclose(x, y, **TOL):
                return f"layer {index} {name} differ from the reference (max abs diff {(x - y).abs().max().item()})"
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


def _difference(mine, theirs) -> str:
    """Where two values differ, shortly: lists by their first differing index."""
    if isinstance(mine, list) and isinstance(theirs, list):
        index = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        return (f"at [{index}] of {len(mine)} vs {len(theirs)} items: {_short(mine[index:index + 4])} vs reference "
                f"{_short(theirs[index:index + 4])}")
    return f"{_short(mine)} vs reference {_short(theirs)}"


class Harness:
    """One model's dialogue: the recorded points, the references (memoized by replay), one run per point.

    ``chat=True``: the dialogue runs through `RaincheckChat` (and ``chat.py`` is traced too)."""

    def __init__(self, model, processor, monkeypatch, chat: bool = False):
        self.model, self.processor = enable_raincheck(model), processor
        self.workers = PausedWorkers(monkeypatch)
        self.chat = chat
        self.files = package_files(*TRACED, *(("chat.py",) if chat else ()))
        self._references: dict = {}

    def run(self, tracer=None) -> Outcome:
        if self.chat:
            return run_chat_dialogue(self.model, self.processor, self.workers, tracer=tracer)
        return run_dialogue(self.model, self.processor, self.workers, tracer=tracer)

    def points(self, occurrences: str = "first_last") -> list[Point]:
        recorder = LineRecorder(self.files)
        self.run(recorder)
        # the probe turn is the recovery, not an injection target
        return [p for p in distinct_points(recorder.events, occurrences) if p.phase != "probe"]

    def reference(self, replayed: list[Step]) -> Outcome:
        key = tuple(replayed)
        if key not in self._references:
            self._references[key] = run_dialogue(self.model, self.processor, self.workers, steps=replayed)
        return self._references[key]

    def check(self, point: Point) -> str | None:
        """None when the run interrupted at `point` recovers exactly (or refuses clearly), else the symptom."""
        injector = Injector(self.files, point)
        try:
            outcome = self.run(injector)
        except BaseException as error:  # noqa: BLE001 - any failure of the recovery is the finding
            return f"recovery raised {type(error).__name__}: {str(error)[:200]}"
        if not injector.fired:
            return "the point was not reached (the run is not deterministic)"
        if outcome.recovery_error is not None:
            return None
        return compare(outcome, self.reference(outcome.replayed))


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def model_name(request):
    return request.param


@pytest.fixture(scope="module")
def loaded(model_name, tmp_path_factory):
    return load_tiny(model_name, tmp_path_factory, "interrupts")


@pytest.fixture
def harness(loaded, monkeypatch):
    return Harness(*loaded, monkeypatch)


def test_the_dialogue_is_deterministic_and_equals_blocking(harness):
    """The harness itself: two plain runs agree exactly; the dialogue preempts a worker and folds its rest."""
    first = run_dialogue(harness.model, harness.processor, harness.workers)
    second = run_dialogue(harness.model, harness.processor, harness.workers)
    assert compare(first, second) is None
    turn1, turn2 = first.cache.turn_stats[:2]
    assert turn1.deferred > 0 and turn1.restored_during_decode > 0 and turn1.restored_after_answer == 3
    assert turn2.restored_in_prefill == turn1.pending_at_answer_end - 3 > 0 and turn2.deferred > 0
    assert first.cache.pending == 0 and bool(first.cache.filled.all())
    points = harness.points()
    assert {p.phase for p in points} == {"turn1", "turn2"}
    files = {p.file for p in points}
    assert {"generation/enable.py", "generation/rows.py", "generation/decode.py", "cache/deferred_cache.py",
            "generation/background.py"} <= files
    # the same dialogue with completion="blocking": the same logits
    reference = run_dialogue(harness.model, harness.processor, harness.workers, steps=plain_steps("blocking"))
    for phase in ("turn1", "turn2", "probe"):
        torch.testing.assert_close(first.logits[phase], reference.logits[phase], **TOL)


_LOCK = threading.RLock()


def _guarded(fail: bool) -> int:
    with _LOCK:
        value = 1
        try:
            value += 1
        finally:
            value += 1
        if fail:
            return value
    return value


def test_points_are_where_an_asynchronous_interrupt_can_land():
    """Every point of a `with lock: try: ... finally: ...` function is injectable without leaving the lock held
    (the `try:` no-op, the `finally:` block's entry and the `with`'s exit are not points), and the points are found
    again in the same order."""
    files = frozenset([os.path.abspath(__file__)])
    recorder = LineRecorder(files)
    with recorder:
        for fail in (False, True):
            recorder.phase = str(fail)
            _guarded(fail)
    lines = [p.line - _guarded.__code__.co_firstlineno for p in recorder.events]
    assert lines == [1, 2, 4, 7, 9, 1, 2, 4, 7, 8], lines
    for point in recorder.events:
        injector = Injector(files, point)
        injector.phase = point.phase
        with pytest.raises(KeyboardInterrupt):
            with injector:
                _guarded(point.phase == "True")
        assert injector.fired and not _LOCK._is_owned(), point
    assert Point.parse(str(recorder.events[3])) == recorder.events[3]


def test_interrupt_at_any_line_recovers_exactly(harness, model_name):
    points = selected_points(harness.points(), DEFAULT_POINTS)
    failures = failing_points(harness.check, points)
    assert not failures, f"{len(failures)} of {len(points)} interrupt points ({model_name}) do not recover:\n" + \
        "\n".join(failures)


CHAT_POINTS = int(os.environ.get("HF_RAINCHECK_INTERRUPT_CHAT_POINTS", "80"))


@pytest.fixture
def chat_harness(loaded, monkeypatch):
    return Harness(*loaded, monkeypatch, chat=True)


def test_chat_dialogue_equals_its_replay(chat_harness):
    plain = chat_harness.run()
    reference = run_dialogue(chat_harness.model, chat_harness.processor, chat_harness.workers, steps=chat_steps())
    assert compare(plain, reference) is None


def test_interrupt_at_any_line_of_a_chat_turn_recovers_exactly(chat_harness, model_name):
    points = selected_points(chat_harness.points(), CHAT_POINTS)
    failures = failing_points(chat_harness.check, points)
    assert not failures, f"{len(failures)} of {len(points)} interrupt points ({model_name}, RaincheckChat) do not " \
        "recover:\n" + "\n".join(failures)


@pytest.mark.slow
def test_interrupt_at_every_line_recovers_exactly(harness, model_name, request):
    if "slow" not in (request.config.getoption("-m") or ""):
        pytest.skip("exhaustive (every distinct point, ~1900 per model): select it with -m slow")
    points = selected_points(harness.points(), None)
    failures = failing_points(harness.check, points)
    assert not failures, f"{len(failures)} of {len(points)} interrupt points ({model_name}) do not recover:\n" + \
        "\n".join(failures)


if __name__ == "__main__":  # list the points: python tests/test_interrupts.py [qwen3_vl|qwen3_5]
    import tempfile

    class _Patch:
        def setattr(self, target, name, value):
            setattr(target, name, value)

    class _Tmp:
        def mktemp(self, name):
            import pathlib

            return pathlib.Path(tempfile.mkdtemp(prefix=name))

    for name in sys.argv[1:] or ["qwen3_vl"]:
        h = Harness(*load_tiny(name, _Tmp(), "interrupts"), _Patch())
        for p in h.points():
            print(p)
