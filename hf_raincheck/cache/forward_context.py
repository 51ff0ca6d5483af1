"""`ForwardContext`: what one Raincheck forward tells the cache and the patched layers it runs through.

transformers' decoder layers call ``update(keys, values, layer_idx)`` on the cache they are given and Gated DeltaNet
modules get the cache too (``past_key_values`` / ``cache_params`` in transformers 5.23, ``cache`` from 5.24); the
cache object is the only channel from the generation code to them. So each forward builds one `ForwardContext` and
installs it on the cache for the length of the forward (`DeferredPrefillCache.begin_forward` / `end_forward`);
`update` and the GDN patch read it from ``cache.forward_context``. Outside a forward there is none, and a write to the cache is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardContext:
    """One forward's write instructions.

    Attributes:
        write_slots: ``[q]`` long, the logical slot each row's key/value is written to. A compiled static step
            computes them inside its graph and sets them there (None until then).
        kv_len: slots the forward's keys span (``max(length, last row's slot + 1)``); a static cache's layers
            return their whole buffers whatever it is.
        compact_keys: None: the layers return the slot buffers (``[:kv_len]``, or whole when static) and the
            mask hides empty slots. Otherwise the forward attends causally over compacted keys: ``-old - 1``:
            the rows fill slots ``[old, kv_len)`` contiguously, the buffers' prefix ``[:kv_len]`` is the keys;
            ``old >= 0``: the keys are the first ``old`` slots followed by the rows' own keys (``0``: the rows'
            keys alone). See `hf_raincheck.generation.rows.run_rows`.
        gdn_step: how Gated DeltaNet layers split the rows (a `GDNStep` for eager forwards, a `GDNGraphStep`
            inside compiled static steps), or None for models without GDN layers.
        slots_by_device: `write_slots` copied to other devices (layers of a ``device_map`` split), one copy per
            device per forward.
    """

    write_slots: torch.Tensor | None
    kv_len: int
    compact_keys: int | None = None
    gdn_step: object = None
    slots_by_device: dict = field(default_factory=dict)

    def slots_on(self, device: torch.device) -> torch.Tensor:
        """`write_slots` on `device` (copied once per forward for a layer on another device)."""
        slots = self.write_slots
        if slots.device == device:
            return slots
        moved = self.slots_by_device.get(device)
        if moved is None:
            moved = self.slots_by_device[device] = slots.to(device)
        return moved


class RunningCall:
    """What a Raincheck cache holds while a call runs on it (a mixin of `DeferredPrefillCache` and
    `BatchedDeferredPrefillCache`): the running ``generate`` call's turn, and the running forward's
    `ForwardContext`."""

    _context: ForwardContext | None = None
    _turn = None
    _gdn_unjoined = False  # compiled fused steps left GDN joins pending (`DeferredPrefillCache.join_pending_gdn`)
    _gdn_pending_layers = 0  # GDN layers given a pending buffer (`pending_gdn_buffers`, batch 1 and batches)

    @property
    def forward_context(self) -> ForwardContext | None:
        """The `ForwardContext` of the Raincheck forward running on this cache, or None between forwards."""
        return self._context

    def begin_forward(self, context: ForwardContext) -> None:
        """Installs `context` for one forward; pair with `end_forward` in a ``finally``. Joins what earlier
        compiled fused steps left pending first, unless this forward is one of them (its `GDNGraphStep` is
        ``lazy``)."""
        if self._gdn_unjoined and not getattr(context.gdn_step, "lazy", False):
            self.join_pending_gdn()
        self._context = context

    def end_forward(self) -> None:
        """Clears the forward context (no write is accepted until the next `begin_forward`)."""
        self._context = None

    @property
    def active_turn(self):
        """The turn of the Raincheck `generate` call running on this cache (None between calls): the patched
        forward reads it to run that call's prefill and decode steps."""
        return self._turn

    def begin_turn(self, turn) -> None:
        """Marks `turn` as the running `generate` call's; pair with `end_turn` in a ``finally``."""
        self._turn = turn

    def end_turn(self) -> None:
        """Ends the running call's turn; the GDN joins its fused steps left pending are folded in here, so between
        calls every GDN state is whole."""
        self._turn = None
        if self._gdn_unjoined:
            self.join_pending_gdn()
