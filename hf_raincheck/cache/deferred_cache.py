"""`DeferredPrefillCache`: a transformers cache that also owns Raincheck's deferred store and bookkeeping."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import DynamicCache

from .. import transformers_coupling as hf
from ..gdn_state.ops import join_pending_
from ..gdn_state.state import GDNLayerState
from .buffer_pool import POOL, CacheBuffers, copy_pairs
from .forward_context import ForwardContext, RunningCall
from .plan import DeferralPlan
from .slot_layer import _GROWTH, SlotLayer
from .transaction import CacheTransaction

if TYPE_CHECKING:  # pragma: no cover
    from ..config import RaincheckConfig


@dataclass
class RestoreStats:
    """Deferred tokens restored, by when (counted over the cache's life)."""

    during_prefill: int = 0  # folded into a later turn's prefill
    during_decode: int = 0  # carried by fused decode steps
    after_answer: int = 0  # blocking / background completion, `complete_deferred`


@dataclass
class TurnRestore:
    """Deferred-token accounting of one `generate` call on the cache (one entry of ``cache.turn_stats``).

    For the plan of turn t (raincheck policy): ``deferred == restored_during_decode + pending_at_answer_end``
    and ``pending_at_answer_end == restored_after_answer + (turn t+1).restored_in_prefill + still pending``.
    """

    deferred: int = 0  # deferred tokens of this call's new plan (0: no new image / video)
    restored_in_prefill: int = 0  # an earlier plan's pending tokens folded into this call's prefill
    restored_during_decode: int = 0  # carried by this call's fused decode steps
    pending_at_answer_end: int = 0  # pending when the answer ended (before blocking / background completion)
    restored_after_answer: int = 0  # restored after the answer and before the next call (any completion)


#: `record_restored`'s ``when`` -> the `TurnRestore` field it counts in (built once: it runs every decode step)
_TURN_FIELD = {"during_prefill": "restored_in_prefill", "during_decode": "restored_during_decode",
               "after_answer": "restored_after_answer"}


def _values(record) -> tuple:
    """A counters dataclass's field values, in field order (flat ints: no deep copy)."""
    return tuple(getattr(record, f.name) for f in dataclasses.fields(record))


class DeferredPrefillCache(RunningCall, DynamicCache):
    """A `DynamicCache` in the logical-slot layout that remembers what Raincheck deferred.

    Every token's key/value sits in the slot of its logical index (its index in the conversation's
    ``input_ids``); deferred slots stay empty and masked until restored, so a fully restored cache holds
    exactly the entries of a plain prefill and the next turn is a plain append.

    Thread safety: use a cache from one thread at a time (the "user thread"). ``lock`` (a re-entrant lock) is
    held by every Raincheck operation that writes the cache: `generate`, `complete_deferred`, and each chunk of
    a background completion worker (``completion="background"``), which releases it between chunks. While a
    worker runs, the user thread may read the counters (``pending``, ``stats``...) at any time; to read the KV
    tensors hold ``cache.lock`` (or call ``wait()`` / ``cancel()`` first). A new `generate` or
    `complete_deferred` on the cache stops the worker first (waiting for at most one chunk) and takes over
    what is pending. On CUDA the worker runs on its own stream; it starts after the work queued on the user's
    stream, finishes each chunk before releasing the lock, and whoever stops it makes its current stream wait
    for the worker's.

    Background completion:
        ``completion_running``: whether a worker is prefilling the pending tokens now.
        ``wait(timeout=None)``: blocks until the worker is done; True when nothing is pending.
        ``cancel()``: stops the worker; ``pending`` stays exact (the next call folds it in).
        A worker's exception is raised (chained) by the next ``generate`` / `complete_deferred` / ``wait``; the
        cache stays consistent (the failed chunk is simply still pending). The worker holds the model and the
        cache through weak references: if either is freed, or the interpreter exits, it stops cleanly.

    Attributes:
        config: the `RaincheckConfig` of the last `generate` call on this cache.
        plan: the current `DeferralPlan` (the most recent `generate` call with new images or video).
        total_deferred / pending: deferred tokens of the current plan, and those not yet prefilled.
        token_ids: the conversation's token ids for every slot the cache covers.
        stats: `RestoreStats` over the cache's life.
        turn_stats: one `TurnRestore` per `generate` call on the cache.

    Batches: a cache holds one conversation (batch size 1). A batched ``generate(raincheck_config=...)`` (B > 1
    rows, left-padded) takes and returns a `BatchedDeferredPrefillCache` (``hf_raincheck.cache.batched``) holding
    one such cache per row, padding removed; while rows run together their layers are views of shared ``[B, ...]``
    buffers. Its per-row views: ``batch_size``, ``rows``, ``row_pending`` (``list[int]``), ``row_total_deferred``,
    ``row_plans`` (each row's plans), ``row_turn_stats`` (each row's `TurnRestore` list), ``pending`` (the sum),
    ``wait()`` / ``cancel()`` (every row's worker) and ``split()``: the B row caches, each continuing exactly like a
    batch-1 conversation (alone, or with others in a new `BatchedDeferredPrefillCache`). ``trim()`` moves a row
    kept after its batch to buffers of its own, sized to its length (the batch's buffers are freed once no row
    uses them); on any dynamic cache it shrinks buffers grown for an earlier call. On a batch-1 cache
    (``batch_size`` stays transformers' own), ``row_pending`` is ``[pending]``, ``row_plans`` ``[plans]``,
    ``row_turn_stats`` ``[turn_stats]`` and ``split()`` returns ``[self]``.

    Interrupts and errors: a forward and everything recorded about it (the slots it filled, the plan's progress,
    the conversation's tokens, plan and grids, the counters) form one `transaction`, committed whole or not at
    all; an interrupted `generate` leaves the cache as after its last whole step, and ``token_ids`` holds what
    was fed. The one change no rollback undoes (a compiled static step updating Gated DeltaNet states in place)
    leaves the cache refusing further calls (`check_usable`) with a clear error.

    For the generation code (``hf_raincheck.generation``): `forward_context` (`begin_forward` / `end_forward`),
    `active_turn` (`begin_turn` / `end_turn`), `transaction` / `after_commit` / `in_place_update`,
    `commit_prefill`, `record_restored`, `append_fed_token`, `mark_filled` / `marks_filled`, `filled_prefix`,
    `slot_index` / `slot_tensor`, `scratch_slots` / `place_scratch_slots`, `store_buffers`, `pooled_zeros` /
    `pooled_buffers`, `completion_worker` / `attach_completion`.
    """

    def __init__(self, num_layers: int, static: bool = False, max_cache_len: int = 0):
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(
                f"DeferredPrefillCache: num_layers must be an int >= 1 (the model's decoder layers), got {num_layers!r}"
            )
        super().__init__()
        # a static cache's buffers come from, and go back to, the pool of finished conversations' buffers, so the
        # CUDA graphs recorded for their addresses replay for the next conversation (`buffer_pool`)
        self._buffers = CacheBuffers(POOL) if static else None
        if static:
            weakref.finalize(self, POOL.give, self._buffers.buffers).atexit = False  # (nothing to hand on at exit)
        self.layers = [SlotLayer(static=static, capacity=max_cache_len, buffers=self._buffers, index=i)
                       for i in range(num_layers)]
        self.layer_class_to_replicate = None
        self.static = static
        self.lock = threading.RLock()
        self.config: RaincheckConfig | None = None
        self.plan: DeferralPlan | None = None
        self.plans: list[DeferralPlan] = []
        # (host ids, decode tokens fed since: still on the device, no host sync), replaced as a whole, never edited
        # in place: one assignment publishes a change, and a transaction's saved reference stays valid
        self._tokens: tuple[list[int], tuple[torch.Tensor, ...]] = ([], ())
        self.positions: torch.Tensor | None = None  # [3, length] logical positions of the covered slots
        self.rope_delta: int = 0
        self.media_grids: dict[str, torch.Tensor] = {}  # grids of the cached conversation's media, by modality
        self.stats = RestoreStats()
        self.turn_stats: list[TurnRestore] = []
        self._completion = None  # the background worker (hf_raincheck.generation.background), if any
        self._filled: torch.Tensor | None = None  # bool [capacity] on the model device
        self._slot_index: torch.Tensor | None = None  # arange(capacity) on the model device
        self._scratch_slots: torch.Tensor | None = None  # static compiled steps: where padding rows write
        self._scratch_end = 0  # the capacity `_scratch_slots` was placed for
        # compiled static steps: the deferred store's persistent buffers (`hf_raincheck.generation.decode`)
        self.store_buffers: dict | None = None
        self._model_ref = None
        self._context: ForwardContext | None = None  # the running forward's (`begin_forward`)
        self._turn = None  # the running `generate` call's `Turn` (`begin_turn`)
        self.gdn_states: dict[int, GDNLayerState] = {}  # Gated DeltaNet layers' states, by layer index
        self.gdn_fixed_layout = False  # compiled static steps: GDN states keep one shape (see GDNLayerState)
        self._transaction: CacheTransaction | None = None  # the open `transaction`, if any
        self._unusable: str | None = None  # why this cache cannot continue (see `check_usable`)
        # a weak reference to the `BatchedDeferredPrefillCache` whose shared buffers this cache's layers and filled
        # mask are rows of (None: buffers of its own)
        self.shared_by = None

    # ------------------------------------------------------------------ public bookkeeping
    @property
    def length(self) -> int:
        """Logical slots covered (conversation tokens fed so far, deferred slots included)."""
        ids, tail = self._tokens
        return len(ids) + len(tail)

    @property
    def token_ids(self) -> list[int]:
        """The conversation's token ids for every slot the cache covers (a host list; don't edit it in place)."""
        ids, tail = self._tokens
        if tail:  # one device-to-host copy for every decode token fed since the last read
            ids = ids + torch.cat(tail).reshape(-1).tolist()
            self._tokens = (ids, ())  # one assignment: an interrupt leaves the old pair or the new one
        return ids

    @token_ids.setter
    def token_ids(self, ids: list[int]) -> None:
        self._tokens = (list(ids), ())

    def append_fed_token(self, token: torch.Tensor) -> None:
        """Records a decode step's input token ``[1, 1]`` (kept on its device until `token_ids` is read)."""
        ids, tail = self._tokens
        self._tokens = (ids, tail + (token.reshape(1),))

    # ------------------------------------------------------------------ per-row views (batch size 1; see "Batches")
    @property
    def row_pending(self) -> list[int]:
        return [self.pending]

    @property
    def row_total_deferred(self) -> list[int]:
        return [self.total_deferred]

    @property
    def row_plans(self) -> list[list[DeferralPlan]]:
        return [list(self.plans)]

    @property
    def row_turn_stats(self) -> list[list[TurnRestore]]:
        return [list(self.turn_stats)]

    def split(self) -> list["DeferredPrefillCache"]:
        """``[self]``: a batch-1 cache is its own only row."""
        return [self]

    @property
    def total_deferred(self) -> int:
        return self.plan.total_deferred if self.plan is not None else 0

    @property
    def pending(self) -> int:
        return self.plan.pending if self.plan is not None else 0

    @property
    def holes(self) -> int:
        """Slots below `length` that hold no entry: deferred tokens still pending, and dropped ones (host-side)."""
        return sum(p.total_deferred - (p.restored if p.policy == "raincheck" else 0) for p in self.plans)

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

    def record_restored(self, when: str, count: int) -> None:
        """Counts `count` deferred tokens restored ``"during_prefill"``, ``"during_decode"`` or ``"after_answer"``
        (call it inside the `transaction` that restored them). During the answer (``"during_prefill"``,
        ``"during_decode"``, also with `count` 0) the call's record's ``pending_at_answer_end`` follows
        ``pending``, so it holds the pending count when the answer ends, however it ends."""
        field_name = _TURN_FIELD[when]
        if count:
            setattr(self.stats, when, getattr(self.stats, when) + count)
        if self.turn_stats:
            record = self.turn_stats[-1]
            if count:
                setattr(record, field_name, getattr(record, field_name) + count)
            if when != "after_answer":
                record.pending_at_answer_end = self.pending

    def commit_prefill(self, prompt_ids: list[int], plan: DeferralPlan | None, rope_delta: int,
                       media_grids: dict, record: TurnRestore, restored: int) -> None:
        """Records a turn's prefill (call it inside the `transaction` of the prefill's forward): the
        conversation's tokens become `prompt_ids`, `plan` (if any) becomes the current plan, the media grids and
        rope delta those of the whole conversation, `record` the call's `turn_stats` entry, and `restored`
        deferred tokens of the earlier plan, folded into the prefill, are counted."""
        if plan is not None:
            self.plans = self.plans + [plan]
            self.plan = plan
        self.turn_stats = self.turn_stats + [record]
        self.record_restored("during_prefill", restored)
        self.rope_delta = rope_delta
        self.media_grids = dict(media_grids)
        self._tokens = (list(prompt_ids), ())

    # ------------------------------------------------------------------ background completion
    @property
    def completion_worker(self):
        """The background completion worker started on this cache (`BackgroundCompletion`), until it is stopped
        or its outcome is collected; None otherwise."""
        return self._completion

    def attach_completion(self, worker) -> None:
        """Records `worker` as this cache's background completion (the caller holds ``lock`` and stopped any
        earlier worker)."""
        self._completion = worker

    @property
    def completion_running(self) -> bool:
        """Whether a background worker is prefilling this cache's pending deferred tokens now."""
        return self._completion is not None and self._completion.running

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the background worker (if any) is done, at most `timeout` seconds.

        Returns True when no deferred token is pending, False otherwise (timeout, cancelled worker, or
        ``completion="next_turn"``). Raises the worker's error (chained) if it failed.
        """
        worker = self._completion
        if worker is not None:
            if not worker.join(timeout):
                return False
            self.raise_completion_error()
        return self.pending == 0

    def cancel(self) -> None:
        """Stops the background worker (after its current chunk); ``pending`` stays exact, nothing is lost.

        What is left is folded into the next `generate` call on this cache (or run `complete_deferred`). A
        worker error is kept for the next call. No-op without a running worker.
        """
        self.stop_completion()

    def stop_completion(self) -> None:
        """Stops the background worker and waits for it (at most one chunk); the caller's stream takes over."""
        worker = self._completion
        if worker is None:
            return
        worker.stop()
        worker.join(None)
        if worker.error is None:
            self._completion = None

    def raise_completion_error(self) -> None:
        """Raises the error of a finished background worker (once); the cache stays usable."""
        worker = self._completion
        if worker is None or worker.running:
            return
        self._completion = None
        if worker.error is not None:
            error = worker.error
            raise RuntimeError(
                f"background completion of this cache's deferred tokens failed ({type(error).__name__}: {error}); "
                f"the cache is consistent: the {self.pending} tokens still pending are folded into the next "
                "generate call on it (or run complete_deferred)"
            ) from error

    # ------------------------------------------------------------------ transformers Cache interface
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.layers[0].capacity if self.static else -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        context = self._context
        return (context.kv_len if context is not None else self.length + query_length), 0

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a DeferredPrefillCache cannot be cropped")

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        context = self._context
        if context is None or context.write_slots is None:
            raise RuntimeError(
                "this DeferredPrefillCache is written only by Raincheck's forwards; call `generate` with "
                "`raincheck_config=` (after `enable_raincheck(model)`) to use it"
            )
        # a layer on another GPU of a device_map gets its own copy of the slots (one per forward)
        slots = context.slots_on(key_states.device)
        keys, values = self.layers[layer_idx].write(key_states, value_states, slots, context.kv_len)
        compact = context.compact_keys
        if compact is not None:  # the keys this forward sees, compacted (see `ForwardContext.compact_keys`)
            old = compact
            if old < 0:  # the rows fill slots [-old-1, kv_len) contiguously: the buffers' prefix is it
                return keys[:, :, : context.kv_len], values[:, :, : context.kv_len]
            key_states, value_states = key_states.to(keys.dtype), value_states.to(values.dtype)
            if old == 0:
                return key_states, value_states
            return (
                torch.cat([keys[:, :, :old], key_states], dim=2),
                torch.cat([values[:, :, :old], value_states], dim=2),
            )
        return keys, values

    def reset(self) -> None:
        raise NotImplementedError("start a new conversation with a new DeferredPrefillCache instead of reset()")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("a DeferredPrefillCache does not support beam search")

    def batch_repeat_interleave(self, repeats: int):
        if repeats != 1:
            raise NotImplementedError("a DeferredPrefillCache holds one sequence")

    def batch_select_indices(self, indices):
        raise NotImplementedError("a DeferredPrefillCache holds one sequence")

    # ------------------------------------------------------------------ atomic changes
    def transaction(self) -> CacheTransaction:
        """``with cache.transaction():`` around a forward and its bookkeeping: if the block raises (an error, a
        ``KeyboardInterrupt``), the cache is put back as it was before the block (see
        `hf_raincheck.cache.transaction`). Transactions do not nest."""
        return CacheTransaction(self)

    @property
    def in_transaction(self) -> bool:
        """Whether a `transaction` is open (the forwards of `run_rows` and compiled steps require one)."""
        return self._transaction is not None

    def after_commit(self, cleanup) -> None:
        """Runs `cleanup` (a callable that only frees memory) once the open transaction commits; now if none."""
        if self._transaction is None:
            cleanup()
        else:
            self._transaction.cleanups.append(cleanup)

    def in_place_update(self, what: str) -> None:
        """Tells the open transaction that `what` is about to change device state in place (compiled steps of a
        model with GDN layers): a rollback after this point cannot restore it, and leaves the cache unusable."""
        if self._transaction is not None and self.gdn_states:
            self._transaction.in_place = what

    def check_usable(self, caller: str) -> None:
        """Raises a RuntimeError naming `caller` if an interrupted in-place update left this cache unusable."""
        if self._unusable is not None:
            raise RuntimeError(
                f"{caller}: this DeferredPrefillCache cannot continue: {self._unusable}; start a new conversation "
                f"(no {hf.CACHE_ARGUMENT}) with the conversation so far"
            )

    def tidy(self) -> None:
        """Frees what a fully restored plan no longer needs (its store, the GDN checkpoints), in case the
        clean-up after the forward that finished it was interrupted. A no-op otherwise."""
        for plan in self.plans:
            if plan.pending == 0 and plan.store_embeds is not None:
                plan.release_store()
        if self.pending == 0:
            self.release_gdn_checkpoints()

    def _save_state(self) -> tuple:
        """Everything a transaction may change on the host, and references to the GDN layer states (only the
        last `turn_stats` entry is ever updated in place; the list itself is replaced, never edited)."""
        record = self.turn_stats[-1] if self.turn_stats else None
        records = [] if record is None else [(record, _values(record))]
        return (self._tokens, self.plan, self.plans, [(p, p.restored) for p in self.plans], self.rope_delta,
                self.media_grids, _values(self.stats), self.turn_stats, records, self.gdn_snapshot())

    def _restore_state(self, saved: tuple, marked: list[torch.Tensor]) -> None:
        """Puts back what `_save_state` saved, and unmarks `marked` (slots marked filled since)."""
        tokens, plan, plans, restored, rope_delta, media_grids, stats, turn_stats, records, gdn = saved
        for slots in marked:  # every slot a forward writes was empty before it
            self._filled.index_fill_(0, slots.to(self._filled.device), False)
        for item, value in restored:
            item.restored = value
        for record, values in records:
            for f, value in zip(dataclasses.fields(record), values):
                setattr(record, f.name, value)
        for f, value in zip(dataclasses.fields(self.stats), stats):
            setattr(self.stats, f.name, value)
        self.gdn_rollback(gdn)
        self._tokens, self.plan, self.plans, self.rope_delta = tokens, plan, plans, rope_delta
        self.media_grids, self.turn_stats = media_grids, turn_stats

    def _mark_unusable(self, reason: str) -> None:
        self._unusable = reason

    # ------------------------------------------------------------------ buffers and slots
    @property
    def pooled_buffers(self) -> dict[str, torch.Tensor] | None:
        """A static cache's pooled buffers by role name (handed to the next conversation when this cache is
        freed, `buffer_pool`); None for a dynamic cache."""
        return None if self._buffers is None else self._buffers.buffers

    def pooled_zeros(self, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """A zero buffer of role `name` from the static buffer pool (a static address compiled steps read in
        place); static caches only."""
        if self._buffers is None:
            raise RuntimeError("pooled buffers belong to static caches (cache_implementation='static')")
        return self._buffers.zeros(name, shape, dtype, device)

    @property
    def device(self) -> torch.device | None:
        """The device of the slot bookkeeping (the filled-slot mask, the slot index): the model's input
        device; None before the first `reserve`."""
        return None if self._filled is None else self._filled.device

    @property
    def slot_index(self) -> torch.Tensor | None:
        """``arange(capacity)`` on `device`: persistent, so 0-d views of it are per-step inputs without a
        host-to-device copy."""
        return self._slot_index

    def mark_filled(self, slots: torch.Tensor) -> None:
        """Marks `slots` as holding an entry (after the forward that wrote them finished; inside a
        `transaction`, which unmarks them if it rolls back)."""
        self.marks_filled(slots)
        self._filled.index_fill_(0, slots, True)

    def adopt_filled(self, view: torch.Tensor) -> None:
        """Makes `view` (bool ``[capacity]``, a row of a batch's shared mask: `BatchedDeferredPrefillCache`) this
        cache's filled-slot mask, with the entries it holds now. A later `reserve` beyond it moves the cache to a
        mask of its own again."""
        if self._filled is not None:
            n = min(self._filled.numel(), view.numel())
            view[:n] = self._filled[:n].to(view.device)
        self._filled, self._slot_index = view, torch.arange(view.numel(), device=view.device)  # (one line)

    def detach_shared(self) -> None:
        """Gives this cache buffers of its own when its KV layers, filled-slot mask (and GDN states) are rows of a
        batch's shared buffers (`BatchedDeferredPrefillCache`): a conversation continued alone then no longer keeps
        the whole batch's buffers alive. A dynamic cache's new buffers are sized to what it holds (`trim`); a static
        cache keeps its capacity (the shape of its compiled steps) and gets copies. A no-op for a cache with its own
        buffers."""
        if self.shared_by is None:
            return
        if not self.static:
            self.trim()
            return
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys, layer.values = layer.keys.clone(), layer.values.clone()  # (one line: they match)
        if self._filled is not None:
            self._filled = self._filled.clone()
        for state in self.gdn_states.values():  # (rows of a static batch's GDN buffers, compiled batch steps)
            state.persist(lambda field, tensor: tensor.clone())
        self.shared_by = None

    @property
    def capacity_needed(self) -> int:
        """Slots the cache needs between calls: `length` rounded up to a multiple of 256 (at least 256), the
        granularity in which dynamic KV buffers grow (`SlotLayer.reserve`)."""
        return -(-max(self.length, 1) // _GROWTH) * _GROWTH

    def trim(self) -> int:
        """Moves this dynamic cache's KV layers and filled-slot mask to buffers of its own of `capacity_needed`
        slots, with the entries of its `length` slots (nothing at or past `length` is ever filled: slots there
        hold only padding's scratch writes), and its Gated DeltaNet states (live state, conv window, checkpoint)
        that are views into larger tensors (a batch's rows: rows of its last forward's outputs) to copies of their
        own. A row of a batch's shared buffers leaves them (the batch's buffers are freed once no row uses them),
        and a buffer that grew geometrically over earlier calls shrinks; a later call grows it again as it needs.
        The entries, the mask, the states and every later result are unchanged.
        Returns the slots per layer now (0: no KV yet).

        A no-op for a cache whose buffers already are its own at that size, and for a static cache (its capacity
        is the shape of its compiled steps, and its buffers go back to the static buffer pool). Call it between
        calls on the cache (it takes ``lock``: a background worker's chunk finishes first); it does not check for a
        call running on this thread, since an interrupted call may leave its markers behind (see
        `hf_raincheck.cache.transaction`) and the recovery's next call trims a row of a batch first
        (`detach_shared`)."""
        if self.static:
            return self.layers[0].capacity
        with self.lock: return self._trim_locked()  # noqa: E701  (one line: see `enable.generate`)

    def _trim_locked(self) -> int:
        capacity, length = self.capacity_needed, self.length
        # the decode tokens fed since the last read, to the host (on a batch's rows: views of its steps' [B] tensors)
        self._tokens = (self.token_ids, ())
        # (first: a batch must never take this cache's buffers for its own rows once one has moved)
        self.shared_by = None
        for layer in self.layers:
            if layer.is_initialized and not _own_buffer(layer.keys, layer.values, capacity):
                keys = layer.keys.new_zeros(layer.keys.shape[:2] + (capacity, layer.keys.shape[3]))
                values = layer.values.new_zeros(layer.values.shape[:2] + (capacity, layer.values.shape[3]))
                keys[:, :, :length] = layer.keys[:, :, :length]
                values[:, :, :length] = layer.values[:, :, :length]
                layer.keys, layer.values, layer.capacity = keys, values, capacity  # (one line: they always match)
        if self._filled is not None and not _own_buffer(self._filled, None, capacity):
            filled = torch.zeros(capacity, dtype=torch.bool, device=self._filled.device)
            filled[:length] = self._filled[:length]
            self._filled, self._slot_index = filled, torch.arange(capacity, device=filled.device)  # (one line)
        for state in self.gdn_states.values():  # (a batch's rows: views of its last forward's [B, ...] outputs)
            state.persist(_own_tensor)
        return next((layer.keys.shape[2] for layer in self.layers if layer.is_initialized), 0)

    def marks_filled(self, slots: torch.Tensor) -> None:
        """Tells the open transaction that `slots` are being marked filled (a compiled step marks them inside
        its graph), so a rollback unmarks them."""
        if self._transaction is not None:
            self._transaction.marked.append(slots)

    @property
    def scratch_slots(self) -> torch.Tensor | None:
        """Compiled static steps: the slots padding rows write to (the last `chunk_size` of the capacity, past
        the conversation: no row ever sees them); None until `place_scratch_slots`."""
        return self._scratch_slots

    def place_scratch_slots(self, chunk_size: int) -> None:
        """Puts `scratch_slots` at the end of the current capacity (a no-op when they are already there). The
        pool's role name carries the chunk size (``scratch_slots.63``), so a conversation with another chunk size
        leaves this one's buffer in the pool (one role, one layout: taking it would drop it, and the fused step's
        CUDA graph, which reads it at its static address, would be recorded again)."""
        width = self.layers[0].capacity
        scratch = self._scratch_slots
        if scratch is not None and scratch.numel() == chunk_size and self._scratch_end == width:
            return
        device = self.device
        scratch = self.pooled_zeros(f"scratch_slots.{chunk_size}", (chunk_size,), torch.long, device)
        scratch.copy_(torch.arange(width - chunk_size, width, device=device))
        self._scratch_slots, self._scratch_end = scratch, width

    # ------------------------------------------------------------------ internal helpers
    def bind_model(self, model) -> None:
        """Remembers the model this cache belongs to; refuses a different one, or one with another layer count."""
        if self._model_ref is None:
            text_config = model.config.get_text_config(decoder=True)
            expected = getattr(text_config, "num_hidden_layers", None)
            if expected is not None and len(self.layers) != expected:
                raise ValueError(
                    f"{hf.CACHE_ARGUMENT}: DeferredPrefillCache(num_layers={len(self.layers)}) does not fit this model, "
                    f"which has {expected} decoder layers; build it with num_layers={expected} (or pass no "
                    f"{hf.CACHE_ARGUMENT}: generate builds the cache)"
                )
            self._model_ref = weakref.ref(model)
            return
        owner = self._model_ref()
        if owner is None:
            raise ValueError(
                f"{hf.CACHE_ARGUMENT} is a DeferredPrefillCache whose model was freed; start a new conversation "
                f"(no {hf.CACHE_ARGUMENT})"
            )
        if owner is not model:
            raise ValueError(
                f"{hf.CACHE_ARGUMENT} is a DeferredPrefillCache built by a different model; "
                f"start a new conversation (no {hf.CACHE_ARGUMENT}) for this model"
            )

    def reserve(self, needed: int, device: torch.device) -> None:
        """Room for slots ``[0, needed)`` in the bookkeeping (KV buffers grow on their layer's device)."""
        if self.static:
            # geometric growth in multiples of 256: a chat's later turns rarely change the shapes that compiled
            # steps were built for (each capacity is a new graph). Layers below the largest capacity are grown to
            # it first (a growth that an interrupt stopped half-way), and the slot bookkeeping follows below.
            current = max(layer.capacity for layer in self.layers)
            target = current if needed <= current else -(-max(needed, current + current // 2) // 256) * 256
            for layer in self.layers:
                if layer.capacity < target:
                    layer.reserve(target)
            needed = target
        if self._filled is not None and needed <= self._filled.numel():
            return
        size = max(needed, 256) if self._filled is None else max(needed, 2 * self._filled.numel())
        if self.static:  # compiled steps read it in place (CUDA graphs keep its address): a pooled buffer
            grown = self._buffers.zeros("filled", (size,), torch.bool, device)
        else:
            grown = torch.zeros(size, dtype=torch.bool, device=device)
        if self._filled is not None:
            grown[: self._filled.numel()] = self._filled
        index = torch.arange(grown.numel(), device=device)
        self._filled, self._slot_index = grown, index  # (one line: the mask and the index always match)

    def slot_tensor(self, slot: int) -> torch.Tensor:
        """``[slot]`` as a long tensor on the model device: a view of a persistent index (no host-to-device copy)."""
        return self._slot_index[slot : slot + 1]

    def gdn_state(self, layer_idx: int) -> GDNLayerState:
        """The state of Gated DeltaNet layer `layer_idx` (created on first use, on that layer's device)."""
        state = self.gdn_states.get(layer_idx)
        if state is None:
            state = self.gdn_states[layer_idx] = GDNLayerState(fixed=self.gdn_fixed_layout)
        return state

    def use_fixed_gdn_layout(self, key_dims: dict) -> None:
        """GDN states keep one shape from now on (compiled static steps); `key_dims`: key head dim by layer."""
        self.gdn_fixed_layout = True
        for idx, state in self.gdn_states.items():
            state.make_fixed(key_dims[idx])

    def persist_gdn_states(self) -> None:
        """Compiled static steps update GDN states in place, but eager forwards (a prefill, a completion chunk)
        build new tensors, and a new address makes the steps' CUDA graphs record again (at the next decode step
        and the next fused step, every turn). So after such a forward every GDN
        layer's tensors are copied into the cache's persistent buffers (pooled across conversations like the KV
        buffers) and the layer points at those. A no-op for dynamic caches and eager static steps."""
        if not (self.static and self.gdn_fixed_layout):
            return
        copies: list = []
        for idx, state in self.gdn_states.items():
            state.persist(lambda field, tensor, idx=idx: self._buffers.persistent(f"gdn{idx}.{field}", tensor, copies))
        copy_pairs(copies)  # (in a few launches: this runs right after a prefill, host-bound on a GPU)

    def pending_gdn_buffers(self) -> None:
        """Gives every GDN layer its ``pending`` buffer (`GDNLayerState`; zeros, pooled, a static address), which
        compiled fused steps add their windows' checkpoint changes to instead of joining them (`ops.lazy_window_`);
        marks the live states unjoined until `join_pending_gdn`. Called by every fused step: the layers are walked
        only while some lack a buffer (the fixed layout's shapes never change within a cache)."""
        if self._gdn_pending_layers != len(self.gdn_states):
            for idx, layer in self.gdn_states.items():
                if layer.pending is None:
                    layer.pending = self._buffers.zeros(f"gdn{idx}.pending", (*layer.state.shape[:-1], layer.value_dim),
                                                        torch.float32, layer.state.device)
            self._gdn_pending_layers = len(self.gdn_states)
        self._gdn_unjoined = True

    def join_pending_gdn(self) -> None:
        """Folds what compiled fused steps left pending into the live GDN states (``S += P_tail pending``, then
        ``pending = 0``; `ops.join_pending_`), so every other reader sees the whole live state: run before any forward
        that is not a fused compiled step (`begin_forward`) and when a ``generate`` call ends (`end_turn`). A no-op
        when nothing is pending."""
        if not self._gdn_unjoined:
            return
        for layer in self.gdn_states.values():
            if layer.pending is not None:
                join_pending_(layer.state, layer.pending)
        self._gdn_unjoined = False

    def gdn_snapshot(self) -> dict:
        """References to every GDN layer state, for `gdn_rollback` if a forward fails half-way."""
        return {idx: state.snapshot() for idx, state in self.gdn_states.items()}

    def gdn_rollback(self, snapshot: dict) -> None:
        """Puts the GDN layer states back as they were at `snapshot` (a layer that had advanced its recurrent
        state before a later layer raised would otherwise apply those rows twice when they are retried)."""
        for idx in list(self.gdn_states):
            if idx not in snapshot:
                del self.gdn_states[idx]
        for idx, state in snapshot.items():
            self.gdn_states[idx].restore(state)

    def release_gdn_checkpoints(self) -> None:
        """Drops the prefix checkpoints and P_tail maps once the plan they serve has nothing pending."""
        for state in self.gdn_states.values():
            state.release()

    def filled_prefix(self, kv_len: int) -> torch.Tensor:
        return self._filled[:kv_len]

    def mask_width(self, kv_len: int) -> int:
        """Key width the attention sees: ``kv_len`` (dynamic) or the whole static buffer."""
        return self.layers[0].capacity if self.static else kv_len


def _own_tensor(field: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a copy when it is a view into a larger storage (a row of a batch's tensor): what `trim` makes of
    each GDN state field (`GDNLayerState.persist`)."""
    return tensor if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size() else tensor.clone()


def _own_buffer(first: torch.Tensor, second: torch.Tensor | None, capacity: int) -> bool:
    """Whether `first` (and `second`) hold `capacity` slots (dim 2 of a KV buffer, dim 0 of a mask) in storages of
    their own: not a view of a larger buffer, not a larger buffer."""
    for tensor in (first, second):
        if tensor is None:
            continue
        slots = tensor.shape[2] if tensor.dim() == 4 else tensor.shape[0]
        if slots != capacity or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            return False
    return True
