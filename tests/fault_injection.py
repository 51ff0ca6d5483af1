"""Fault injection for tests: raise ``KeyboardInterrupt`` at a chosen line event of chosen source files.

Built on ``sys.settrace`` (the calling thread only; other threads, e.g. a background completion worker, run
untraced). A first pass records every line event of the traced files (`record_points`); each recorded event is a
`Point`, identified deterministically by

    phase:file:line@stack#occurrence

- ``phase``: a label the test sets around each part of its run (``tracer.phase = "turn2"``);
- ``file``: the source path relative to the ``hf_raincheck`` package (``generation/enable.py``);
- ``stack``: the enclosing functions that lie in traced files, outermost first (``_generate>_forward>_turn_step``),
  so the same line reached through different callers (a prefill, a decode step, a completion chunk) is a
  different point;
- ``occurrence``: the 1-based count of that (phase, file, line, stack) event within the phase.

An `Injector` then raises ``KeyboardInterrupt`` in the traced code right before that line runs (as Ctrl-C
would), once. Python unsets a trace function that raised, so the rest of the run is untraced.

Some line events are not points, because an exception raised there by a trace function lands where an
asynchronous one (a signal handler's ``KeyboardInterrupt``, which CPython raises only right after a call, at a
loop's jump back and at a function's entry) never can: between two exception-handling regions. They are the
no-op of a ``try:`` line and the second event of a ``with`` line (its ``__exit__`` call on the way out: raised
there, the ``with``'s ``__exit__`` is skipped and a lock stays held), and the first line of a ``finally:`` or a
try's ``else:`` block (a Ctrl-C during the try body's last call is raised inside the try, so the handlers and the
``finally`` see it). Injected there, they would be false findings. Nor are the lines of a ``weakref.finalize``
callback and what it calls (a freed static batch's `_retire`): the garbage collector may run it at any allocation,
so whether and where a run reaches it is not deterministic, and Python reports and drops an exception raised in it
("Exception ignored in"), so an interrupt there never reaches the caller.

    recorder = LineRecorder(files)
    with recorder:
        recorder.phase = "turn1"; run_turn_1()
    for point in distinct_points(recorder.events):
        with Injector(files, point) as injector:
            ...  # the same run; KeyboardInterrupt at `point`; injector.fired tells whether it was reached
"""

from __future__ import annotations

import ast
import dis
import os
import sys
import threading
import weakref
from collections import Counter
from dataclasses import dataclass
from glob import glob

import hf_raincheck

PACKAGE_DIR = os.path.dirname(os.path.abspath(hf_raincheck.__file__))


def package_files(*patterns: str) -> frozenset[str]:
    """Absolute paths of the package's source files matching `patterns` (globs relative to the package)."""
    paths = set()
    for pattern in patterns:
        matched = glob(os.path.join(PACKAGE_DIR, pattern))
        if not matched:
            raise ValueError(f"package_files: {pattern!r} matches no file under {PACKAGE_DIR}")
        paths.update(os.path.abspath(p) for p in matched)
    return frozenset(paths)


def _relative(path: str) -> str:
    return os.path.relpath(path, PACKAGE_DIR).replace(os.sep, "/")


@dataclass(frozen=True, order=True)
class Point:
    """One line event: ``phase:file:line@stack#occurrence`` (see the module docstring)."""

    phase: str
    file: str
    line: int
    stack: tuple[str, ...]
    occurrence: int = 1

    def __str__(self) -> str:
        return f"{self.phase}:{self.file}:{self.line}@{'>'.join(self.stack)}#{self.occurrence}"

    @classmethod
    def parse(cls, text: str) -> "Point":
        """The inverse of ``str(point)``."""
        try:
            head, occurrence = text.rsplit("#", 1)
            where, stack = head.split("@", 1)
            phase, file, line = where.split(":")
            return cls(phase, file, int(line), tuple(stack.split(">")) if stack else (), int(occurrence))
        except ValueError as error:
            raise ValueError(f"Point.parse: expected 'phase:file:line@stack#occurrence', got {text!r}") from error

    @property
    def site(self) -> str:
        """``file:line`` (what a failure report names)."""
        return f"{self.file}:{self.line}"


_STATEMENT_LINES: dict = {}  # path -> (lines of `try` statements, lines of `with` statements)
_LINE_STARTS: dict = {}  # code object -> {line: its first bytecode offset}


def _statement_lines(path: str) -> tuple[frozenset, frozenset]:
    """Lines no asynchronous exception can land before (`try:` lines, the first lines of `finally:` and try
    `else:` blocks), and the lines of `with` statements."""
    if path not in _STATEMENT_LINES:
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read(), path)
        skipped = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try):
                skipped.add(node.lineno)
                skipped.update(block[0].lineno for block in (node.finalbody, node.orelse) if block)
        withs = frozenset(n.lineno for n in ast.walk(tree) if isinstance(n, ast.With))
        _STATEMENT_LINES[path] = (frozenset(skipped), withs)
    return _STATEMENT_LINES[path]


def injectable(frame) -> bool:
    """Whether an asynchronous ``KeyboardInterrupt`` could arrive at this line event (see the module docstring)."""
    tries, withs = _statement_lines(frame.f_code.co_filename)
    line = frame.f_lineno
    if line in tries:
        return False
    if line in withs:
        code = frame.f_code
        starts = _LINE_STARTS.get(code)
        if starts is None:
            starts = {}
            for offset, start_line in dis.findlinestarts(code):
                if start_line is not None and start_line not in starts:
                    starts[start_line] = offset
            _LINE_STARTS[code] = starts
        return frame.f_lasti <= starts.get(line, frame.f_lasti)
    return True


_FINALIZE_CALL = weakref.finalize.__call__.__code__


def _in_finalizer(frame) -> bool:
    """Whether `frame` runs inside a ``weakref.finalize`` callback (see the module docstring)."""
    frame = frame.f_back
    while frame is not None:
        if frame.f_code is _FINALIZE_CALL:
            return True
        frame = frame.f_back
    return False


class _LineTracer:
    """Calls `on_line(point)` for every injectable line event of `files` in the thread that enters it."""

    def __init__(self, files: frozenset[str]):
        self.files = files
        self.phase = ""
        self.counts: Counter = Counter()
        self._thread: threading.Thread | None = None
        self._previous = None

    def _stack(self, frame) -> tuple[str, ...]:
        names = []
        while frame is not None:
            if frame.f_code.co_filename in self.files:
                names.append(frame.f_code.co_name)
            frame = frame.f_back
        return tuple(reversed(names))

    def _global(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename in self.files and not _in_finalizer(frame):
            return self._local
        return None

    def _local(self, frame, event, arg):
        if event == "line" and injectable(frame):
            stack = self._stack(frame)
            key = (self.phase, _relative(frame.f_code.co_filename), frame.f_lineno, stack)
            self.counts[key] += 1
            self.on_line(Point(*key, self.counts[key]))
        return self._local

    def on_line(self, point: Point) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self):
        self._thread = threading.current_thread()
        self._previous = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._previous)
        return False


class LineRecorder(_LineTracer):
    """Records every line event of `files` (in order) as `Point`s in ``events``."""

    def __init__(self, files: frozenset[str]):
        super().__init__(files)
        self.events: list[Point] = []

    def on_line(self, point: Point) -> None:
        self.events.append(point)


class Injector(_LineTracer):
    """Raises ``KeyboardInterrupt`` right before the line event `point` (once); ``fired`` tells whether it did."""

    def __init__(self, files: frozenset[str], point: Point):
        super().__init__(files)
        self.point = point
        self.fired = False

    def on_line(self, point: Point) -> None:
        if not self.fired and point == self.point:
            self.fired = True
            raise KeyboardInterrupt(f"injected at {point}")


def distinct_points(events: list[Point], occurrences: str = "first_last") -> list[Point]:
    """The recorded events to inject at, in run order: per (phase, file, line, stack), its first occurrence
    (``occurrences="first"``), its first and last (``"first_last"``: a line of a decode step is hit at the first,
    plain step and at the last, fused one), or every occurrence (``"all"``)."""
    if occurrences not in ("first", "first_last", "all"):
        raise ValueError(f"distinct_points: occurrences must be 'first', 'first_last' or 'all', got {occurrences!r}")
    if occurrences == "all":
        return list(events)
    last: dict = {}
    for point in events:
        last[(point.phase, point.file, point.line, point.stack)] = point.occurrence
    chosen = []
    for point in events:
        key = (point.phase, point.file, point.line, point.stack)
        if point.occurrence == 1 or (occurrences == "first_last" and point.occurrence == last[key]):
            chosen.append(point)
    return chosen


def spread(points: list[Point], count: int | None) -> list[Point]:
    """At most `count` of `points`, evenly spaced over the run (deterministic; ``None``: all)."""
    if count is None or len(points) <= count:
        return list(points)
    if count <= 0:
        raise ValueError(f"spread: count must be positive or None, got {count}")
    step = len(points) / count
    return [points[int(k * step)] for k in range(count)]


def selected_points(points: list[Point], count: int | None) -> list[Point]:
    """The points a test injects at: ``HF_RAINCHECK_INTERRUPT_POINT`` (a point's id, or a prefix of ids) if set,
    else `spread` of `count`."""
    wanted = os.environ.get("HF_RAINCHECK_INTERRUPT_POINT")
    if wanted:
        chosen = [p for p in points if str(p) == wanted or str(p).startswith(wanted)]
        assert chosen, f"HF_RAINCHECK_INTERRUPT_POINT={wanted!r} matches none of the {len(points)} points"
        return chosen
    return spread(points, count)


def failing_points(check, points: list[Point]) -> list[str]:
    """``"point: symptom"`` for every point where ``check(point)`` reports a symptom (None: recovered)."""
    found = []
    for point in points:
        symptom = check(point)
        if symptom is not None:
            found.append(f"{point}: {symptom}")
    return found


def load_tiny(name: str, tmp_path_factory, prefix: str):
    """``(model, processor)`` of a tiny random ``"qwen3_vl"`` or ``"qwen3_5"`` (seed 0), saved under `prefix`."""
    from hf_raincheck.testing import build_tiny_qwen3_5, build_tiny_qwen3_vl, load_tiny_qwen3_5, load_tiny_qwen3_vl

    build, load = {"qwen3_vl": (build_tiny_qwen3_vl, load_tiny_qwen3_vl),
                   "qwen3_5": (build_tiny_qwen3_5, load_tiny_qwen3_5)}[name]
    return load(build(tmp_path_factory.mktemp(f"{prefix}_{name}") / "seed0", seed=0))
