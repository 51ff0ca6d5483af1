"""The ``usage.raincheck`` extension of a chat completion's usage (documented in the package README)."""

from __future__ import annotations


def raincheck_usage(*, reused: bool, cached_tokens: int, record, previous_record, batch_size: int) -> dict:
    """Raincheck's accounting of one request.

    Keys:
        conversation_cache: ``"reused"`` (the request continued a pooled conversation's cache: only the new
            tokens were prefilled) or ``"new"`` (a new cache: the whole prompt was prefilled).
        cached_tokens: prompt tokens already in the reused cache (not fed again); also in
            ``usage.prompt_tokens_details.cached_tokens``.
        deferred: visual tokens of this request's new images deferred by the first prefill.
        restored_in_prefill: earlier deferred tokens still pending, folded into this request's prefill.
        restored_during_decode: deferred tokens carried by this answer's fused decode steps.
        pending_at_answer_end: deferred tokens left when the answer ended; the server restores them between
            requests (reported by the conversation's next request as ``previous_restored_after_answer``).
        previous_restored_after_answer: the previous answer's deferred tokens restored between the two requests.
        batch_size: the requests (rows) of the `generate` call that answered this one (1: it ran alone); the
            server's totals are in ``GET /v1/raincheck/stats`` (``batches``).
    """
    return {
        "conversation_cache": "reused" if reused else "new",
        "cached_tokens": cached_tokens,
        "deferred": record.deferred if record is not None else 0,
        "restored_in_prefill": record.restored_in_prefill if record is not None else 0,
        "restored_during_decode": record.restored_during_decode if record is not None else 0,
        "pending_at_answer_end": record.pending_at_answer_end if record is not None else 0,
        "previous_restored_after_answer": previous_record.restored_after_answer if previous_record is not None else 0,
        "batch_size": batch_size,
    }
