"""A batch's fused decode step built with a fixed number of operators, whatever the number of rows.

`run_shared_rows` builds each row's rows and mask on its own (a few dozen operators per row: eager steps are
host-bound, so that cost grows with the batch). A decode step has a fixed shape per row, at most its next deferred
chunk and its decode row, so the step here gathers every row's chunk with one ``cat`` per tensor kind, places all
rows into the ``[B, q]`` layout with one ``index_copy`` each, and computes every row's mask at once from the rows'
shared filled-slot mask (`BatchedDeferredPrefillCache.filled`), their boundaries and deferred-slot masks. The
layout and the masks are `run_shared_rows`' (docs/design.md rule 2; tests compare both with batch-1 runs): row b's
rows right-aligned, its chunk first, its decode row last; padding positions write to scratch slots and see only
their own slot. Host values (row lengths, counts, where each row goes) reach the device in one copy per step.
"""

from __future__ import annotations

import torch

from ..attention.sdpa import eager_sdpa_backends
from ..cache import ForwardContext
from ..cache.batched import BatchedDeferredPrefillCache
from ..gdn_state import resolve as resolve_gdn_backend
from ..gdn_state.shared_layer import SharedGDNSteps
from .rows import Rows, count_restored, gdn_step
from .visibility import visible_rows

_PAD, _LIVE, _DEFERRED = 0, 1, 2


class StepMasks:
    """Per batched call: every row's plan boundary ``[B]`` and deferred-slot mask ``[B, capacity]`` (the plans do
    not change during decoding), rebuilt when the shared capacity or a row's plan changes."""

    def __init__(self):
        self.key = None
        self.boundary = None
        self.deferred_slots = None

    def get(self, group: BatchedDeferredPrefillCache, device):
        plans = [c.plan for c in group.rows]
        key = (group.capacity, tuple(id(p) for p in plans))
        if key != self.key:
            boundary = [0 if p is None else p.boundary for p in plans]
            slots = torch.zeros((len(plans), group.capacity), dtype=torch.bool, device=device)
            for b, plan in enumerate(plans):
                if plan is not None and plan.deferred_slot_mask is not None:
                    mask = plan.deferred_slot_mask[: plan.boundary]
                    slots[b, : mask.numel()] = mask
            self.boundary = torch.tensor(boundary, dtype=torch.long, device=device)
            self.deferred_slots, self.key = slots, key
        return self.boundary, self.deferred_slots


def host_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A long tensor of host ints on `device` (on CUDA through pinned memory, not waiting for queued work)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":  # (pinned: the copy does not wait for the queued work)
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def run_shared_step(adapter, group: BatchedDeferredPrefillCache, live_embeds: torch.Tensor, live: list[bool],
                    counts: list[int], rope_deltas: list[int], masks: StepMasks, backend: str,
                    visibility: str) -> torch.Tensor:
    """One fused decode step for every row: row b carries its plan's next ``counts[b]`` deferred tokens and, if
    ``live[b]``, its decode row (embedding ``live_embeds[b]``, ``[B, 1, H]``) at its next slot. Marks the slots
    filled and counts the plans' progress (inside every row's transaction, like `run_shared_rows`); returns the
    logits ``[B, 1, V]`` of each row's last position."""
    caches = group.rows
    batch = len(caches)
    device = live_embeds.device
    sizes = [c + int(a) for c, a in zip(counts, live)]
    q = max(sizes)
    lengths = [c.length for c in caches]
    kv_real = max(n + int(a) for n, a in zip(lengths, live))
    width = kv_real + q - min(sizes)
    group.share_buffers(width)
    for cache in caches:
        cache.reserve(width, device)

    # host side: where every real row goes (the deferred rows of every row, then the decode rows), what it is, and
    # the decode rows' slots / positions
    dest, live_dest, live_rows = [], [], []
    for b, (count, alive) in enumerate(zip(counts, live)):
        start = b * q + q - sizes[b]
        dest.extend(range(start, start + count))
        if alive:
            live_dest.append(start + count)
            live_rows.append(b)
    n_deferred, n_live = len(dest), len(live_rows)
    n_real = n_deferred + n_live
    kinds = [_DEFERRED] * n_deferred + [_LIVE] * n_live
    live_slots = [lengths[b] for b in live_rows]
    live_positions = [lengths[b] + rope_deltas[b] for b in live_rows]
    every_live = n_live == batch
    meta = host_to_device(dest + live_dest + kinds + live_slots + live_positions + ([] if every_live else live_rows),
                          device)
    dest_t, kinds_t = meta[:n_real], meta[n_real : 2 * n_real]
    live_slot_t = meta[2 * n_real : 2 * n_real + n_live]
    live_pos_t = meta[2 * n_real + n_live : 2 * n_real + 2 * n_live]

    # the real rows' inputs: each row's chunk (views, one cat per kind), then every decode row at once (a batch's
    # decode rows cost a fixed number of operators)
    embeds_parts, position_parts, slot_parts = [], [], []
    deepstack_parts = None
    layers = next((len(c.plan.store_deepstack) for c, n in zip(caches, counts)
                   if n and c.plan.store_deepstack is not None), 0)
    if layers:
        deepstack_parts = [[] for _ in range(layers)]  # (the decode rows' DeepStack features are zeros)
    for cache, count in zip(caches, counts):
        if count:
            plan = cache.plan
            r = plan.restored
            embeds_parts.append(plan.store_embeds[r : r + count])
            position_parts.append(plan.store_positions[:, r : r + count])
            slot_parts.append(plan.deferred_on_device[r : r + count])
            if deepstack_parts is not None:
                for k in range(layers):
                    deepstack_parts[k].append(plan.store_deepstack[k][r : r + count])
    if n_live:
        rows = live_embeds.view(batch, -1)
        embeds_parts.append(rows if every_live else rows.index_select(0, meta[2 * n_real + 2 * n_live :]))
        position_parts.append(live_pos_t[None, :].expand(3, -1))
        slot_parts.append(live_slot_t)
    real_slots = torch.cat(slot_parts)

    embeds = live_embeds.new_zeros((batch * q, live_embeds.shape[-1]))
    embeds.index_copy_(0, dest_t, torch.cat(embeds_parts).to(embeds.dtype))
    positions = torch.zeros((3, batch * q), dtype=torch.long, device=device)
    positions.index_copy_(1, dest_t, torch.cat(position_parts, dim=1))
    scratch = kv_real + torch.arange(q, device=device)
    slots = scratch.repeat(batch).index_copy_(0, dest_t, real_slots).view(batch, q)
    kind = torch.zeros(batch * q, dtype=torch.long, device=device).index_copy_(0, dest_t, kinds_t).view(batch, q)
    deepstack = None
    if deepstack_parts is not None:
        deferred_dest = dest_t[:n_deferred]
        deepstack = [embeds.new_zeros(embeds.shape).index_copy_(0, deferred_dest, torch.cat(parts).to(embeds.dtype))
                     .view(batch, q, -1) for parts in deepstack_parts]

    # every row's mask at once (the rules of `visibility.visible`); a padding position writes False to its scratch
    # slot, which is never filled, and every slot is below `width`
    real = kind != _PAD
    present = group.filled[:, :width].clone().scatter_(1, slots, real)
    keys = torch.arange(width, device=device)
    deferred, boundary, deferred_slots = None, None, None
    if visibility == "boundary" and any(counts):
        deferred = kind == _DEFERRED
        boundary, deferred_slots = masks.get(group, device)
    seen = visible_rows(present, keys, slots, deferred, boundary, deferred_slots, visibility)
    mask = torch.where(real[:, :, None], seen, keys == slots[:, :, None])[:, None]

    context = ForwardContext(write_slots=slots, kv_len=width)
    if adapter.gdn_glue is not None:  # each row on its own states (docs/design.md rule 3)
        gdn_backend = resolve_gdn_backend(caches[0].config.gdn_backend, device)
        context.gdn_step = SharedGDNSteps(rows=[
            None if sizes[b] == 0 else (
                q - sizes[b],
                gdn_step(cache, Rows(slots=None, embeds=None, positions=None, deepstack=None, deferred=None,
                                     max_slot=lengths[b], restored=counts[b]),
                         cache.plan if counts[b] else None, gdn_backend),
                cache.gdn_state)
            for b, cache in enumerate(caches)
        ])
    try:
        group.begin_forward(context)
        with eager_sdpa_backends(device, q):
            hidden = adapter.language_forward(embeds.view(batch, q, -1), positions.view(3, batch, q), mask, group,
                                              deepstack, backend)
    finally:
        group.end_forward()

    # bookkeeping: the real rows' slots are filled; every row's transaction learns its slots first, so a rollback
    # anywhere from here unmarks them (unmarking a slot not yet marked changes nothing: it was empty)
    for b, (cache, size) in enumerate(zip(caches, sizes)):
        if size:
            cache.marks_filled(slots[b, q - size :])  # (row b's real rows, right-aligned)
    group.filled.scatter_(1, slots, real)
    for cache, count in zip(caches, counts):
        if count:
            count_restored(cache, cache.plan, count)
    return adapter.lm_head(hidden[:, -1:])
