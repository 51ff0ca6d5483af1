"""hf_raincheck: deferred multimodal prefill ("Raincheck") for Hugging Face transformers VLMs."""

from .cache import BatchedDeferredPrefillCache, DeferralPlan, DeferredPrefillCache, TurnRestore, release_static_buffers
from .chat import RaincheckChat, TurnStats
from .config import RaincheckConfig
from .generation import FixedChunkSchedule, complete_deferred, disable_raincheck, enable_raincheck

__version__ = "0.1.0"

__all__ = [
    "RaincheckConfig",
    "enable_raincheck",
    "disable_raincheck",
    "DeferredPrefillCache",
    "BatchedDeferredPrefillCache",
    "DeferralPlan",
    "complete_deferred",
    "FixedChunkSchedule",
    "RaincheckChat",
    "TurnStats",
    "TurnRestore",
    "release_static_buffers",
]
