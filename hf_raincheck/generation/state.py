"""`RaincheckState`: what `enable_raincheck` attaches to a model instance, and `raincheck_state` to read it.

A module of its own so that everything that runs on an enabled model (`generate`, `complete_deferred`, the
background worker, `RaincheckChat`) reads the state without importing `enable` (no import circle).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import attention
from ..config import RaincheckConfig
from ..models import ModelAdapter

STATE_ATTR = "_raincheck_state"


@dataclass
class RaincheckState:
    """The adapter and the original methods of an enabled model, and its compiled static steps."""

    adapter: ModelAdapter
    original_generate: object
    original_forward: object
    static_steps: dict = field(default_factory=dict)  # compiled static steps by compile options
    warned_multi_device: bool = False  # the "compiled steps need one device" warning was given

    @staticmethod
    def backend(config: RaincheckConfig) -> str:
        return attention.resolve_backend(config.attn_backend)


def raincheck_state(model, caller: str) -> RaincheckState:
    """The `RaincheckState` of `model`; a ValueError naming `caller` when `enable_raincheck` was not called."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{caller}: call enable_raincheck(model) first")
    return state
