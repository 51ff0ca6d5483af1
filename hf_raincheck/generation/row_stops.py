"""Which rows of a batched Raincheck `generate` have stopped.

transformers' sampling loop keeps stopped rows in the batch and feeds them padding (after their last token) until
every row stops; those tokens must not reach a stopped row's cache (its batch-1 run never fed them). The loop
ANDs the stopping criteria's per-row answer into its own ``unfinished_sequences`` each step; an enabled model's
``_get_stopping_criteria`` (`stopping_criteria`, transformers_coupling point 15) returns the same criteria in a
`RowStops` that also remembers that answer, for the batched call running on the thread.
"""

from __future__ import annotations

import torch
from transformers import StoppingCriteriaList

from .state import raincheck_state


class RowStops(StoppingCriteriaList):
    """transformers' stopping criteria of one call, recording ``finished`` (bool ``[B]``: rows that stopped)."""

    finished: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        done = super().__call__(input_ids, scores, **kwargs)
        self.finished = done if self.finished is None else self.finished | done
        return done


class RowStopsSlot:
    """The running batched call's `RowStops`, once transformers builds them (see `recording`)."""

    def __init__(self):
        self.stops: RowStops | None = None

    def finished_rows(self, batch: int) -> list[bool]:
        """Host list: which of the `batch` rows stopped (one device-to-host copy)."""
        if self.stops is None or self.stops.finished is None:
            return [False] * batch
        return [bool(x) for x in self.stops.finished.tolist()]


def stopping_criteria(model, *args, **kwargs):
    """``model._get_stopping_criteria`` of an enabled instance: transformers' own criteria, recorded in a
    `RowStops` when a batched Raincheck call on this thread asked for it."""
    state = raincheck_state(model, "_get_stopping_criteria")
    criteria = state.original_stopping_criteria(*args, **kwargs)
    slot = getattr(state.row_stops, "slot", None)
    if slot is None:
        return criteria
    slot.stops = RowStops(list(criteria))
    return slot.stops
