"""`CacheTransaction`: one forward and its bookkeeping change a cache all together, or not at all.

A forward writes KV entries and Gated DeltaNet states on the device, and the generation code then records what it
did on the host (which slots hold an entry, the plan's progress, the conversation's tokens, its plan and grids,
the counters). A ``KeyboardInterrupt`` (or any error) can land between any two of those steps. Every such change
runs inside ``with cache.transaction():``. On entry the transaction saves the cache's host state and references
to the GDN layer states (cheap: eager forwards build new tensors, never write them in place); if the block
raises, it puts all of it back and unmarks the slots the block marked, so the cache is as it was before the
block: the KV entries it wrote sit in slots that stay unmarked and are rewritten by whatever fills them next. If
the block completes, the changes stand, and the clean-ups registered with `after_commit` (freeing a finished
plan's store, its GDN checkpoints...) run: they only free memory, so an interrupt among them loses nothing
(`DeferredPrefillCache.tidy` repeats them).

One change cannot be undone: a compiled static step of a model with GDN layers updates the states in place. A
transaction interrupted after such a step started (`in_place_update`) leaves the cache marked unusable, and
every later call on it raises a clear error instead of continuing from states that no longer match the
bookkeeping.

Transactions do not nest: the code inside one (`run_rows`, a compiled step) records into the open one
(`DeferredPrefillCache.in_transaction`), and a new transaction replaces whatever is open. So a transaction whose
exit never ran (Python skips ``__exit__`` when a trace function raises at the ``with`` line's exit event) leaves
nothing behind that a later one would join: its changes were complete (the block had ended), and only its
memory clean-ups are left for `DeferredPrefillCache.tidy`.
"""

from __future__ import annotations

import torch


class CacheTransaction:
    """See the module docstring. Created by `DeferredPrefillCache.transaction`."""

    def __init__(self, cache):
        self.cache = cache
        self.saved = None
        self.marked: list[torch.Tensor] = []  # slots marked filled inside the block (unmarked on rollback)
        self.cleanups: list = []  # callables run once the outermost block commits
        self.in_place: str | None = None  # what changed the device state irreversibly, if anything

    def __enter__(self) -> "CacheTransaction":
        self.saved = self.cache._save_state()
        self.cache._transaction = self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        cache = self.cache
        if cache._transaction is self:
            cache._transaction = None
        if exc_type is None:
            for cleanup in self.cleanups:
                cleanup()
            return False
        cache._restore_state(self.saved, self.marked)
        if self.in_place is not None:
            cache._mark_unusable(
                f"{self.in_place} was interrupted ({exc_type.__name__}) after it had started changing the Gated "
                "DeltaNet states in place"
            )
        return False

