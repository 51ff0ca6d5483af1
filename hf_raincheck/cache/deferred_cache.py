"""`DeferredPrefillCache`: a transformers cache that also owns Raincheck's deferred store and bookkeeping."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import DynamicCache

from ..gdn_state.state import GDNLayerState
from .plan import DeferralPlan
from .slot_layer import SlotLayer

if TYPE_CHECKING:  # pragma: no cover
    from ..config import RaincheckConfig


@dataclass
class RestoreStats:
    """Deferred tokens restored, by when (counted over the cache's life)."""

    during_prefill: int = 0  # folded into a later turn's prefill
    during_decode: int = 0  # carried by fused decode steps
    after_answer: int = 0  # `complete_deferred` / blocking completion


class DeferredPrefillCache(DynamicCache):
    """A `DynamicCache` in the logical-slot layout that remembers what Raincheck deferred.

    Every token's key/value sits in the slot of its logical index (its index in the conversation's
    ``input_ids``); deferred slots stay empty and masked until restored, so a fully restored cache holds
    exactly the entries of a plain prefill and the next turn is a plain append.

    Thread safety: ``lock`` (a re-entrant lock) is held by every Raincheck operation on the cache
    (`generate`, `complete_deferred`); use one cache from one thread at a time, or hold ``cache.lock``.

    Attributes:
        config: the `RaincheckConfig` of the last `generate` call on this cache.
        plan: the current `DeferralPlan` (the most recent `generate` call with new images or video).
        total_deferred / pending: deferred tokens of the current plan, and those not yet prefilled.
        token_ids: the conversation's token ids for every slot the cache covers.
        stats: `RestoreStats`.
    """

    def __init__(self, num_layers: int, static: bool = False, max_cache_len: int = 0):
        super().__init__()
        self.layers = [SlotLayer(static=static, capacity=max_cache_len) for _ in range(num_layers)]
        self.layer_class_to_replicate = None
        self.static = static
        self.lock = threading.RLock()
        self.config: RaincheckConfig | None = None
        self.plan: DeferralPlan | None = None
        self.plans: list[DeferralPlan] = []
        self.token_ids: list[int] = []
        self.positions: torch.Tensor | None = None  # [3, length] logical positions of the covered slots
        self.rope_delta: int = 0
        self.media_grids: dict[str, torch.Tensor] = {}  # grids of the cached conversation's media, by modality
        self.pending_media_grids: dict[str, torch.Tensor] = {}  # set by a turn, committed by its prefill
        self.stats = RestoreStats()
        self._filled: torch.Tensor | None = None  # bool [capacity] on the model device
        self._model_ref = None
        # per-forward state read by `update`
        self._write_slots: torch.Tensor | None = None
        self._slots_by_device: dict = {}
        self._kv_len = 0
        self._gdn_step = None  # a `GDNStep` during a Raincheck forward of a model with GDN layers
        self._turn = None
        self.gdn_states: dict[int, GDNLayerState] = {}  # Gated DeltaNet layers' states, by layer index

    # ------------------------------------------------------------------ public bookkeeping
    @property
    def length(self) -> int:
        """Logical slots covered (conversation tokens fed so far, deferred slots included)."""
        return len(self.token_ids)

    @property
    def total_deferred(self) -> int:
        return self.plan.total_deferred if self.plan is not None else 0

    @property
    def pending(self) -> int:
        return self.plan.pending if self.plan is not None else 0

    @property
    def dropped(self) -> int:
        """Placeholder slots that stay empty forever (``policy="hard"``), over all plans."""
        return sum(p.total_deferred for p in self.plans if p.policy == "hard")

    @property
    def filled(self) -> torch.Tensor:
        """Bool ``[length]``: which covered slots hold an entry."""
        if self._filled is None:
            return torch.zeros(0, dtype=torch.bool)
        return self._filled[: self.length]

    # ------------------------------------------------------------------ transformers Cache interface
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.layers[0].capacity if self.static else -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._kv_len, 0

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a DeferredPrefillCache cannot be cropped")

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self._write_slots is None:
            raise RuntimeError(
                "this DeferredPrefillCache is written only by Raincheck's forwards; call `generate` with "
                "`raincheck_config=` (after `enable_raincheck(model)`) to use it"
            )
        device = key_states.device
        slots = self._slots_by_device.get(device)
        if slots is None:  # once per device per forward (layers on other GPUs of a device_map)
            slots = self._slots_by_device[device] = self._write_slots.to(device)
        return self.layers[layer_idx].write(key_states, value_states, slots, self._kv_len)

    def reset(self) -> None:
        raise NotImplementedError("start a new conversation with a new DeferredPrefillCache instead of reset()")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("a DeferredPrefillCache does not support beam search")

    def batch_repeat_interleave(self, repeats: int):
        if repeats != 1:
            raise NotImplementedError("a DeferredPrefillCache holds one sequence")

    def batch_select_indices(self, indices):
        raise NotImplementedError("a DeferredPrefillCache holds one sequence")

    # ------------------------------------------------------------------ internal helpers
    def bind_model(self, model) -> None:
        """Remembers the model this cache belongs to; refuses a different one."""
        if self._model_ref is None:
            self._model_ref = weakref.ref(model)
            return
        owner = self._model_ref()
        if owner is not model:
            raise ValueError(
                "past_key_values is a DeferredPrefillCache built by a different model; "
                "start a new conversation (no past_key_values) for this model"
            )

    def reserve(self, needed: int, device: torch.device) -> None:
        """Room for slots ``[0, needed)`` in the bookkeeping (KV buffers grow on their layer's device)."""
        for layer in self.layers:
            if layer.static and needed > layer.capacity:
                layer.reserve(needed)
        if self._filled is None:
            self._filled = torch.zeros(max(needed, 256), dtype=torch.bool, device=device)
        elif needed > self._filled.numel():
            grown = torch.zeros(max(needed, 2 * self._filled.numel()), dtype=torch.bool, device=device)
            grown[: self._filled.numel()] = self._filled
            self._filled = grown

    def gdn_state(self, layer_idx: int) -> GDNLayerState:
        """The state of Gated DeltaNet layer `layer_idx` (created on first use, on that layer's device)."""
        state = self.gdn_states.get(layer_idx)
        if state is None:
            state = self.gdn_states[layer_idx] = GDNLayerState()
        return state

    def release_gdn_checkpoints(self) -> None:
        """Drops the prefix checkpoints and P_tail maps once the plan they serve has nothing pending."""
        for state in self.gdn_states.values():
            state.release()

    def filled_prefix(self, kv_len: int) -> torch.Tensor:
        return self._filled[:kv_len]

    def mask_width(self, kv_len: int) -> int:
        """Key width the attention sees: ``kv_len`` (dynamic) or the whole static buffer."""
        return self.layers[0].capacity if self.static else kv_len
