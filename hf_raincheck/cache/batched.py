"""`BatchedDeferredPrefillCache`: the row caches of a batched Raincheck `generate`, and their shared KV buffers."""

from __future__ import annotations

import threading
import weakref

import torch
from transformers.cache_utils import DynamicCache

from ..gdn_state.ops import join_pending_
from ..gdn_state.state import last_change
from .buffer_pool import POOL
from .deferred_cache import DeferredPrefillCache
from .forward_context import RunningCall
from .slot_layer import _GROWTH


class BatchedDeferredPrefillCache(RunningCall, DynamicCache):
    """What a batched ``generate(raincheck_config=...)`` takes and returns as its cache: one batch-1
    `DeferredPrefillCache` per row, padding removed (see `DeferredPrefillCache`'s "Batches" section).

    Each row has its own plan, boundary, pending set and accounting, exactly as if it had been generated alone.
    Build one to continue rows together: ``BatchedDeferredPrefillCache([cache_a, None, cache_c])`` (None: a new
    conversation in that row) with a left-padded batch whose row i extends ``rows[i].token_ids``.

    Shared steps: while a batched `generate` runs one forward for all rows, the rows' key/value entries live in
    one buffer per layer, ``[B, H, capacity, D]``, and each row cache's layers are views of its row of it (a row's
    slot i holds its logical index i, as in a batch-1 cache); the rows' filled-slot masks are the rows of one
    ``[B, capacity]`` mask (``filled``). The views stay valid afterwards: rows continued together in a new
    `BatchedDeferredPrefillCache` are copied into its buffers, and a row continued alone (``split()``) gets
    buffers of its own first (`DeferredPrefillCache.detach_shared`); ``row.trim()`` does that at once, at the size
    the row needs (its length rounded up to 256: what a row kept between calls should hold, as the server's
    conversation pool keeps it). The shared buffers are freed once no row uses them. A dynamic batch allocates the
    width its call needs (rounded up to 256), not its rows' earlier capacities.

    Attributes / views:
        batch_size: the number of rows.
        rows: the row caches (``rows[i]`` is row i's `DeferredPrefillCache`, None for a row not started yet).
        row_pending: ``list[int]``, deferred tokens still pending per row.
        row_total_deferred: ``list[int]``, deferred tokens of each row's current plan.
        row_plans: ``list[list[DeferralPlan]]``, every plan of each row.
        row_turn_stats: ``list[list[TurnRestore]]``, each row's per-call accounting.
        pending: the sum of ``row_pending``.
        split(): the row caches as a list; each continues exactly like a batch-1 conversation
            (``model.generate(**next_inputs_of_row_i, past_key_values=caches[i], raincheck_config=cfg)``).
        wait(timeout=None) / cancel(): every row's background completion worker (``completion="background"``).

    Static batches (``cache_implementation="static"``): `reserve_static` reserves the shared buffers once per call
    as static addresses; they come from and go back to the static buffer pool (`zeros`), like a batch-1 static
    cache's, once the batch is freed and no row cache views them.

    For the generation code: `share_buffers` (the shared buffers and the rows' views; ``filled``, bool
    ``[B, capacity]``, whose row i is row i's filled-slot mask),
    `begin_forward` / `end_forward` (a `ForwardContext` whose ``write_slots`` are ``[B, q]``), `update` (the
    decoder layers' writes), `active_turn` (`begin_turn` / `end_turn`).
    """

    def __init__(self, rows: list[DeferredPrefillCache | None]):
        if not isinstance(rows, (list, tuple)) or not rows or not all(
            r is None or isinstance(r, DeferredPrefillCache) for r in rows
        ):
            raise ValueError(
                "BatchedDeferredPrefillCache: rows must be a non-empty list of DeferredPrefillCache or None (None: "
                "a new conversation in that row)"
            )
        if len({id(r) for r in rows if r is not None}) != sum(r is not None for r in rows):
            raise ValueError("BatchedDeferredPrefillCache: the same DeferredPrefillCache appears in two rows")
        super().__init__()
        self.rows = list(rows)
        self.layers = []
        self.keys: list[torch.Tensor | None] = []  # per layer [B, H, capacity, D] while rows share buffers
        self.values: list[torch.Tensor | None] = []
        self.filled: torch.Tensor | None = None  # bool [B, capacity]: row i's filled-slot mask is row i of it
        self.capacity = 0
        # static (``cache_implementation="static"``): the shared buffers are reserved once per call
        # (`reserve_static`) and are static addresses that compiled steps read and write in place
        self.static = False
        # compiled static steps: every row's deferred store, padded (`hf_raincheck.generation.shared_static`)
        self.store_buffers: dict | None = None
        self.pooled: dict[str, torch.Tensor] = {}  # static: the buffers by role name (`zeros`)
        # compiled static steps of Gated DeltaNet layers: every row's GDN states as rows of batch buffers, by layer
        # index (`sync_gdn_states`)
        self.gdn_buffers: dict[int, dict] = {}
        self._gdn_synced = None  # `_gdn_sync_key` at the end of the last `sync_gdn_states`

    # ------------------------------------------------------------------ per-row views
    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def row_pending(self) -> list[int]:
        return [0 if r is None else r.pending for r in self.rows]

    @property
    def row_total_deferred(self) -> list[int]:
        return [0 if r is None else r.total_deferred for r in self.rows]

    @property
    def row_plans(self) -> list[list]:
        return [[] if r is None else list(r.plans) for r in self.rows]

    @property
    def row_turn_stats(self) -> list[list]:
        return [[] if r is None else list(r.turn_stats) for r in self.rows]

    @property
    def pending(self) -> int:
        return sum(self.row_pending)

    def split(self) -> list[DeferredPrefillCache]:
        """The B row caches (batch-1, no padding); each continues like a batch-1 conversation's cache."""
        return list(self.rows)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for every row's background worker; True when nothing is pending in any row."""
        return all([r.wait(timeout) for r in self.rows if r is not None])

    def cancel(self) -> None:
        for r in self.rows:
            if r is not None:
                r.cancel()

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"BatchedDeferredPrefillCache(batch_size={self.batch_size}, row_pending={self.row_pending})"

    # ------------------------------------------------------------------ shared buffers
    def _views_current(self) -> bool:
        """Whether every row's buffers are this cache's shared ones (a row leaves them only by being pointed at
        another batch's buffers, or by `DeferredPrefillCache.trim` / `detach_shared`): O(B), so every step may ask."""
        return self.filled is not None and all(row.shared_by is not None and row.shared_by() is self
                                                for row in self.rows)

    def share_buffers(self, needed: int) -> None:
        """Puts every row's KV entries into shared buffers of at least `needed` slots and points each row cache's
        layers at its row (a no-op when they already are, with room).

        A layer that no row has written yet (a new conversation; a Gated DeltaNet layer, which keeps no KV) gets
        its shared buffer at its first write. Every row must hold KV of the same shapes, dtype and device."""
        if self._views_current() and needed <= self.capacity:
            return
        layers = len(self.rows[0].layers)
        if any(len(r.layers) != layers for r in self.rows):
            raise ValueError("BatchedDeferredPrefillCache: the row caches have different layer counts")
        # the width the call needs, in multiples of 256 (a batch that is running grows from its capacity); a static
        # batch also keeps its rows' capacity (their compiled steps' shapes), a dynamic one does not inherit it
        capacity = max(needed, self.capacity if self._views_current() else 0)
        if self.static:
            capacity = max([capacity] + [layer.keys.shape[2] for r in self.rows for layer in r.layers
                                         if layer.is_initialized])
        capacity = -(-max(capacity, _GROWTH) // _GROWTH) * _GROWTH
        keys, values = [None] * layers, [None] * layers
        for idx in range(layers):
            ref = next((r.layers[idx] for r in self.rows if r.layers[idx].is_initialized), None)
            if ref is None:
                continue
            k = self.zeros(f"layer{idx}.keys", (self.batch_size, ref.keys.shape[1], capacity, ref.keys.shape[3]),
                           ref.keys.dtype, ref.keys.device)
            v = self.zeros(f"layer{idx}.values",
                           (self.batch_size, ref.values.shape[1], capacity, ref.values.shape[3]),
                           ref.values.dtype, ref.values.device)
            for i, row in enumerate(self.rows):
                layer = row.layers[idx]
                if layer.is_initialized:
                    n = min(layer.keys.shape[2], capacity)
                    k[i, :, :n] = layer.keys[0, :, :n]
                    v[i, :, :n] = layer.values[0, :, :n]
            keys[idx], values[idx] = k, v
        device = next((k.device for k in keys if k is not None), None)
        if device is None:
            device = next((r.device for r in self.rows if r.device is not None), None)
        filled = None
        if device is not None:
            filled = self.zeros("filled", (self.batch_size, capacity), torch.bool, device)
            for i, row in enumerate(self.rows):
                row.adopt_filled(filled[i])
        self.keys, self.values, self.capacity, self.filled = keys, values, capacity, filled
        for idx in range(layers):
            if keys[idx] is not None:
                self._point_layer(idx)
        if filled is not None:
            owner = weakref.ref(self)  # (weak: a row must not keep the other rows' caches alive)
            for row in self.rows:
                row.shared_by = owner
        if self.static:  # (an eager forward that needed more room: the new buffers are static addresses too)
            self._mark_static()

    def reserve_static(self, needed: int, device: torch.device) -> None:
        """A static batch (``cache_implementation="static"``): shared buffers of at least `needed` slots, reserved
        before the call's prefill so that nothing in the call reallocates them, and marked as static addresses
        (compiled steps write them in place, CUDA graphs keep their addresses). The capacity grows only when a
        later call needs more, geometrically in multiples of 256 like a batch-1 static cache, so a conversation's
        later turns mostly keep the shapes its compiled steps were built for. Every row must have started
        (no None)."""
        if not self.static:
            self.static = True
            _recycle()  # (freed static batches whose rows have let go of their buffers: into the pool first)
            rows = [weakref.ref(r) for r in self.rows]
            weakref.finalize(self, _retire, self.pooled, rows).atexit = False
            for row in self.rows:  # (a row freed after the batch may be the last one viewing its buffers)
                weakref.finalize(row, _recycle).atexit = False
        for row in self.rows:
            row.reserve(min(needed, 256), device)  # (the rows' bookkeeping on `device`; the shared mask replaces it)
        if not (self._views_current() and needed <= self.capacity):
            current = self.capacity if self._views_current() else 0
            target = needed if needed <= current else max(needed, current + current // 2)
            self.share_buffers(target)
        self._mark_static()

    def zeros(self, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """A zero buffer of role `name` (``"layer3.keys"``, ``"filled"``, ``"store.embeds"``...). A static batch's
        buffers come from, and go back to, the static buffer pool (`hf_raincheck.cache.buffer_pool`, under
        ``"batch."`` names), so a new batch of the same size and capacity takes a freed one's addresses and its
        compiled steps' CUDA graphs replay instead of recording again; they are unguarded static addresses. They go
        back once this cache is freed and no row cache still views them (a row kept after the batch, continued
        alone or in another batch, moves to buffers of its own first: `DeferredPrefillCache.detach_shared`)."""
        if not self.static:
            return torch.zeros(shape, dtype=dtype, device=device)
        tensor = POOL.take(f"batch.{name}", shape, dtype, device)
        if tensor is None:
            tensor = torch.zeros(shape, dtype=dtype, device=device)
        torch._dynamo.mark_static_address(tensor, guard=False)
        self.pooled[name] = tensor
        return tensor

    def sync_gdn_states(self) -> dict[int, dict]:
        """Compiled static batch steps of a model with Gated DeltaNet layers (Qwen3.5): every row's GDN layer states
        as rows of one buffer per layer and field, which the steps update in place
        (`gdn_state.graph_layer.gdn_batch_forward_graph`): ``state`` ``[B, H_v, K, V + K]`` fp32 (the fixed layout,
        ``[S | P_tail]``), ``conv`` ``[B, C, kernel]``, ``prefix`` ``[B, H_v, K, V]`` fp32 and ``prefix_conv``
        ``[B, C, kernel]`` (the pending plan's checkpoint). Each row's `GDNLayerState` then points at its rows
        (views, as its KV layers view the shared KV buffers). Eager forwards (a prefill, an eager step, a
        completion chunk) build new tensors and never write in place, so a row whose state is no longer its view is
        copied in again here; after a compiled step this is a no-op, found without visiting the rows when no GDN
        state anywhere rebound a tensor since the last call (`gdn_state.last_change`: the B x layers identity checks
        are host time before every step; the changelog has the numbers). The buffers are static addresses
        from the static buffer pool (`zeros`): the steps' graphs read the same tensors at every step, turn and
        plan. Returns `gdn_buffers` (by layer index)."""
        rows = self.rows
        if self._gdn_synced is not None and self._gdn_synced == _gdn_sync_key(rows):
            return self.gdn_buffers
        self.join_pending_gdn()  # (the buffers may be rebuilt below: what is pending goes into the rows first)
        self._gdn_pending_layers = 0  # (a rebuilt layer's buffers have no pending one yet: `pending_gdn_buffers`)
        layers = sorted(rows[0].gdn_states)
        if any(sorted(r.gdn_states) != layers for r in rows):
            raise RuntimeError("compiled static batch steps: the rows hold different Gated DeltaNet layers")
        for idx in layers:
            ref = rows[0].gdn_states[idx]
            if ref.state is None or not ref.fixed or ref.carry == 0:
                raise RuntimeError("compiled static batch steps need every row's GDN states in the fixed layout")
            value_dim = ref.value_dim
            key = (tuple(ref.state.shape), value_dim, tuple(ref.conv.shape), ref.conv.dtype, ref.state.device)
            buffers = self.gdn_buffers.get(idx)
            if buffers is None or buffers["key"] != key:
                _, heads, key_dim, columns = ref.state.shape
                batch, device = len(rows), ref.state.device
                conv_shape = (batch,) + tuple(ref.conv.shape[1:])
                buffers = dict(
                    key=key,
                    state=self.zeros(f"gdn{idx}.state", (batch, heads, key_dim, columns), torch.float32, device),
                    conv=self.zeros(f"gdn{idx}.conv", conv_shape, ref.conv.dtype, device),
                    prefix=self.zeros(f"gdn{idx}.prefix", (batch, heads, key_dim, value_dim), torch.float32, device),
                    prefix_conv=self.zeros(f"gdn{idx}.prefix_conv", conv_shape, ref.conv.dtype, device),
                )
                names = ("state", "conv", "prefix", "prefix_conv")
                buffers["views"] = [{name: buffers[name][b : b + 1] for name in names} for b in range(batch)]
                self.gdn_buffers[idx] = buffers
            for row, views in zip(rows, buffers["views"]):
                layer = row.gdn_states[idx]
                if layer.state is not views["state"]:
                    if layer.state.shape != views["state"].shape or layer.value_dim != value_dim:
                        raise RuntimeError("compiled static batch steps: the rows' GDN states differ in shape")
                    layer.state = views["state"].copy_(layer.state)
                if layer.conv is not views["conv"]:
                    layer.conv = views["conv"].copy_(layer.conv)
                prefix = layer.prefix
                if prefix is not None and prefix.recurrent is not views["prefix"]:
                    prefix.recurrent = views["prefix"].copy_(prefix.recurrent)
                if prefix is not None and prefix.conv is not views["prefix_conv"]:
                    prefix.conv = views["prefix_conv"].copy_(prefix.conv)
        self._gdn_synced = _gdn_sync_key(rows)
        return self.gdn_buffers

    def pending_gdn_buffers(self) -> None:
        """Gives every GDN layer's batch buffers (`sync_gdn_states`, which must have run) a ``pending`` buffer ``[B,
        H_v, K, V]`` fp32 (zeros, pooled, a static address): compiled fused steps add every row's window change
        to it instead of joining it (`gdn_state.graph_layer.gdn_batch_forward_graph` with ``lazy``), and the live
        states are unjoined until `join_pending_gdn`. Called by every compiled fused batch step: the layers are walked
        only after `sync_gdn_states` rebuilt buffers."""
        if self._gdn_pending_layers != len(self.gdn_buffers):
            for idx, buffers in self.gdn_buffers.items():
                if "pending" not in buffers:
                    prefix = buffers["prefix"]
                    buffers["pending"] = self.zeros(f"gdn{idx}.pending", tuple(prefix.shape), torch.float32,
                                                    prefix.device)
            self._gdn_pending_layers = len(self.gdn_buffers)
        self._gdn_unjoined = True

    def join_pending_gdn(self) -> None:
        """Folds what compiled fused steps left pending into every row's live GDN states (``S += P_tail pending``,
        ``pending = 0``, over the batch buffers at once; `ops.join_pending_`): run before any forward that is not a
        compiled fused step (`begin_forward`), when the call ends (`end_turn`) and before the buffers are synced
        again, so that no row's state is read unjoined. A no-op when nothing is pending."""
        if not self._gdn_unjoined:
            return
        for buffers in self.gdn_buffers.values():
            if "pending" in buffers:
                join_pending_(buffers["state"], buffers["pending"])
        self._gdn_unjoined = False

    def _mark_static(self) -> None:
        for tensor in self.keys + self.values + [self.filled]:
            if tensor is not None:
                torch._dynamo.mark_static_address(tensor, guard=False)

    def _point_layer(self, idx: int) -> None:
        keys, values = self.keys[idx], self.values[idx]
        for i, row in enumerate(self.rows):
            layer = row.layers[idx]
            layer.dtype, layer.device = keys.dtype, keys.device
            layer.keys, layer.values = keys[i : i + 1], values[i : i + 1]  # (one line: they always match)
            layer.capacity = self.capacity
            layer.is_initialized = True

    # ------------------------------------------------------------------ transformers Cache interface
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The longest row's cached length (transformers cuts the prompt with it; the shared forwards read each
        row's own tokens)."""
        return max((r.length for r in self.rows if r is not None), default=0)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        context = self._context
        return (context.kv_len if context is not None else self.get_seq_length() + query_length), 0

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a BatchedDeferredPrefillCache cannot be cropped")

    def reset(self) -> None:
        raise NotImplementedError("start new conversations with new caches instead of reset()")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("a BatchedDeferredPrefillCache does not support beam search")

    def batch_repeat_interleave(self, repeats: int):
        if repeats != 1:
            raise NotImplementedError("expand a batch before a Raincheck generate, not its cache")

    def batch_select_indices(self, indices):
        raise NotImplementedError("a BatchedDeferredPrefillCache keeps every row (use split())")

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Writes row b's ``key_states[b, :, r]`` to its slot ``write_slots[b, r]`` and returns the shared keys and
        values of the forward's first ``kv_len`` slots."""
        context = self._context
        if context is None or context.write_slots is None:
            raise RuntimeError(
                "this BatchedDeferredPrefillCache is written only by Raincheck's batched forwards; pass it to "
                "generate(raincheck_config=...) with a batch"
            )
        if self.keys[layer_idx] is None:  # the layer's first write in any row: its shared buffers now
            b, h, _, dk = key_states.shape
            self.keys[layer_idx] = self.zeros(f"layer{layer_idx}.keys", (b, h, self.capacity, dk), key_states.dtype,
                                              key_states.device)
            self.values[layer_idx] = self.zeros(f"layer{layer_idx}.values",
                                                (b, h, self.capacity, value_states.shape[-1]), value_states.dtype,
                                                value_states.device)
            self._point_layer(layer_idx)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        slots = context.slots_on(key_states.device)  # [B, q]
        write_rows_(keys, slots, key_states.to(keys.dtype))
        write_rows_(values, slots, value_states.to(values.dtype))
        return keys[:, :, : context.kv_len], values[:, :, : context.kv_len]


def write_rows_(buffer: torch.Tensor, slots: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """``buffer[b, :, slots[b, r]] = states[b, :, r]`` in place (``buffer [B, H, W, D]``, ``slots [B, q]``,
    ``states [B, H, q, D]``): only the written entries are touched.

    Compiled, as `index_put_`: Inductor lowers that to one kernel storing the written entries into the buffer,
    whereas ``scatter_`` on a graph input became a copy of the whole buffer, the scatter into the copy and a copy
    back: two passes over every attention layer's keys and values in every step, whatever the step writes
    (CHANGELOG, 2026-12-03). Eager, as ``scatter_``: one operator, no index tensors to build."""
    if not torch.compiler.is_compiling():
        return buffer.scatter_(2, slots[:, None, :, None].expand(-1, buffer.shape[1], -1, buffer.shape[3]), states)
    rows = torch.arange(buffer.shape[0], device=buffer.device)[:, None, None]
    heads = torch.arange(buffer.shape[1], device=buffer.device)[None, :, None]
    return buffer.index_put_((rows, heads, slots[:, None, :]), states)


# freed static batches whose buffers some row cache still views: (buffers by name, weak references to the rows)
_RETIRED: list[tuple[dict, list]] = []
_RETIRED_LOCK = threading.RLock()  # (re-entrant: a collection inside the lock may run a batch's `_retire`)


def _viewed(row: DeferredPrefillCache | None, storages: set[int]) -> bool:
    """Whether `row` (alive) still has a KV layer, its filled mask or a GDN state in one of `storages` (data
    pointers), or would get one back if its open transaction rolled back."""
    if row is None:
        return False
    tensors = [t for layer in row.layers if layer.is_initialized for t in (layer.keys, layer.values)]
    tensors.append(row._filled)
    for state in row.gdn_states.values():  # (views of a static batch's GDN buffers: `sync_gdn_states`)
        tensors += [state.state, state.conv]
        if state.prefix is not None:
            tensors += [state.prefix.recurrent, state.prefix.conv]
    transaction = row._transaction  # (an open transaction's rollback would point the row at its saved GDN states)
    if transaction is not None and transaction.saved is not None:
        for state, _, conv, _, fields in transaction.saved[-1].values():
            tensors += [state, conv, *(fields or ())]
    return any(t is not None and t.untyped_storage().data_ptr() in storages for t in tensors)


def _retire(buffers: dict, rows: list) -> None:
    """A static batch was freed: its buffers go to the pool once no row views them (now, or at a later `_recycle`)."""
    with _RETIRED_LOCK: _RETIRED.append((buffers, rows))  # noqa: E701  (one line: see `buffer_pool.give`)
    _recycle()


def _recycle() -> None:
    """Hands the pool every retired batch's buffers that no live row cache views any more."""
    with _RETIRED_LOCK: entries = _RETIRED[:]  # noqa: E701
    free = []
    for entry in entries:
        buffers, rows = entry
        storages = {t.untyped_storage().data_ptr() for t in buffers.values()}
        if not any(_viewed(ref(), storages) for ref in rows):
            free.append(entry)
    with _RETIRED_LOCK:
        for entry in free:  # (by identity: entries appended meanwhile stay)
            index = next((i for i, e in enumerate(_RETIRED) if e is entry), None)
            if index is not None:
                del _RETIRED[index]
    for buffers, _ in free:
        POOL.give({f"batch.{name}": tensor for name, tensor in buffers.items()})


def _gdn_sync_key(rows) -> tuple:
    """What `BatchedDeferredPrefillCache.sync_gdn_states` found in sync: the last GDN state rebinding anywhere, and
    which row caches with how many GDN layers."""
    return last_change(), [(id(r), len(r.gdn_states)) for r in rows]
