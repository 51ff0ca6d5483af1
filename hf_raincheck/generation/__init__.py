"""`enable_raincheck`, the per-step splice, and completion."""

from .completion import complete_deferred
from .enable import enable_raincheck
from .schedule import FixedChunkSchedule

__all__ = ["enable_raincheck", "complete_deferred", "FixedChunkSchedule"]
