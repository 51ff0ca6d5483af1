"""``completion="background"``: a cooperative worker that prefills a cache's pending deferred tokens between turns.

One `BackgroundCompletion` per cache (``cache.completion_worker``), started by `generate` when the answer ends with
deferred tokens pending. It prefills them in ``completion_chunk_size`` chunks through the same path as
`complete_deferred`, taking ``cache.lock`` for each chunk and releasing it in between, and checks its stop flag
before every chunk, so whoever stops it waits for at most one chunk.

It holds the model and the cache through weak references (taken strongly only for the length of a chunk): a
freed model or cache stops it cleanly, and so does interpreter exit. On CUDA it runs on its own stream: the
stream first waits for the work queued on the starting thread's stream, each chunk is synchronized before the
lock is released (so the next holder of the lock reads finished entries, and tensors the chunk read, the deferred
store included, are not recycled under it), and `join` makes the caller's current stream wait for the worker's
stream as well. Tensors the worker allocates are temporaries of its own stream; the KV buffers are written in
place (a chunk never grows them: deferred slots lie below the cache's length).
"""

from __future__ import annotations

import atexit
import threading
import traceback
import weakref
from contextlib import ExitStack

import torch

from .completion import prefill_pending
from .state import raincheck_state

_LIVE: "weakref.WeakSet[BackgroundCompletion]" = weakref.WeakSet()
_EXIT_JOIN_S = 30.0


class BackgroundCompletion:
    """A daemon thread prefilling ``cache.plan``'s pending deferred tokens in chunks; see the module docstring.

    Attributes:
        chunk_size: deferred tokens per forward.
        restored: tokens it prefilled so far.
        outcome: why it stopped: ``None`` (running), ``"done"``, ``"stopped"`` (asked to: preempted or
            cancelled), ``"model freed"``, ``"cache freed"``, ``"interpreter exit"`` or ``"failed"``.
        error: the exception that stopped it (``outcome == "failed"``), with its frames' locals cleared.
    """

    def __init__(self, model, cache, chunk_size: int):
        self.chunk_size = chunk_size
        self.restored = 0
        self.outcome: str | None = None
        self.error: BaseException | None = None
        self._model_ref = weakref.ref(model)
        self._cache_ref = weakref.ref(cache)
        self._stop = threading.Event()
        self._done = threading.Event()
        self._exiting = False
        device = cache.plan.store_embeds.device if cache.plan.store_embeds is not None else torch.device("cpu")
        self._device = device
        self._stream = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device=device)
            self._stream.wait_stream(torch.cuda.current_stream(device))  # start after the answer's work
        self._thread = threading.Thread(target=self._run, name="raincheck-completion", daemon=True)
        _LIVE.add(self)

    def start(self) -> None:
        """Starts the thread (after the cache records the worker: a thread the cache did not know of would
        prefill it unseen)."""
        self._thread.start()

    # ------------------------------------------------------------------ control (user thread)
    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def running(self) -> bool:
        """Started and not finished (a worker never started, its start interrupted, is not running)."""
        return self.started and not self._done.is_set()

    @property
    def stop_requested(self) -> threading.Event:
        """Set once `stop` was called (the worker checks it before each chunk)."""
        return self._stop

    def stop(self) -> None:
        """Asks the worker to stop before its next chunk (does not wait; see `join`)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the worker to end; True if it did. The caller's CUDA stream then waits for the worker's."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("the background completion worker cannot join itself")
        if not self.started:  # its start was interrupted: there is nothing to wait for
            self.outcome = self.outcome or "stopped"
            return True
        if not self._done.wait(timeout):
            return False
        self._thread.join()
        if self._stream is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._stream)
        return True

    # ------------------------------------------------------------------ the worker thread
    def _run(self) -> None:
        model = cache = None
        try:
            while True:
                cache = self._cache_ref()
                if cache is None:
                    self.outcome = "cache freed"
                    return
                with cache.lock:
                    if self._stop.is_set():
                        self.outcome = "interpreter exit" if self._exiting else "stopped"
                        return
                    model = self._model_ref()
                    if model is None:
                        self.outcome = "model freed"
                        return
                    if cache.pending == 0:
                        self.outcome = "done"
                        return
                    self.restored += self._chunk(model, cache)
                    model = None
                    if cache.pending == 0:
                        self.outcome = "done"
                        return
                cache = None
        except BaseException as error:  # noqa: BLE001 - stored, raised by the next user of the cache
            model = cache = None
            traceback.clear_frames(error.__traceback__)  # keep the message, drop references to model / cache
            self.error, self.outcome = error, "failed"
        finally:
            model = cache = None
            self._done.set()

    def _chunk(self, model, cache) -> int:
        state = raincheck_state(model, "background completion")
        plan = cache.plan
        # the deferred store was allocated on the user's stream and is released when its last token is restored:
        # keep it alive until this stream has finished reading it, so the allocator cannot hand it out earlier
        store = (plan.store_embeds, plan.store_deepstack, plan.store_positions)
        with ExitStack() as stack:
            if self._stream is not None:
                stack.enter_context(torch.cuda.device(self._device))
                stack.enter_context(torch.cuda.stream(self._stream))
            done = prefill_pending(state, cache, self.chunk_size, self.chunk_size)
            if self._stream is not None:
                self._stream.synchronize()
        del store
        return done


def start_background_completion(model, cache) -> BackgroundCompletion | None:
    """Starts a worker on `cache` (the caller holds ``cache.lock``) if deferred tokens are pending."""
    if cache.pending == 0:
        return None
    worker = BackgroundCompletion(model, cache, cache.config.completion_chunk_size)
    cache.attach_completion(worker)
    worker.start()
    return worker


@atexit.register
def _stop_all_at_exit() -> None:
    workers = list(_LIVE)
    for worker in workers:
        worker._exiting = True
        worker.stop()
    for worker in workers:
        if worker.started:
            worker._done.wait(_EXIT_JOIN_S)
