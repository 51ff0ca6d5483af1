"""How many deferred tokens each decode step carries (docs/design.md, rule 4)."""

from __future__ import annotations

from typing import Callable


class FixedChunkSchedule:
    """``chunk_size`` deferred tokens per decode step once ``step > guard_tokens`` (steps count from 1)."""

    def __init__(self, chunk_size: int, guard_tokens: int):
        self.chunk_size = chunk_size
        self.guard_tokens = guard_tokens

    def __call__(self, step: int, pending: int) -> int:
        if step <= self.guard_tokens or pending <= 0:
            return 0
        return min(self.chunk_size, pending)

    def __repr__(self) -> str:
        return f"FixedChunkSchedule(chunk_size={self.chunk_size}, guard_tokens={self.guard_tokens})"


def carried_tokens(schedule: Callable[[int, int], int], step: int, pending: int) -> int:
    """Asks `schedule` and checks its answer; more than `pending` carries all that is pending."""
    if pending <= 0:
        return 0
    count = schedule(step, pending)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(
            f"RaincheckConfig.schedule must return an int >= 0 (deferred tokens to carry), got {count!r} "
            f"at decode step {step}"
        )
    return min(count, pending)
