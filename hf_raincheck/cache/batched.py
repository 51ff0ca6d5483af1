"""`BatchedDeferredPrefillCache`: the per-row caches of one batched Raincheck `generate` call."""

from __future__ import annotations

from .deferred_cache import DeferredPrefillCache


class BatchedDeferredPrefillCache:
    """What a batched ``generate(raincheck_config=...)`` returns as ``past_key_values``: one batch-1
    `DeferredPrefillCache` per row, padding removed (see `DeferredPrefillCache`'s "Batches" section).

    Each row has its own plan, boundary, pending set and accounting, exactly as if it had been generated alone.

    Attributes / views:
        batch_size: the number of rows.
        rows: the row caches (``rows[i]`` is row i's `DeferredPrefillCache`).
        row_pending: ``list[int]``, deferred tokens still pending per row.
        row_total_deferred: ``list[int]``, deferred tokens of each row's current plan.
        row_plans: ``list[list[DeferralPlan]]``, every plan of each row.
        row_turn_stats: ``list[list[TurnRestore]]``, each row's per-call accounting.
        pending: the sum of ``row_pending``.
        split(): the row caches as a list; each continues exactly like a batch-1 conversation
            (``model.generate(**next_inputs_of_row_i, past_key_values=caches[i], raincheck_config=cfg)``).
        wait(timeout=None) / cancel(): every row's background completion worker (``completion="background"``).
    """

    def __init__(self, rows: list[DeferredPrefillCache | None]):
        if not isinstance(rows, (list, tuple)) or not rows or not all(
            r is None or isinstance(r, DeferredPrefillCache) for r in rows
        ):
            raise ValueError(
                "BatchedDeferredPrefillCache: rows must be a non-empty list of DeferredPrefillCache or None (None: "
                "a new conversation in that row)"
            )
        if len({id(r) for r in rows if r is not None}) != sum(r is not None for r in rows):
            raise ValueError("BatchedDeferredPrefillCache: the same DeferredPrefillCache appears in two rows")
        self.rows = list(rows)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def row_pending(self) -> list[int]:
        return [r.pending for r in self.rows]

    @property
    def row_total_deferred(self) -> list[int]:
        return [r.total_deferred for r in self.rows]

    @property
    def row_plans(self) -> list[list]:
        return [list(r.plans) for r in self.rows]

    @property
    def row_turn_stats(self) -> list[list]:
        return [list(r.turn_stats) for r in self.rows]

    @property
    def pending(self) -> int:
        return sum(self.row_pending)

    def split(self) -> list[DeferredPrefillCache]:
        """The B row caches (batch-1, no padding); each continues like a batch-1 conversation's cache."""
        return list(self.rows)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for every row's background worker; True when nothing is pending in any row."""
        return all([r.wait(timeout) for r in self.rows])

    def cancel(self) -> None:
        for r in self.rows:
            r.cancel()

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"BatchedDeferredPrefillCache(batch_size={self.batch_size}, row_pending={self.row_pending})"
