"""Compiled decode / fused steps of a static batch (``cache_implementation="static"``, B > 1 rows): the batch-1
`StaticStep` (`hf_raincheck.generation.decode`) for B rows.

The batch's shared KV buffers ``[B, H, capacity, D]`` and filled mask ``[B, capacity]``
(`BatchedDeferredPrefillCache.reserve_static`) are reserved once per call, before its (eager, shared) prefill, and
never reallocated during the call. Two graphs per batch size and capacity, with fixed shapes:

* a decode-only step, ``[B, 1]``: row b feeds its token at its next slot, or (a row that stopped) writes to a
  scratch slot that no row sees;
* a fused step, ``[B, window + 1]``: row b's next ``limit[b]`` deferred rows (its window, gathered inside the
  graph from the batch's persistent padded store ``[B, capacity, ...]`` at ``start[b]``), padding up to
  ``window`` rows, then its decode row. ``window`` is ``chunk_size``, or less where ``step_deferred_budget`` caps
  each row's carry (`shared_batch.fused_window`: ``ceil(budget / B)``, so a step's work follows the budget, not
  B x chunk_size). Padding writes to scratch slots past every row's entries.

Scratch slots are the last ``chunk_size + 1`` of the capacity: chunk position j pads to slot
``capacity - window - 1 + j``, a stopped row's decode position to the last slot; they are never marked filled,
and every real row's slot is below them, so no real row sees them. Each row's mask is its batch-1 step's
(`visibility.visible`, per row: its own filled slots, boundary and deferred-slot mask). What changes from step to
step reaches the graph as tensors: the fed tokens ``[B, 1]`` and one ``[4, B]`` long tensor (each row's decode
slot, whether it is live, its window's start and length), copied to the device once per step. The per-row carry
counts are the shared engine's (`carry_counts` over ``step_deferred_budget``, `shared_batch.shared_step`).

Gated DeltaNet layers (Qwen3.5): every row's GDN states are rows of the batch's buffers
(`BatchedDeferredPrefillCache.sync_gdn_states`, copied in after an eager forward replaced a row's), which the graph
updates in place (`gdn_state.graph_layer.gdn_batch_forward_graph`: the same ``[4, B]`` tensor tells each row's window
length and whether its decode row is live; a fused step leaves every row's join pending,
`BatchedDeferredPrefillCache.pending_gdn_buffers`, folded in before any other forward and when the call ends). No
rollback restores them: an interrupt after a step started leaves the
rows unusable, with an error that says why (rule 8's exception, as for a compiled batch-1 step).
"""

from __future__ import annotations

import torch

from ..cache import ForwardContext
from ..cache.batched import BatchedDeferredPrefillCache
from ..gdn_state import GDNBatchGraphStep
from ..gdn_state.kernels import functions as gdn_functions
from .decode import CompiledByStepKind, compiled_gdn_backend
from .rows import count_restored
from .shared_batch import fused_window
from .shared_step import host_to_device
from .visibility import visible_rows


def scratch_rows(chunk_size: int) -> int:
    """Slots a compiled batch step keeps free at the end of the capacity (its padding's scratch slots)."""
    return chunk_size + 1


def _batch_step_graph(adapter, group, tokens, meta, rope_deltas, chunk, backend: str, visibility: str,
                      window: int):
    """The traced body of a compiled batch step (module docstring). `meta` is long ``[4, B]``: each row's decode
    slot, live flag (0 / 1), window start and window length; `chunk` is None (a decode-only step) or the padded
    store ``(embeds [B, W, H], positions [3, B, W], slots [B, W], valid [B, W], deepstack [B, W, H] per layer or
    None, boundary [B], deferred_slots [B, capacity])``. Returns the logits ``[B, 1, V]``."""
    filled = group.filled
    width = filled.shape[1]
    batch = tokens.shape[0]
    device = filled.device
    context = group.forward_context  # installed by `StaticBatchStep._run`; the slots are computed here
    live = meta[1] > 0
    live_slots = torch.where(live, meta[0], width - 1)  # [B]; a stopped row's decode position: the last slot
    live_embeds = adapter.embed_tokens(tokens)  # [B, 1, H]
    live_positions = (live_slots + rope_deltas)[None, :, None].expand(3, batch, 1)
    deepstack = None
    if chunk is None:
        embeds, positions, slots, valid, deferred, boundary, deferred_slots = (
            live_embeds, live_positions, live_slots[:, None], live[:, None], None, None, None)
    else:
        s_embeds, s_positions, s_slots, s_valid, s_deepstack, boundary, deferred_slots = chunk
        start, limit = meta[2], meta[3]
        rows = torch.arange(window, device=device)
        at = start[:, None] + rows[None, :]  # [B, window]: gathered here, so no per-step view is a graph input
        d_valid = s_valid.gather(1, at) & (rows[None, :] < limit[:, None])
        scratch = (width - window - 1) + rows
        d_slots = torch.where(d_valid, s_slots.gather(1, at), scratch[None, :])
        hidden_size = s_embeds.shape[-1]
        by_row = at[:, :, None].expand(-1, -1, hidden_size)
        d_embeds = s_embeds.gather(1, by_row).to(live_embeds.dtype)
        d_positions = s_positions.gather(2, at[None].expand(s_positions.shape[0], -1, -1))
        embeds = torch.cat([d_embeds, live_embeds], dim=1)
        positions = torch.cat([d_positions, live_positions], dim=2)
        slots = torch.cat([d_slots, live_slots[:, None]], dim=1)
        valid = torch.cat([d_valid, live[:, None]], dim=1)
        deferred = torch.cat([d_valid, torch.zeros_like(live)[:, None]], dim=1)
        if s_deepstack is not None:
            deepstack = [torch.cat([f.gather(1, by_row).to(live_embeds.dtype),
                                    live_embeds.new_zeros((batch, 1, hidden_size))], dim=1) for f in s_deepstack]
    gdn = context.gdn_step
    if gdn is not None:  # GDN layers (`gdn_state.graph_layer.gdn_batch_forward_graph`) read which rows are real
        gdn.live = live
        if chunk is not None:
            gdn.valid, gdn.count = d_valid, limit
    # every row's mask at once, each over its own slots (padding sees its own scratch slot)
    present = filled.clone().scatter_(1, slots, True)  # [B, W]
    keys = torch.arange(width, device=device)
    seen = visible_rows(present, keys, slots, deferred, boundary, deferred_slots, visibility)
    context.write_slots = slots
    hidden = adapter.language_forward(embeds, positions, seen[:, None], group, deepstack, backend)
    filled.scatter_(1, slots, filled.gather(1, slots) | valid)
    return adapter.lm_head(hidden[:, -1:])


def _batch_decode_step_graph(*args):
    """`_batch_step_graph` for decode-only steps (`decode.CompiledByStepKind`: a code object of its own)."""
    return _batch_step_graph(*args)


def _batch_fused_step_graph(*args):
    """`_batch_step_graph` for fused steps (`decode.CompiledByStepKind`: a code object of its own)."""
    return _batch_step_graph(*args)


class StaticBatchStep:
    """Compiled decode / fused steps on a static `BatchedDeferredPrefillCache` (module docstring). Built once per
    model and compile config (`compile_options`: ``torch.compile`` keyword arguments); one graph per batch size,
    capacity and step kind."""

    def __init__(self, compile_options: dict):
        self.compiled = CompiledByStepKind(_batch_decode_step_graph, _batch_fused_step_graph, compile_options,
                                           chunk_arg=5)

    @staticmethod
    def prepare(group: BatchedDeferredPrefillCache, chunk_size: int) -> None:
        """Copies every row's pending deferred store into the batch's persistent padded store buffers (once per
        set of plans and capacity, at the first compiled fused step that carries them; a first-token call never
        runs one, so it copies nothing): row b's store row i at ``[b, i]``, zeros and ``valid`` False elsewhere, so
        each fused step passes the same tensors and gathers every row's window inside the graph."""
        caches = group.rows
        current = [c.plan for c in caches]  # (a plan finishing during the call keeps the copy: no new copy then)
        plans = [p if p is not None and p.pending else None for p in current]
        if not any(plans):
            return
        width = group.capacity
        buffers = group.store_buffers
        if buffers is not None and buffers["width"] == width and len(buffers["plans"]) == len(current) and all(
                a is b for a, b in zip(buffers["plans"], current)):
            return
        ref = next(p for p in plans if p is not None)
        layers = max((len(p.store_deepstack) for p in plans if p is not None and p.store_deepstack is not None),
                     default=0)
        key = (width, len(caches), ref.store_embeds.shape[-1], ref.store_embeds.dtype, group.filled.device, layers,
               ref.store_positions.shape[0])
        if buffers is None or buffers["key"] != key:
            buffers = group.store_buffers = _store_buffers(group, key, ref)
        for name in ("embeds", "positions", "slots", "valid", "boundary", "deferred_slots"):
            buffers[name].zero_()
        for f in buffers["deepstack"] or ():
            f.zero_()
        for b, plan in enumerate(plans):
            if plan is None:
                continue
            total = plan.total_deferred
            if total + chunk_size > width:
                raise RuntimeError(f"static batch cache of capacity {width} cannot hold row {b}'s {total} "
                                   "deferred tokens")
            r = plan.restored
            buffers["embeds"][b, r:total] = plan.store_embeds[r:total].to(buffers["embeds"].dtype)
            buffers["positions"][:, b, r:total] = plan.store_positions[:, r:total]
            buffers["slots"][b, r:total] = plan.deferred_on_device[r:total]
            buffers["valid"][b, r:total] = True
            if plan.store_deepstack is not None:
                for target, source in zip(buffers["deepstack"], plan.store_deepstack):
                    target[b, r:total] = source[r:total].to(target.dtype)
            buffers["boundary"][b] = plan.boundary
            buffers["deferred_slots"][b, : plan.boundary] = plan.deferred_slot_mask[: plan.boundary]
        buffers["plans"] = current
        buffers["width"] = width

    def __call__(self, adapter, group: BatchedDeferredPrefillCache, bturn, tokens: torch.Tensor, live: list[bool],
                 counts: list[int]) -> torch.Tensor:
        """One step of every row (row b carries ``counts[b]`` deferred tokens, at most the fused window, and feeds
        ``tokens[b]`` if ``live[b]``); marks the slots filled and counts the plans' progress inside every row's
        transaction (`shared_rows.row_transactions`, as the eager steps). Returns the logits ``[B, 1, V]``."""
        caches = group.rows
        config = bturn.config
        chunk_size = config.chunk_size
        width = group.capacity
        window = fused_window(chunk_size, bturn.step_budget, len(caches))
        if max(counts) > window:
            raise ValueError(f"a compiled batch step carries at most {window} deferred tokens per row, got {counts}")
        lengths = [c.length for c in caches]
        if max([n for n, alive in zip(lengths, live) if alive], default=0) >= width - scratch_rows(chunk_size):
            raise RuntimeError("static Raincheck batch cache is full: reserve more max_new_tokens")
        if not all(c.in_transaction for c in caches):
            raise RuntimeError("a compiled batch step runs inside every row cache's transaction")
        chunk = None
        starts = [0] * len(caches)
        if any(counts):
            self.prepare(group, chunk_size)  # the first fused step of a set of plans copies; later ones skip
            buffers = group.store_buffers
            chunk = (buffers["embeds"], buffers["positions"], buffers["slots"], buffers["valid"],
                     buffers["deepstack"], buffers["boundary"], buffers["deferred_slots"])
            starts = [c.plan.restored if n else 0 for c, n in zip(caches, counts)]
        device = group.filled.device
        meta = host_to_device(lengths + [int(a) for a in live] + starts + counts, device).view(4, len(caches))
        # the graph marks the slots; each row's transaction learns them first (a rollback unmarks them)
        for cache, n, alive, count in zip(caches, lengths, live, counts):
            if count:
                plan = cache.plan
                cache.marks_filled(plan.deferred_on_device[plan.restored : plan.restored + count])
            if alive:
                cache.marks_filled(cache.slot_tensor(n))
        context = ForwardContext(write_slots=None, kv_len=width)  # the slots are set inside the graph
        if adapter.gdn_glue is not None:  # every row's GDN states as rows of the batch's buffers, updated in place
            backend = compiled_gdn_backend(config.gdn_backend, device)
            gdn_functions(backend)  # imported here, outside the trace (as `StaticStep`)
            fused = chunk is not None  # (a fused step leaves its joins pending: `begin_forward` / `end_turn` fold them)
            context.gdn_step = GDNBatchGraphStep(layers=group.sync_gdn_states(), backend=backend, lazy=fused)
            if fused:
                group.pending_gdn_buffers()
            for cache in caches:  # (no rollback restores them: an interrupt from here leaves the rows unusable)
                cache.in_place_update("a compiled static batch step")
        try:
            group.begin_forward(context)
            logits = self.compiled(adapter, group, tokens, meta, bturn.rope_deltas(device), chunk, bturn.backend,
                               config.visibility, window)
        finally:
            group.end_forward()
        for cache, count in zip(caches, counts):
            if count:
                count_restored(cache, cache.plan, count)
        return logits


def _store_buffers(group: BatchedDeferredPrefillCache, key: tuple, ref) -> dict:
    """Zero padded-store buffers for `key` ``(width, B, H, dtype, device, deepstack layers, position axes)``: the
    batch's pooled static addresses (`BatchedDeferredPrefillCache.zeros`; compiled steps read them in place, CUDA
    graphs keep their addresses)."""
    width, batch, hidden, dtype, device, layers, axes = key
    zeros = group.zeros
    return dict(
        key=key, plans=[], width=width,
        embeds=zeros("store.embeds", (batch, width, hidden), dtype, device),
        positions=zeros("store.positions", (axes, batch, width), ref.store_positions.dtype, device),
        slots=zeros("store.slots", (batch, width), torch.long, device),
        valid=zeros("store.valid", (batch, width), torch.bool, device),
        deepstack=[zeros(f"store.deepstack{k}", (batch, width, hidden), dtype, device) for k in range(layers)] or None,
        boundary=zeros("store.boundary", (batch,), torch.long, device),
        deferred_slots=zeros("store.deferred_slots", (batch, width), torch.bool, device),
    )
