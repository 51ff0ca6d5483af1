"""Prefilling deferred tokens outside decoding: `complete_deferred`, and the chunk loop it shares with the worker."""

from __future__ import annotations

import torch

from ..cache import DeferredPrefillCache
from .state import raincheck_state
from .rows import deferred_rows, run_rows


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

    A background worker still running on the cache is stopped first (after its current chunk); an error it
    raised is raised here (chained), once.

    Args:
        model: the model the cache belongs to (after `enable_raincheck`).
        cache: a `DeferredPrefillCache` returned by `generate`.
        max_tokens: stop after this many tokens (``None``: all that is pending).

    Returns:
        How many deferred tokens were prefilled now.
    """
    if not isinstance(cache, DeferredPrefillCache):
        raise ValueError(f"complete_deferred: cache must be a DeferredPrefillCache, got {type(cache).__name__}")
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
