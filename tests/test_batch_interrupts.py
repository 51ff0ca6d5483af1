"""Ctrl-C anywhere in a batched turn: every row cache is left consistent and recovers exactly (rule 8, "Batches").

A batched ``generate(raincheck_config=...)`` runs its rows in shared forwards, each forward one transaction per
row cache (`shared_rows.row_transactions`). For every line event of the batched path (the files: `TRACED`) that
the user thread runs in a batched dialogue of three rows with different images, `tests/fault_injection.py` raises
``KeyboardInterrupt`` right before that line:

- turn 1: a left-padded batch of three new conversations (``completion="next_turn"``; row 0 stops early through a
  stopping criterion, so its deferred tokens wait);
- ``complete_deferred(model, group, max_tokens=3)`` of the batch's rows (shared forwards of 2 tokens per row; row 2
  has only 2 left, so the second forward runs without it);
- turn 2: the rows continued together on the same `BatchedDeferredPrefillCache` (each row folds what it left
  pending into its prefill; rows 1 and 2 add a new image, a new plan), ``completion="blocking"``; row 1 stops
  early and restores its deferred tokens in the shared steps while the others decode, then the shared blocking
  completion finishes what is left.

Right after the interrupt every row cache must be consistent on its own: its lock free, no turn, forward or worker
left on it, its filled mask covering exactly ``length - holes`` slots. The recovery is the README's, per row: the
conversation goes on from ``row.token_ids``; the calls after the interrupted one run as planned, on the same
`BatchedDeferredPrefillCache` the interrupted call was given (a row whose prompt never reached its cache starts
over with its next message); then each row is continued alone with a text-only probe turn and `complete_deferred`.

The reference of each row is a batch-1 replay of the same row, the interrupted call replaced by what it observably
did to that row (the rows of one shared forward may commit or roll back each on its own: each has its own
transaction): ``max_new_tokens`` = tokens the row was fed + 1 (or no call when its prompt never reached its
cache), with ``completion="next_turn"``, followed by ``complete_deferred(max_tokens=<tokens it restored after its
answer>)`` (the batch's `complete_deferred` counts there too). Every later call's logits of the row, its final KV
entries, Gated DeltaNet states and counters (``length``, ``token_ids``, ``stats``, ``turn_stats``,
``total_deferred``, ``pending``, ``holes``, the filled mask, the plans' progress) must equal the reference's.

Run one point (or every point whose id starts so):
    HF_RAINCHECK_INTERRUPT_POINT='turn2:generation/shared_batch.py:126@...#1' \
        python -m pytest tests/test_batch_interrupts.py -k 'qwen3_vl and any_line'
List the points: python tests/test_batch_interrupts.py [qwen3_vl|qwen3_5]
Other files:     HF_RAINCHECK_INTERRUPT_FILES='generation/*.py,cache/*.py,gdn_state/*.py' (globs in hf_raincheck/)
The default test injects at a deterministic spread of the distinct points (first and last occurrence of each
(phase, line, call stack)): HF_RAINCHECK_INTERRUPT_BATCH_POINTS per model (default 80 for Qwen3-VL, 40 for
Qwen3.5); ``-m slow`` runs every distinct point (2851 for Qwen3-VL, 3359 for Qwen3.5).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import asdict, dataclass, field

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

sys.path.insert(0, os.path.dirname(__file__))

from fault_injection import (  # noqa: E402
    Injector, LineRecorder, Point, distinct_points, failing_points, load_tiny, package_files, selected_points,
)

from hf_raincheck import (  # noqa: E402
    BatchedDeferredPrefillCache,
    DeferredPrefillCache,
    RaincheckConfig,
    complete_deferred,
    enable_raincheck,
)
from hf_raincheck.conversation import batch_inputs, cache_argument, next_turn_inputs, output_cache  # noqa: E402
from hf_raincheck.testing import chat_inputs, make_image  # noqa: E402

# the batched path: the batch entry, the shared steps and forwards, the row stops, the shared completion, the patched
# generate / forward that transformers' loop calls, the rows' forward helpers, every cache module and the Gated
# DeltaNet layers' shared forward (Qwen3.5). turn.py's preparation of each row runs before any transaction and is
# test_interrupts.py's. HF_RAINCHECK_INTERRUPT_FILES="a/*.py,b.py" overrides.
TRACED = tuple(os.environ.get(
    "HF_RAINCHECK_INTERRUPT_FILES",
    "generation/batch.py,generation/shared_batch.py,generation/shared_rows.py,generation/shared_step.py,"
    "generation/row_stops.py,"
    "generation/completion.py,generation/enable.py,generation/rows.py,cache/*.py,gdn_state/layer.py,"
    "gdn_state/shared_layer.py,gdn_state/batch_rows.py").split(","))
TOL = dict(atol=2e-5, rtol=1e-4)
# retention 0.3: a 16-token image defers 11; decode steps 2.. carry 2 per row; completion chunks of 2 per row
BASE = dict(retention=0.3, chunk_size=2, guard_tokens=1, completion_chunk_size=2, pruning="uniform")
TRACED_PHASES = ("turn1", "complete", "turn2")  # the probe turns are the recovery, not injection targets
_POINTS = os.environ.get("HF_RAINCHECK_INTERRUPT_BATCH_POINTS")
DEFAULT_POINTS = {"qwen3_vl": 80, "qwen3_5": 40} if _POINTS is None else {"qwen3_vl": int(_POINTS),
                                                                           "qwen3_5": int(_POINTS)}


@dataclass(frozen=True)
class Message:
    """One user message of a row: its text and image (``(seed, (width, height))``, or None)."""

    text: str
    image: tuple | None = None


@dataclass(frozen=True)
class BatchTurn:
    """One batched `generate` call: each row's message, the answer length, the completion mode, and the rows that
    a stopping criterion stops early (row -> answer length)."""

    phase: str
    messages: tuple[Message, ...]
    max_new_tokens: int
    completion: str
    stop_early: tuple[tuple[int, int], ...] = ()

    def answer_length(self, row: int) -> int:
        return dict(self.stop_early).get(row, self.max_new_tokens)


@dataclass(frozen=True)
class BatchCompletion:
    """``complete_deferred(model, group, max_tokens=...)`` on the batch's rows between two turns."""

    phase: str
    max_tokens: int


DIALOGUE = (
    BatchTurn("turn1", (Message("What is in the picture?", (1, (128, 128))),
                        Message("Compare the colours, please, in some detail", (2, (96, 160))),
                        Message("Colours?", (3, (128, 96)))),
              max_new_tokens=5, completion="next_turn", stop_early=((0, 2),)),
    BatchCompletion("complete", max_tokens=3),
    BatchTurn("turn2", (Message("Why?"), Message("And in this one?", (4, (128, 128))),
                        Message("And this?", (5, (96, 96)))),
              max_new_tokens=5, completion="blocking", stop_early=((1, 2),)),
)
PROBE = Message("Which one is brighter?")
ROWS = len(DIALOGUE[0].messages)


@dataclass(frozen=True)
class Step:
    """One batch-1 call of a row's reference replay: ``skip`` (its prompt never reached the cache) runs nothing;
    ``from_cache``: the next call continues from ``cache.token_ids`` (the README's recovery), not from the answer;
    ``after_answer``: `complete_deferred` runs that many tokens after the call."""

    phase: str
    message: Message
    max_new_tokens: int
    completion: str
    after_answer: int | None = None
    from_cache: bool = False
    skip: bool = False


@dataclass
class RowOutcome:
    """What one row of a run left: its cache after the probe and `complete_deferred`, per call its logits."""

    cache: DeferredPrefillCache | None = None
    logits: dict = field(default_factory=dict)  # phase -> [steps, V]
    replayed: list = field(default_factory=list)  # the row's calls as its batch-1 reference must replay them


@dataclass
class Outcome:
    rows: list[RowOutcome]
    interrupted: str | None = None  # phase of the interrupted batched call


class StopRowsAfter(StoppingCriteria):
    """Stops the given rows once they generated their answer length (``{row: length}``)."""

    def __init__(self, width: int, lengths: dict):
        self.width, self.lengths = width, lengths

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for row, length in self.lengths.items():
            done[row] = input_ids.shape[1] - self.width >= length
        return done


# ------------------------------------------------------------------------------------------------ inputs

_INPUTS: dict = {}


def _content(message: Message) -> list:
    text = [{"type": "text", "text": message.text}]
    if message.image is None:
        return text
    seed, size = message.image
    return [{"type": "image", "image": make_image(seed, size)}] + text


def row_inputs(processor, message: Message, history: list[int] | None) -> dict:
    """One row's inputs: a new conversation, or `history` (the tokens so far) + the message."""
    key = (id(processor), message, None if history is None else tuple(history))
    if key not in _INPUTS:  # the same for every run that reaches the same call
        msg = [{"role": "user", "content": _content(message)}]
        if history is None:
            _INPUTS[key] = dict(chat_inputs(processor, msg))
        else:
            _INPUTS[key] = dict(next_turn_inputs(processor, torch.tensor([history]), msg))
    return dict(_INPUTS[key])


def first_turn_batch(processor, turn: BatchTurn) -> dict:
    """Turn 1 as the processor lays out a left-padded batch of new conversations."""
    key = (id(processor), turn)
    if key not in _INPUTS:
        conversations = [[{"role": "user", "content": _content(m)}] for m in turn.messages]
        _INPUTS[key] = dict(processor.apply_chat_template(
            conversations, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
            processor_kwargs={"padding": True, "padding_side": "left"}))
    return dict(_INPUTS[key])


def _config(completion: str) -> RaincheckConfig:
    return RaincheckConfig(completion=completion, **BASE)


def _generate(model, inputs: dict, cache, max_new_tokens: int, completion: str, **kwargs):
    with torch.no_grad():
        return model.generate(
            **inputs, **cache_argument(cache), raincheck_config=_config(completion), max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
            **kwargs,
        )


def raincheck_num_layers(model) -> int:
    from hf_raincheck.generation.state import raincheck_state

    return raincheck_state(model, "test").adapter.num_cache_layers()


# ------------------------------------------------------------------------------------------------ the batched run


def run_batched(model, processor, tracer=None) -> Outcome:
    """`DIALOGUE` batched (every call traced by `tracer`: a `LineRecorder`, or an `Injector`, after whose
    interrupt each row recovers from its cache), then each row alone: a probe turn and `complete_deferred`."""
    pad = processor.tokenizer.pad_token_id
    outcome = Outcome(rows=[RowOutcome() for _ in range(ROWS)])
    group = BatchedDeferredPrefillCache([None] * ROWS)  # (the caller holds it: the recovery continues it)
    histories: list[list[int] | None] = [None] * ROWS
    for turn in DIALOGUE:
        if isinstance(turn, BatchCompletion):
            run_completion(model, group, turn, tracer, outcome)
            continue
        if turn.phase == "turn1":
            inputs = first_turn_batch(processor, turn)
        else:
            inputs = batch_inputs([row_inputs(processor, m, h) for m, h in zip(turn.messages, histories)], pad)
        mask = inputs["attention_mask"].bool()
        prompt_lens = [int(m.sum()) for m in mask]
        width = inputs["input_ids"].shape[1]
        before = [0 if r is None else r.stats.after_answer for r in group.rows]
        stops = StoppingCriteriaList([StopRowsAfter(width, dict(turn.stop_early))])
        kwargs = dict(stopping_criteria=stops, pad_token_id=pad)
        try:
            if tracer is not None and outcome.interrupted is None and turn.phase in TRACED_PHASES:
                tracer.phase = turn.phase
                with tracer:
                    out = _generate(model, inputs, group, turn.max_new_tokens, turn.completion, **kwargs)
            else:
                out = _generate(model, inputs, group, turn.max_new_tokens, turn.completion, **kwargs)
        except KeyboardInterrupt:
            if outcome.interrupted is not None or not getattr(tracer, "fired", False):
                raise
            outcome.interrupted = turn.phase
            check_left_consistent(group)
            for b in range(ROWS):
                row = group.rows[b]
                fed = -1 if row is None else row.length - prompt_lens[b]
                message = turn.messages[b]
                if fed >= 0:  # the prompt reached the row's cache: an answer of fed + 1 tokens, then what it completed
                    after = row.stats.after_answer - before[b]
                    outcome.rows[b].replayed.append(Step(turn.phase, message, fed + 1, "next_turn", after,
                                                            from_cache=True))
                else:  # as if the call had not been made for this row
                    outcome.rows[b].replayed.append(Step(turn.phase, message, 0, "next_turn", skip=True))
                histories[b] = list(row.token_ids) if row is not None and row.length else None
            continue
        assert output_cache(out) is group
        logits = torch.stack(out.logits)  # [steps, B, V]
        for b in range(ROWS):
            n = turn.answer_length(b)
            outcome.rows[b].logits[turn.phase] = logits[:n, b]
            outcome.rows[b].replayed.append(Step(turn.phase, turn.messages[b], n, turn.completion))
            new = out.sequences[b, width:width + n].tolist()
            histories[b] = inputs["input_ids"][b][mask[b]].tolist() + new
    for b in range(ROWS):  # the recovery's probe turn, each row alone
        cache = group.rows[b] if group.rows[b] is not None else DeferredPrefillCache(raincheck_num_layers(model))
        out = _generate(model, row_inputs(processor, PROBE, histories[b]), cache, 2, "blocking")
        complete_deferred(model, cache)
        outcome.rows[b].cache = cache
        outcome.rows[b].logits["probe"] = torch.stack(out.logits)[:, 0]
        outcome.rows[b].replayed.append(Step("probe", PROBE, 2, "blocking"))
    return outcome


def run_completion(model, group: BatchedDeferredPrefillCache, call: BatchCompletion, tracer, outcome: Outcome):
    """`call` on the rows (traced by `tracer` unless an earlier call was interrupted); what each row restored (all
    of it, or what the chunks before an interrupt did) counts in its reference as restored after its last call."""
    before = [0 if r is None else r.stats.after_answer for r in group.rows]
    try:
        if tracer is not None and outcome.interrupted is None:
            tracer.phase = call.phase
            with tracer:
                complete_deferred(model, group, max_tokens=call.max_tokens)
        else:
            complete_deferred(model, group, max_tokens=call.max_tokens)
    except KeyboardInterrupt:
        if outcome.interrupted is not None or not getattr(tracer, "fired", False):
            raise
        outcome.interrupted = call.phase
        check_left_consistent(group)
    for b, row in enumerate(group.rows):
        restored = 0 if row is None else row.stats.after_answer - before[b]
        steps = outcome.rows[b].replayed
        if restored:
            steps[-1] = dataclasses.replace(steps[-1], after_answer=(steps[-1].after_answer or 0) + restored)


def check_left_consistent(group: BatchedDeferredPrefillCache) -> None:
    """Right after an interrupt: every row cache is free (its lock released, no turn, forward or worker left on it)
    and its bookkeeping agrees with itself (the slots marked filled are exactly the covered slots that are not
    holes)."""
    # (the group's own `active_turn` / `forward_context` may stay installed: a Ctrl-C can land at the entry of
    # `end_turn` / `end_forward`, called from a `finally`; the next call on the group installs its own, and the
    # recovery below reuses the group)
    for b, row in enumerate(group.rows):
        if row is None:
            continue
        if row.lock._is_owned():  # noqa: SLF001 - a lock left held would make every later user wait forever
            while row.lock._is_owned():
                row.lock.release()
            raise AssertionError(f"row {b}: the interrupted call left its lock held")
        assert row.active_turn is None and row.forward_context is None, f"row {b}: a turn or forward left installed"
        assert row.completion_worker is None, f"row {b}: a background worker was started"
        if row._filled is not None:  # noqa: SLF001
            filled = row._filled  # noqa: SLF001
            assert int(filled[: row.length].sum()) == row.length - row.holes, (
                f"row {b}: {int(filled[: row.length].sum())} slots marked filled, expected length {row.length} - "
                f"holes {row.holes}")
            past = int(filled[row.length:].sum())
            assert past == 0, f"row {b}: {past} slots past its length {row.length} are marked filled"
        for plan in row.plans:
            assert 0 <= plan.restored <= plan.total_deferred, f"row {b}: a plan restored {plan.restored} tokens"


# ------------------------------------------------------------------------------------------------ the reference


def run_row_alone(model, processor, steps: tuple[Step, ...]) -> RowOutcome:
    """One row's batch-1 replay of `steps`, then `complete_deferred`."""
    cache = DeferredPrefillCache(raincheck_num_layers(model))
    outcome = RowOutcome(cache=cache)
    history = None
    for step in steps:
        if step.skip:
            history = list(cache.token_ids) if cache.length else None
            continue
        out = _generate(model, row_inputs(processor, step.message, history), cache, step.max_new_tokens,
                        step.completion)
        if step.after_answer is not None:
            complete_deferred(model, cache, max_tokens=step.after_answer)
        outcome.logits[step.phase] = torch.stack(out.logits)[:, 0]
        history = list(cache.token_ids) if step.from_cache else out.sequences[0].tolist()
    complete_deferred(model, cache)
    return outcome


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


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


def _difference(mine, theirs) -> str:
    if isinstance(mine, list) and isinstance(theirs, list):
        index = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        return (f"at [{index}] of {len(mine)} vs {len(theirs)} items: {_short(mine[index:index + 4])} vs reference "
                f"{_short(theirs[index:index + 4])}")
    return f"{_short(mine)} vs reference {_short(theirs)}"


def compare_row(row: RowOutcome, reference: RowOutcome, interrupted: str | None) -> str | None:
    """None when `row` equals its batch-1 `reference`, else what differs first."""
    mine, theirs = cache_summary(row.cache), cache_summary(reference.cache)
    for key in mine:
        if mine[key] != theirs[key]:
            return f"cache.{key} differs {_difference(mine[key], theirs[key])}"
    for phase, logits in reference.logits.items():
        if phase == interrupted:
            continue  # its answer was cut short: the later calls' logits and the cache are what must agree
        got = row.logits.get(phase)
        if got is None:
            return f"no logits for {phase}"
        if got.shape != logits.shape or not torch.allclose(got, logits, **TOL):
            diff = (got - logits).abs().max().item() if got.shape == logits.shape else f"shape {tuple(got.shape)}"
            return f"{phase} logits differ from the reference (max abs diff {diff})"
    length = row.cache.length
    for index, (a, b) in enumerate(zip(row.cache.layers, reference.cache.layers)):
        if a.is_initialized != b.is_initialized:
            return f"layer {index}: is_initialized {a.is_initialized} vs reference {b.is_initialized}"
        if not b.is_initialized:
            continue
        for name in ("keys", "values"):
            x, y = getattr(a, name)[:, :, :length], getattr(b, name)[:, :, :length]
            if not torch.allclose(x, y, **TOL):
                return f"layer {index} {name} differ from the reference (max abs diff {(x - y).abs().max().item()})"
    if row.cache.gdn_states.keys() != reference.cache.gdn_states.keys():
        return f"GDN layers {sorted(row.cache.gdn_states)} vs reference {sorted(reference.cache.gdn_states)}"
    for index, state in reference.cache.gdn_states.items():
        for name in ("state", "conv"):
            x, y = getattr(row.cache.gdn_states[index], name), getattr(state, name)
            if x.shape != y.shape or not torch.allclose(x, y, **TOL):
                return f"GDN layer {index} {name} differs from the reference"
    return None


# ------------------------------------------------------------------------------------------------ the harness


class Harness:
    """One model's batched dialogue: the recorded points, the rows' references (memoized by replay), one run per
    point."""

    def __init__(self, model, processor):
        self.model, self.processor = enable_raincheck(model), processor
        self.files = package_files(*TRACED)
        self._references: dict = {}

    def points(self, occurrences: str = "first_last") -> list[Point]:
        recorder = LineRecorder(self.files)
        run_batched(self.model, self.processor, recorder)
        return [p for p in distinct_points(recorder.events, occurrences) if p.phase in TRACED_PHASES]

    def reference(self, replayed: list[Step]) -> RowOutcome:
        key = tuple(replayed)
        if key not in self._references:
            self._references[key] = run_row_alone(self.model, self.processor, key)
        return self._references[key]

    def check(self, point: Point) -> str | None:
        """None when the run interrupted at `point` recovers exactly in every row, else the symptom."""
        injector = Injector(self.files, point)
        try:
            outcome = run_batched(self.model, self.processor, injector)
        except BaseException as error:  # noqa: BLE001 - any failure of the check or the recovery is the finding
            return f"{type(error).__name__}: {str(error)[:300]}"
        if not injector.fired:
            return "the point was not reached (the run is not deterministic)"
        for b, row in enumerate(outcome.rows):
            symptom = compare_row(row, self.reference(row.replayed), outcome.interrupted)
            if symptom is not None:
                return f"row {b}: {symptom}"
        return None


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def model_name(request):
    return request.param


@pytest.fixture(scope="module")
def harness(model_name, tmp_path_factory):
    return Harness(*load_tiny(model_name, tmp_path_factory, "batch_interrupts"))


def test_the_batched_dialogue_equals_each_row_alone(harness):
    """The harness itself: the uninterrupted batched dialogue equals each row's batch-1 replay, and it exercises
    what the points must cover (an early stop that keeps its deferred tokens for the next turn, `complete_deferred`
    of the batch, folding, a new plan in turn 2, restoring after an early stop in shared steps, the shared blocking
    completion)."""
    plain = run_batched(harness.model, harness.processor)
    assert plain.interrupted is None
    for b, row in enumerate(plain.rows):
        assert compare_row(row, harness.reference(row.replayed), None) is None, f"row {b}"
    stats = [row.cache.turn_stats for row in plain.rows]
    assert all(s[0].deferred > 0 for s in stats)  # every row has an image in turn 1
    assert stats[0][0].restored_during_decode == 0 and stats[0][0].pending_at_answer_end == stats[0][0].deferred
    # complete_deferred(max_tokens=3) of the batch, then turn 2 folds the rest (row 2 has nothing left)
    assert [s[0].restored_after_answer for s in stats] == [min(3, s[0].pending_at_answer_end) for s in stats]
    folded = [s[1].restored_in_prefill for s in stats]
    assert folded == [s[0].pending_at_answer_end - s[0].restored_after_answer for s in stats]
    assert folded[0] > 0 and folded[1] > 0 and folded[2] == 0
    assert stats[0][1].deferred == 0 and stats[1][1].deferred > 0 and stats[2][1].deferred > 0
    # row 1 stopped before its first fused step: its plan is restored after its answer (in the shared steps while
    # the others decode, then by the shared blocking completion); row 2 restores its plan during decode
    assert stats[1][1].restored_during_decode == 0 and stats[1][1].restored_after_answer == stats[1][1].deferred
    assert stats[2][1].restored_during_decode > 0
    points = harness.points()
    assert {p.phase for p in points} == set(TRACED_PHASES)
    files = {p.file for p in points}
    assert {"generation/batch.py", "generation/shared_batch.py", "generation/shared_rows.py", "generation/row_stops.py",
            "generation/completion.py", "cache/batched.py", "cache/transaction.py",
            "cache/deferred_cache.py"} <= files, files


def test_complete_deferred_of_a_batch_with_a_row_not_started(harness):
    """`complete_deferred` of a `BatchedDeferredPrefillCache` holding None (a conversation not started yet) next
    to rows with pending tokens completes those rows as each row's batch-1 `complete_deferred` does."""
    model, processor = harness.model, harness.processor
    turn = DIALOGUE[0]
    group = BatchedDeferredPrefillCache([None] * ROWS)
    _generate(model, first_turn_batch(processor, turn), group, 3, "next_turn",
              pad_token_id=processor.tokenizer.pad_token_id)
    pending = group.row_pending
    assert all(n > 2 for n in pending)
    mixed = BatchedDeferredPrefillCache([group.rows[0], None, group.rows[2]])
    assert complete_deferred(model, mixed, max_tokens=2) == 4
    assert group.row_pending == [pending[0] - 2, pending[1], pending[2] - 2]
    assert complete_deferred(model, mixed) == pending[0] + pending[2] - 4 and mixed.pending == 0
    for b in (0, 2):
        reference = run_row_alone(model, processor, (Step("turn1", turn.messages[b], 3, "next_turn"),))
        assert compare_row(RowOutcome(cache=group.rows[b]), reference, "turn1") is None, f"row {b}"


def test_interrupt_at_any_line_of_a_batched_turn_recovers_exactly(harness, model_name):
    points = selected_points(harness.points(), DEFAULT_POINTS[model_name])
    failures = failing_points(harness.check, points)
    assert not failures, f"{len(failures)} of {len(points)} interrupt points ({model_name}, batched) do not " \
        "recover:\n" + "\n".join(failures)


@pytest.mark.slow
def test_interrupt_at_every_line_of_a_batched_turn_recovers_exactly(harness, model_name, request):
    if "slow" not in (request.config.getoption("-m") or ""):
        pytest.skip("exhaustive (every distinct point): select it with -m slow")
    points = selected_points(harness.points(), None)
    failures = failing_points(harness.check, points)
    assert not failures, f"{len(failures)} of {len(points)} interrupt points ({model_name}, batched) do not " \
        "recover:\n" + "\n".join(failures)


if __name__ == "__main__":  # list the points: python tests/test_batch_interrupts.py [qwen3_vl|qwen3_5]
    import pathlib
    import tempfile

    class _Tmp:
        def mktemp(self, name):
            return pathlib.Path(tempfile.mkdtemp(prefix=name))

    for name in sys.argv[1:] or ["qwen3_vl"]:
        for p in Harness(*load_tiny(name, _Tmp(), "batch_interrupts")).points():
            print(p)
