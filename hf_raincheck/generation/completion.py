"""Prefilling deferred tokens outside decoding: `complete_deferred`."""

from __future__ import annotations

import torch

from ..cache import DeferredPrefillCache
from .rows import deferred_rows, run_rows


def complete_deferred(model, cache: DeferredPrefillCache, max_tokens: int | None = None) -> int:
    """Prefills the deferred tokens of `cache` that are still pending, in ``completion_chunk_size`` chunks.

    Args:
        model: the model the cache belongs to (after `enable_raincheck`).
        cache: a `DeferredPrefillCache` returned by `generate`.
        max_tokens: stop after this many tokens (``None``: all that is pending).

    Returns:
        How many deferred tokens were prefilled now.
    """
    from .enable import raincheck_state

    if not isinstance(cache, DeferredPrefillCache):
        raise ValueError(f"complete_deferred: cache must be a DeferredPrefillCache, got {type(cache).__name__}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0):
        raise ValueError(f"complete_deferred: max_tokens must be None or an int >= 0, got {max_tokens!r}")
    state = raincheck_state(model, "complete_deferred")
    with cache.lock:
        cache.bind_model(model)
        plan = cache.plan
        if plan is None or plan.pending == 0:
            return 0
        config = cache.config
        budget = plan.pending if max_tokens is None else min(max_tokens, plan.pending)
        done = 0
        with torch.no_grad():
            while done < budget:
                count = min(config.completion_chunk_size, budget - done)
                rows = deferred_rows(plan, count)
                run_rows(state.adapter, cache, rows, plan, state.backend(config), config.visibility, want_logits=False)
                done += count
        cache.stats.after_answer += done
        return done
