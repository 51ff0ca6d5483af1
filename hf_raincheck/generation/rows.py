"""The rows of one Raincheck forward and the call that runs them through the decoder."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import DeferralPlan, DeferredPrefillCache, ForwardContext
from ..gdn_state import GDNStep
from ..gdn_state import resolve as resolve_gdn_backend
from ..models import ModelAdapter
from ..attention.dispatch import CAUSAL_LOWER_RIGHT
from ..attention.flash import flash_mask
from ..attention.sdpa import eager_sdpa_backends
from .visibility import visibility_mask


@dataclass
class Rows:
    """Rows fed to one forward, in processing order (deferred rows first, the row whose logits matter last)."""

    slots: torch.Tensor  # [q] long, logical indices
    embeds: torch.Tensor  # [q, H]
    positions: torch.Tensor  # [3, q] long
    deepstack: list[torch.Tensor] | None  # per DeepStack layer [q, H], zeros on non-visual rows (None: none)
    deferred: torch.Tensor  # [q] bool: rows restoring the plan's deferred tokens
    max_slot: int  # host-side max of `slots`
    restored: int = 0  # deferred rows carried (they lead the rows)
    # a new plan whose boundary falls inside these rows, and how many non-deferred rows come before it (GDN
    # layers checkpoint their state there)
    checkpoint_plan: DeferralPlan | None = None
    checkpoint_at: int = 0

    @property
    def size(self) -> int:
        return int(self.slots.numel())


def concat_rows(parts: list[Rows]) -> Rows:
    parts = [p for p in parts if p is not None and p.size > 0]
    if len(parts) == 1:
        return parts[0]
    deepstack = None
    if any(p.deepstack is not None for p in parts):
        n_layers = next(len(p.deepstack) for p in parts if p.deepstack is not None)
        like = next(p.deepstack[0] for p in parts if p.deepstack is not None)
        deepstack = [
            torch.cat([p.deepstack[k] if p.deepstack is not None else like.new_zeros(p.size, like.shape[1]) for p in parts])
            for k in range(n_layers)
        ]
    checkpoints = [p for p in parts if p.checkpoint_plan is not None]
    if checkpoints and checkpoints[0] is not parts[-1]:
        raise RuntimeError("rows with a plan boundary must come last")
    return Rows(
        checkpoint_plan=checkpoints[0].checkpoint_plan if checkpoints else None,
        checkpoint_at=checkpoints[0].checkpoint_at if checkpoints else 0,
        slots=torch.cat([p.slots for p in parts]),
        embeds=torch.cat([p.embeds for p in parts]),
        positions=torch.cat([p.positions for p in parts], dim=1),
        deepstack=deepstack,
        deferred=torch.cat([p.deferred for p in parts]),
        max_slot=max(p.max_slot for p in parts),
        restored=sum(p.restored for p in parts),
    )


def deferred_rows(plan: DeferralPlan, count: int) -> Rows:
    """The next `count` deferred tokens of `plan`, in source order (does not mark them restored)."""
    start, stop = plan.restored, plan.restored + count
    device = plan.store_embeds.device
    slots = plan.deferred_on_device[start:stop]
    deepstack = None if plan.store_deepstack is None else [f[start:stop] for f in plan.store_deepstack]
    return Rows(
        slots=slots,
        embeds=plan.store_embeds[start:stop],
        positions=plan.store_positions[:, start:stop],
        deepstack=deepstack,
        deferred=torch.ones(count, dtype=torch.bool, device=device),
        max_slot=plan.deferred_at(stop - 1),
        restored=count,
    )


def gdn_step(cache: DeferredPrefillCache, rows: Rows, plan: DeferralPlan | None, gdn_backend: str) -> GDNStep:
    """How a GDN layer splits `rows` (docs/design.md rule 3); host-side bookkeeping only."""
    restoring = plan if (plan is not None and rows.restored) else None
    if restoring is not None and rows.checkpoint_plan is not None and restoring.pending != rows.restored:
        raise RuntimeError("a new plan's boundary can only follow the last deferred rows of the previous plan")
    pending = cache.plan  # the plan whose P_tail the live rows extend, if it is still pending after this forward
    if pending is not None and pending is restoring:
        still_pending = pending.pending - rows.restored > 0
    else:
        still_pending = pending is not None and pending.pending > 0
    track = rows.checkpoint_plan is not None or still_pending
    return GDNStep(
        restore_plan=id(restoring) if restoring is not None else None,
        num_restore=rows.restored if restoring is not None else 0,
        checkpoint_plan=id(rows.checkpoint_plan) if rows.checkpoint_plan is not None else None,
        checkpoint_at=rows.checkpoint_at,
        track=track,
        backend=gdn_backend,
    )


def count_restored(cache: DeferredPrefillCache, plan: DeferralPlan, count: int, keep_checkpoints: bool = False) -> None:
    """Counts `count` more of `plan`'s deferred tokens restored by the forward that just ran (inside its
    transaction); a plan with nothing left pending frees its store once the transaction commits
    (`release_finished_plan`)."""
    plan.restored = plan.restored + count
    if plan.pending == 0:
        release_finished_plan(cache, plan, keep_checkpoints)


def release_finished_plan(cache: DeferredPrefillCache, plan: DeferralPlan, keep_checkpoints: bool = False) -> None:
    """Once the open transaction commits: frees the store of `plan` (all restored) and, unless a new plan's
    checkpoints were just taken (`keep_checkpoints`), the GDN prefix checkpoints."""
    cache.after_commit(plan.release_store)
    if not keep_checkpoints:
        cache.after_commit(cache.release_gdn_checkpoints)


def run_rows(
    adapter: ModelAdapter,
    cache: DeferredPrefillCache,
    rows: Rows,
    plan: DeferralPlan | None,
    backend: str,
    visibility: str,
    want_logits: bool,
) -> torch.Tensor | None:
    """One decoder forward over `rows`; returns the logits of the last row ``[1, 1, V]`` if asked.

    `plan` is the plan whose deferred rows lead `rows` (None when there are none). Call it inside a
    `DeferredPrefillCache.transaction` that also records what the caller keeps of the forward: the forward, the
    slots it marks filled and the plan's progress are part of it, so a forward that fails or is interrupted
    anywhere leaves nothing behind (its KV writes land in slots that stay unmarked and are rewritten by the retry;
    GDN states go back to where they were).
    """
    if not cache.in_transaction:
        raise RuntimeError("run_rows runs inside `with cache.transaction():` (the forward and its bookkeeping commit "
                           "together)")
    kv_len = max(cache.length, rows.max_slot + 1)
    device = rows.embeds.device
    cache.reserve(kv_len, device)
    width = cache.mask_width(kv_len)
    has_deferred = plan is not None and rows.restored > 0
    old = cache.length
    if not has_deferred and cache.holes == 0 and rows.slots.numel() and rows.max_slot >= old:
        # every cached entry is present and every row is a live row after it: each row sees exactly the cached
        # entries and the rows before it, i.e. bottom-right causal attention over [cache | rows]. The keys are the
        # buffers' prefix when the rows fill slots contiguously, else the cache prefix with the rows' own keys.
        contiguous = rows.max_slot - old + 1 == rows.size
        compact_keys = -old - 1 if contiguous else old
        mask = CAUSAL_LOWER_RIGHT
    else:
        compact_keys = None
        mask = visibility_mask(
            cache.filled_prefix(width),
            rows.slots,
            rows.deferred if has_deferred else None,
            plan.boundary if has_deferred else 0,
            plan.deferred_slot_mask if has_deferred else None,
            visibility,
            width,
        )
        if backend == "flash":  # the keys' gather order per row block (attention/flash.py)
            mask = flash_mask(mask, cache.filled_prefix(width), rows.slots, rows.restored if has_deferred else 0, None,
                              plan.boundary if has_deferred else 0, visibility)
    context = ForwardContext(write_slots=rows.slots, kv_len=kv_len, compact_keys=compact_keys)
    if adapter.gdn_glue is not None:
        context.gdn_step = gdn_step(cache, rows, plan, resolve_gdn_backend(cache.config.gdn_backend, device))
    try:
        cache.begin_forward(context)
        with eager_sdpa_backends(device, rows.size):
            hidden = adapter.language_forward(
                rows.embeds[None],
                rows.positions[:, None, :],
                mask,
                cache,
                rows.deepstack,
                backend,
            )
    finally:
        cache.end_forward()
    cache.mark_filled(rows.slots)
    if plan is not None and rows.restored:
        count_restored(cache, plan, rows.restored, keep_checkpoints=rows.checkpoint_plan is not None)
    if not want_logits:
        return None
    return adapter.lm_head(hidden[:, -1:])
