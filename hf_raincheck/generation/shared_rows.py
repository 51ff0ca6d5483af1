"""One decoder forward shared by the rows of a batch: each row its own `Rows`, plan and visibility.

Row b's rows are right-aligned in the forward (``[B, q]``, q the longest row's count), so the last position is
every row's logits row; the positions before a shorter row's rows are padding: they all write to one scratch slot
past every row's entries (``W_real``; which padding position's entry it keeps does not matter), see only that
slot, and it is never marked filled, so no real row ever sees it (the key width is ``W_real + 1``, not
``W_real`` + the padding: a row folding thousands of pending tokens next to a short one does not widen the
shared buffers). Each row's mask is the one its batch-1 forward builds (`visibility_mask`, docs/design.md
rule 2) over the shared key width. Keys and values are the rows' own (`BatchedDeferredPrefillCache.update`), so
every row computes what its batch-1 forward computes, up to float rounding.
"""

from __future__ import annotations

import contextlib

import torch

from ..attention.sdpa import eager_sdpa_backends
from ..cache import DeferralPlan, DeferredPrefillCache, ForwardContext
from ..cache.batched import BatchedDeferredPrefillCache
from ..gdn_state import resolve as resolve_gdn_backend
from ..gdn_state.shared_layer import SharedGDNSteps
from .rows import Rows, count_restored, gdn_step
from .shared_step import host_to_device
from .visibility import visibility_mask


def row_transactions(caches: list[DeferredPrefillCache]) -> contextlib.ExitStack:
    """Every row cache's `transaction`, entered in row order (exits in reverse: each rolls its row back on an
    error or interrupt)."""
    stack = contextlib.ExitStack()
    for cache in caches:
        stack.enter_context(cache.transaction())
    return stack


def run_shared_rows(
    adapter,
    group: BatchedDeferredPrefillCache,
    items: list[tuple[Rows | None, DeferralPlan | None]],
    backend: str,
    visibility: str,
    want_logits: bool,
) -> torch.Tensor | None:
    """One forward over every row's `Rows` (``items[b]``: row b's rows or None, and the plan whose deferred rows
    lead them, or None); returns the logits ``[B, 1, V]`` of each row's last position if asked (a row without
    rows gets padding's logits: ignore them).

    Call it inside every row cache's `transaction` (the caller records what it keeps of the forward there); the
    slots are marked filled and the plans' progress counted here, as `run_rows` does for one row."""
    caches = group.rows
    if len(items) != len(caches):
        raise RuntimeError("run_shared_rows: one item per row")
    for cache in caches:
        if not cache.in_transaction:
            raise RuntimeError("run_shared_rows runs inside every row cache's transaction")
    present = [(b, rows) for b, (rows, _) in enumerate(items) if rows is not None and rows.size > 0]
    if not present:
        raise RuntimeError("run_shared_rows: no row has anything to run")
    device = present[0][1].embeds.device
    sizes = [0] * len(items)
    kv_real = max(c.length for c in caches)
    for b, rows in present:
        sizes[b] = rows.size
        kv_real = max(kv_real, rows.max_slot + 1)
    q = max(sizes)
    n_pad = q - min(sizes)  # positions that are padding in some row: they all write the one scratch slot kv_real
    width = kv_real + (1 if n_pad else 0)
    group.share_buffers(width)
    for cache in caches:
        cache.reserve(width, device)

    batch = len(items)
    hidden_size = present[0][1].embeds.shape[-1]
    embeds = present[0][1].embeds.new_zeros((batch, q, hidden_size))
    positions = torch.zeros((3, batch, q), dtype=torch.long, device=device)
    slots = torch.zeros((batch, q), dtype=torch.long, device=device)
    slots[:, :n_pad] = kv_real
    mask = torch.zeros((batch, 1, q, width), dtype=torch.bool, device=device)
    mask[:, 0, :n_pad, kv_real:] = True  # the scratch slot only (seeing nothing is NaN)
    deepstack = None
    n_deepstack = next((len(rows.deepstack) for _, rows in present if rows.deepstack is not None), 0)
    if n_deepstack:
        deepstack = [embeds.new_zeros((batch, q, hidden_size)) for _ in range(n_deepstack)]
    starts = {}
    for b, rows in present:
        start = starts[b] = q - rows.size
        plan = items[b][1]
        has_deferred = plan is not None and rows.restored > 0
        embeds[b, start:] = rows.embeds.to(embeds.dtype)
        positions[:, b, start:] = rows.positions
        slots[b, start:] = rows.slots
        mask[b, 0, start:] = visibility_mask(
            caches[b].filled_prefix(width),
            rows.slots,
            rows.deferred if has_deferred else None,
            plan.boundary if has_deferred else 0,
            plan.deferred_slot_mask if has_deferred else None,
            visibility,
            width,
        )[0, 0]
        mask[b, 0, start:, kv_real:] = False
        if rows.deepstack is not None:
            for layer, feature in zip(deepstack, rows.deepstack):
                layer[b, start:] = feature.to(layer.dtype)

    context = ForwardContext(write_slots=slots, kv_len=width)
    if adapter.gdn_glue is not None:  # Gated DeltaNet layers: each row on its own states (docs/design.md rule 3)
        gdn_backend = resolve_gdn_backend(caches[0].config.gdn_backend, device)
        context.gdn_step = SharedGDNSteps(rows=[
            None if b not in starts else (starts[b], gdn_step(caches[b], items[b][0], items[b][1], gdn_backend),
                                          caches[b].gdn_state)
            for b in range(batch)
        ])
    try:
        group.begin_forward(context)
        with eager_sdpa_backends(device, q):
            hidden = adapter.language_forward(embeds, positions, mask, group, deepstack, backend)
    finally:
        group.end_forward()
    for b, rows in present:
        cache: DeferredPrefillCache = caches[b]
        cache.mark_filled(rows.slots)
        plan = items[b][1]
        if plan is not None and rows.restored:
            count_restored(cache, plan, rows.restored, keep_checkpoints=rows.checkpoint_plan is not None)
    if not want_logits:
        return None
    return adapter.lm_head(hidden[:, -1:])


def run_shared_decode(adapter, group: BatchedDeferredPrefillCache, embeds: torch.Tensor, live: list[bool],
                      rope_deltas: torch.Tensor, backend: str) -> torch.Tensor:
    """A shared decode step that carries no deferred tokens: row b feeds ``embeds[b]`` (``[B, 1, H]``) at its next
    slot if ``live[b]``, else writes nothing of its own (a stopped row: its position is padding, written to a
    scratch slot). Same result as `run_shared_rows` with one live row per row, built with a few batched operators
    instead of a few dozen per row (eager steps are host-bound): a live row sees every filled slot of its row
    (all below its own), which is its batch-1 step's mask. Returns the logits ``[B, 1, V]``."""
    caches = group.rows
    device = embeds.device
    lengths = [c.length for c in caches]
    kv_real = max(max(lengths), max(n + 1 for n, alive in zip(lengths, live) if alive))
    width = kv_real + (0 if all(live) else 1)
    group.share_buffers(width)
    for cache in caches:
        cache.reserve(width, device)
    slots = host_to_device([n if alive else kv_real for n, alive in zip(lengths, live)], device)[:, None]
    mask = group.filled[:, :width].clone().scatter_(1, slots, True)[:, None, None, :]
    positions = (slots + rope_deltas[:, None]).expand(3, -1, -1)  # [3, B, 1]
    context = ForwardContext(write_slots=slots, kv_len=width)
    if adapter.gdn_glue is not None:
        gdn_backend = resolve_gdn_backend(caches[0].config.gdn_backend, device)
        context.gdn_step = SharedGDNSteps(rows=[
            (0, gdn_step(cache, _one_live_row(cache, n), None, gdn_backend), cache.gdn_state) if alive else None
            for cache, n, alive in zip(caches, lengths, live)
        ])
    try:
        group.begin_forward(context)
        with eager_sdpa_backends(device, 1):
            hidden = adapter.language_forward(embeds, positions, mask, group, None, backend)
    finally:
        group.end_forward()
    # every row's transaction learns its slot first (a rollback unmarks it), then one write marks them all; a
    # stopped row's scratch slot (kv_real, never filled) gets False
    for cache, n, alive in zip(caches, lengths, live):
        if alive:
            cache.marks_filled(cache.slot_tensor(n))
    group.filled.scatter_(1, slots, slots < kv_real)
    return adapter.lm_head(hidden[:, -1:])


def _one_live_row(cache: DeferredPrefillCache, slot: int) -> Rows:
    """What `gdn_step` reads of a decode row (no deferred rows, no new plan)."""
    return Rows(slots=None, embeds=None, positions=None, deepstack=None, deferred=None, max_slot=slot)
