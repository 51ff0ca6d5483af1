"""The Raincheck cache: logical-slot KV layers plus the deferred store and plans."""

from .batched import BatchedDeferredPrefillCache
from .buffer_pool import release_static_buffers
from .deferred_cache import DeferredPrefillCache, RestoreStats, TurnRestore
from .forward_context import ForwardContext
from .plan import DeferralPlan
from .slot_layer import SlotLayer

__all__ = [
    "BatchedDeferredPrefillCache",
    "DeferredPrefillCache",
    "DeferralPlan",
    "ForwardContext",
    "RestoreStats",
    "SlotLayer",
    "TurnRestore",
    "release_static_buffers",
]
