"""Prefilling deferred tokens outside decoding: `complete_deferred`, and the chunk loop it shares with the worker."""

from __future__ import annotations

import torch

import contextlib

from ..cache import DeferredPrefillCache
from ..cache.batched import BatchedDeferredPrefillCache
from .state import raincheck_state
from .rows import deferred_rows, run_rows
from .shared_rows import row_transactions, run_shared_rows


@torch.no_grad()
def prefill_pending(state, cache: DeferredPrefillCache, budget: int, chunk_size: int) -> int:
    """Prefills up to `budget` pending deferred tokens of ``cache.plan`` in forwards of `chunk_size` rows.

    The caller holds ``cache.lock``. Counts them as restored after the answer; returns how many were prefilled.
    Each chunk (its forward, the plan's progress, the counters) is one `DeferredPrefillCache.transaction`: an
    interrupt leaves the chunks before it done and the rest pending.
    """
    plan = cache.plan
    if plan is None:
        return 0
    budget = min(budget, plan.pending)
    config = cache.config
    done = 0
    while done < budget:
        count = min(chunk_size, budget - done)
        rows = deferred_rows(plan, count)
        with cache.transaction():
            run_rows(state.adapter, cache, rows, plan, state.backend(config), config.visibility, want_logits=False)
            cache.record_restored("after_answer", count)
        done += count
    return done


def complete_deferred(model, cache: DeferredPrefillCache, max_tokens: int | None = None) -> int:
    """Prefills the deferred tokens of `cache` that are still pending, in ``completion_chunk_size`` chunks.

    `cache` may also be a `BatchedDeferredPrefillCache` (a batch's rows): every row's pending tokens are prefilled
    in forwards shared by the rows (`max_tokens` then caps each row).

    A background worker still running on the cache is stopped first (after its current chunk); an error it
    raised is raised here (chained), once.

    Args:
        model: the model the cache belongs to (after `enable_raincheck`).
        cache: a `DeferredPrefillCache` returned by `generate`.
        max_tokens: stop after this many tokens (``None``: all that is pending).

    Returns:
        How many deferred tokens were prefilled now.
    """
    if isinstance(cache, BatchedDeferredPrefillCache):
        return _complete_rows(model, cache, max_tokens)
    if not isinstance(cache, DeferredPrefillCache):
        raise ValueError(
            "complete_deferred: cache must be a DeferredPrefillCache or a BatchedDeferredPrefillCache, got "
            f"{type(cache).__name__}"
        )
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0):
        raise ValueError(f"complete_deferred: max_tokens must be None or an int >= 0, got {max_tokens!r}")
    state = raincheck_state(model, "complete_deferred")
    cache.bind_model(model)
    cache.check_usable("complete_deferred")
    cache.stop_completion()
    cache.raise_completion_error()
    # (one line, as in `generate`: no line event between the work and the lock's release)
    with cache.lock: return _complete_locked(state, cache, max_tokens)  # noqa: E701


def _complete_locked(state, cache: DeferredPrefillCache, max_tokens: int | None) -> int:
    if cache.pending == 0:
        return 0
    budget = cache.pending if max_tokens is None else max_tokens
    return prefill_pending(state, cache, budget, cache.config.completion_chunk_size)


def _complete_rows(model, group: BatchedDeferredPrefillCache, max_tokens: int | None) -> int:
    """`complete_deferred` of a batch's rows: shared forwards of up to ``completion_chunk_size`` tokens per row."""
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0):
        raise ValueError(f"complete_deferred: max_tokens must be None or an int >= 0, got {max_tokens!r}")
    state = raincheck_state(model, "complete_deferred")
    rows = [r for r in group.rows if r is not None]
    for row in rows:
        row.bind_model(model)
        row.check_usable("complete_deferred")
        row.stop_completion()
        row.raise_completion_error()
    before = sum(r.pending for r in rows)
    configs = [r.config for r in rows if r.pending]
    if not configs:
        return 0
    if len(rows) != group.batch_size:  # a row not started yet (None) has nothing to complete: the others share
        group = BatchedDeferredPrefillCache(rows)
    with contextlib.ExitStack() as locks:
        for row in sorted(rows, key=id):
            locks.enter_context(row.lock)
        complete_shared(state.adapter, group, configs[0], state.backend(configs[0]), max_tokens)
    return before - sum(r.pending for r in rows)


@torch.no_grad()
def complete_shared(adapter, group: BatchedDeferredPrefillCache, config, backend: str,
                    max_tokens: int | None = None) -> None:
    """Blocking completion of every row: shared forwards of up to ``completion_chunk_size`` deferred rows per row,
    until nothing is pending or each row did `max_tokens` (each chunk one transaction per row cache)."""
    caches = group.rows
    left = [c.pending if max_tokens is None else min(max_tokens, c.pending) for c in caches]
    while any(left):
        counts = [min(config.completion_chunk_size, n) for n in left]
        left = [n - c for n, c in zip(left, counts)]
        with row_transactions(caches):
            items = [(deferred_rows(c.plan, n), c.plan) if n else (None, None) for c, n in zip(caches, counts)]
            run_shared_rows(adapter, group, items, backend, config.visibility, want_logits=False)
            for cache, n in zip(caches, counts):
                cache.record_restored("after_answer", n)
