"""`SerialScheduler`: runs the server's turns one at a time on one thread, and restores deferred tokens when idle.

Every use of the model (a request's `generate`, a restoration chunk) happens on this one thread, so requests are
served one at a time and never share a forward with another conversation; this is the "lock around the model".
The request path only talks to the scheduler through ``submit(job)`` (a `turn.TurnJob`: the parsed messages,
generation config, streamer, and the two futures it settles), so a batching scheduler that steps several
conversations' decodes together can replace this class without touching the handler or the pool.

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

from ..generation import complete_deferred
from .pool import ConversationPool
from .turn import TurnJob, run_turn

logger = logging.getLogger("hf_raincheck.serve")
_STOP = object()


class SerialScheduler:
    """One worker thread for the model: queued turns first, deferred-token restoration when idle.

    Args:
        pool: the conversation pool.
        restore_between_requests: restore pending deferred tokens when idle (False: leave them to the
            conversation's next request, folded into its prefill).
        restore_chunk: tokens per restoration step (None: each cache's ``completion_chunk_size``).
    """

    def __init__(self, pool: ConversationPool, restore_between_requests: bool = True, restore_chunk: int | None = None):
        self.pool = pool
        self.restore_between_requests = restore_between_requests
        self.restore_chunk = restore_chunk
        self.restored_between_requests = 0
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._busy = False
        self._thread = threading.Thread(target=self._loop, name="raincheck-serve-model", daemon=True)
        self._thread.start()

    def submit(self, job: TurnJob) -> None:
        with self._idle:
            self._busy = True
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
                job = self._queue.get_nowait() if conv is not None else self._next_or_idle()
            except queue.Empty:
                self._restore(conv)
                continue
            if job is _STOP:
                return
            try:
                run_turn(job, self.pool)
            except BaseException as error:  # noqa: BLE001 - the thread must survive any request
                logger.exception("turn failed")
                job.resolve(job.prepared, error=error)
                job.resolve(job.done, error=error)

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
            logger.exception("restoring conversation %s failed; it is dropped", conv.id)
            self.pool.discard(conv)
            return
        self.pool.remeasure(conv)
