"""`RaincheckState`: what `enable_raincheck` keeps on a model instance (its adapter, the original methods...).

A module of its own so that everything that runs on an enabled model (`generate`, `complete_deferred`, the
background worker, `RaincheckChat`) reads the state without importing `enable` (no import circle).
"""

from __future__ import annotations

import copy
import threading
import weakref
from dataclasses import dataclass, field

from .. import attention
from ..config import RaincheckConfig
from ..models import ModelAdapter

STATE_ATTR = "_raincheck_state"


@dataclass
class RaincheckState:
    """Held by an enabled model under ``model._raincheck_state``.

    A deep copy of the model (``copy.deepcopy``) gets a state of its own: the adapter and the original methods
    follow the copy (deepcopy maps the model to its copy); compiled steps and cache registrations start empty.
    """

    adapter: ModelAdapter
    original_generate: object
    original_forward: object
    original_stopping_criteria: object = None  # transformers' `_get_stopping_criteria` (batches record row stops)
    # the instance attributes `generate` / `forward` had before enabling (absent: the class's methods), restored
    # by `disable_raincheck`
    own_attrs: dict = field(default_factory=dict)
    static_steps: dict = field(default_factory=dict)  # compiled static steps by compile options
    warned_multi_device: bool = False  # the "compiled steps need one device" warning was given
    # the DeferredPrefillCaches bound to this model (weakly): `disable_raincheck` stops their background workers
    caches: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)
    # the `RowStops` of the batched generate running on this thread, if any (`generation/row_stops.py`)
    row_stops: threading.local = field(default_factory=threading.local)

    @staticmethod
    def backend(config: RaincheckConfig) -> str:
        return attention.resolve_backend(config.attn_backend)

    def register_cache(self, cache) -> None:
        self.caches[id(cache)] = cache

    def __deepcopy__(self, memo):
        return RaincheckState(
            adapter=copy.deepcopy(self.adapter, memo),
            original_generate=copy.deepcopy(self.original_generate, memo),
            original_forward=copy.deepcopy(self.original_forward, memo),
            original_stopping_criteria=copy.deepcopy(self.original_stopping_criteria, memo),
            own_attrs=copy.deepcopy(self.own_attrs, memo),
        )


def raincheck_state(model, caller: str) -> RaincheckState:
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{caller}: call enable_raincheck(model) first")
    return state
