"""`enable_raincheck` / `disable_raincheck`, the per-step splice, and completion."""

from .completion import complete_deferred
from .enable import enable_raincheck
from .install import disable_raincheck
from .schedule import FixedChunkSchedule

__all__ = ["enable_raincheck", "disable_raincheck", "complete_deferred", "FixedChunkSchedule"]
