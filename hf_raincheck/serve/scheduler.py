"""`BatchingScheduler`: runs the server's turns on one model thread, batching concurrent requests into shared
`generate` calls, and restores deferred tokens when idle.

Every use of the model (a `generate`, a restoration chunk) happens on this one thread; this is the "lock around
the model". The request path only talks to the scheduler through ``submit(job)`` (a `turn.TurnJob`: the parsed
messages, generation config, streamer, and the two futures it settles).

Collecting a batch: the requests queued when the model thread takes the next one are collected together (those
that arrived while the model was busy), up to ``max_batch_size``; when fewer are queued, it waits until
``batch_window_s`` after the first one arrived for more (a request that already waited that long is not held
back). Each collected request is prepared (`turn.prepare_turn`: its conversation, inputs, context check; a bad
one gets its 4xx), then the prepared ones are grouped by `batch.batch_key` (equal generation settings;
``max_tokens`` may differ) and each group runs as one batched `generate` (`batch.run_batch`), in order of
arrival. ``max_batch_size=1`` serves requests one at a time.

Between requests (the queue is empty), it restores the pending deferred tokens of pooled conversations, the
most recently used first, one `complete_deferred` chunk (``completion_chunk_size`` tokens) at a time, checking
the queue before each chunk: a new request waits for at most one chunk. Each deferred token is prefilled exactly
once: the cache's plan counts what was restored, and a request that continues a conversation folds what is still
pending into its own prefill.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from ..generation import complete_deferred
from .batch import BatchStats, group_turns, run_batch
from .pool import ConversationPool
from .turn import TurnJob, fail_turn, log_failure, prepare_turn

logger = logging.getLogger("hf_raincheck.serve")
_STOP = object()

DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_BATCH_WINDOW_S = 0.005


class BatchingScheduler:
    """One worker thread for the model: queued turns in batches first, deferred-token restoration when idle.

    Args:
        pool: the conversation pool.
        restore_between_requests: restore pending deferred tokens when idle (False: leave them to the
            conversation's next request, folded into its prefill).
        restore_chunk: tokens per restoration step (None: each cache's ``completion_chunk_size``).
        max_batch_size: the most requests collected at once, and the most rows of one `generate` call (1: one
            request at a time).
        batch_window_s: how long after a request arrives the scheduler waits for more to batch with it (0: only
            those already queued).

    Attributes:
        batch_stats: the `batch.BatchStats` of the calls so far.
        restored_between_requests: deferred tokens restored while idle.
    """

    def __init__(self, pool: ConversationPool, restore_between_requests: bool = True, restore_chunk: int | None = None,
                 max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, batch_window_s: float = DEFAULT_BATCH_WINDOW_S):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"BatchingScheduler: max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if (isinstance(batch_window_s, bool) or not isinstance(batch_window_s, (int, float))
                or not 0 <= batch_window_s <= 10):
            raise ValueError(f"BatchingScheduler: batch_window_s must be a number of seconds in [0, 10], got "
                             f"{batch_window_s!r}")
        self.pool = pool
        self.restore_between_requests = restore_between_requests
        self.restore_chunk = restore_chunk
        self.max_batch_size = max_batch_size
        self.batch_window_s = float(batch_window_s)
        self.batch_stats = BatchStats()
        self.restored_between_requests = 0
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._busy = False
        self._thread = threading.Thread(target=self._loop, name="raincheck-serve-model", daemon=True)
        self._thread.start()

    def submit(self, job: TurnJob) -> None:
        with self._idle:
            self._busy = True
            job.submitted = time.monotonic()
            self._queue.put(job)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until no turn is queued or running and nothing is left to restore; True if so in time."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._busy, timeout)

    def stop(self, timeout: float = 30.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ the model's thread
    def _loop(self) -> None:
        while True:
            conv = self.pool.restorable() if self.restore_between_requests else None
            try:
                first = self._queue.get_nowait() if conv is not None else self._next_or_idle()
            except queue.Empty:
                self._restore(conv)
                continue
            if first is _STOP:
                return
            jobs, stop = self._collect(first)
            self._run(jobs)
            if stop:
                return

    def _collect(self, first: TurnJob) -> tuple[list[TurnJob], bool]:
        """`first` and the requests queued with it or arriving within the window; (jobs, stop requested)."""
        jobs = [first]
        deadline = first.submitted + self.batch_window_s
        while len(jobs) < self.max_batch_size:
            try:
                wait = deadline - time.monotonic()
                job = self._queue.get_nowait() if wait <= 0 else self._queue.get(timeout=wait)
            except queue.Empty:
                break
            if job is _STOP:
                return jobs, True
            jobs.append(job)
        return jobs, False

    def _run(self, jobs: list[TurnJob]) -> None:
        turns = []
        for job in jobs:
            try:
                turn = prepare_turn(job, self.pool)
            except BaseException as error:  # noqa: BLE001 - the thread must survive any request
                log_failure(logger, "preparing a turn failed")
                job.resolve(job.prepared, error=error)
                job.resolve(job.done, error=error)
                continue
            if turn is not None:
                turns.append(turn)
        for group in group_turns(turns, self.max_batch_size):
            try:
                run_batch(group, self.pool, self.batch_stats)
            except BaseException as error:  # noqa: BLE001 - the thread must survive any request
                log_failure(logger, "running a batch failed")
                for turn in group:
                    fail_turn(turn, error)

    def _next_or_idle(self):
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            with self._idle:
                if self._queue.empty():
                    self._busy = False
                    self._idle.notify_all()
            job = self._queue.get()
            with self._idle:
                self._busy = True
            return job

    def _restore(self, conv) -> None:
        model = conv.model_ref()
        if model is None:
            self.pool.discard(conv)
            return
        chunk = self.restore_chunk or conv.cache.config.completion_chunk_size
        try:
            self.restored_between_requests += complete_deferred(model, conv.cache, max_tokens=chunk)
        except Exception:  # noqa: BLE001 - the cache stays consistent, but stop retrying this conversation
            log_failure(logger, "restoring conversation %s failed; it is dropped", conv.id)
            self.pool.discard(conv)
            return
        self.pool.remeasure(conv)
