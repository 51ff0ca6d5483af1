"""One decode step of a Raincheck `generate`: feed y_j, carrying the next deferred chunk after the guard.

Two ways to run it, with the same result:

* eager (`decode_step`): builds the step's rows and runs them through `run_rows`. No host-device
  synchronisation: slots and positions are views of persistent device tensors, the fed token stays on the device
  (`DeferredPrefillCache.append_fed_token`), and every count is host-side bookkeeping.
* compiled (`StaticStep`, with ``cache_implementation="static"``): one ``torch.compile``d function with fixed
  shapes, one graph for a plain decode step (1 row) and one for a fused step (``chunk_size + 1`` rows: the last
  chunk is padded with rows written to scratch slots past the conversation that no row ever sees). Mask, cache
  writes, DeepStack and the LM head are inside the graph; what changes from step to step is passed as tensors.
"""

from __future__ import annotations

import torch

from ..cache import DeferralPlan, DeferredPrefillCache
from ..gdn_state import GDNGraphStep
from ..gdn_state import resolve as resolve_gdn_backend
from .rows import Rows, concat_rows, deferred_rows, run_rows
from .schedule import carried_tokens
from .visibility import visible


def live_row(adapter, cache: DeferredPrefillCache, token: torch.Tensor) -> Rows:
    """The decode row of the fed token ``[1, 1]`` at the next slot (positions: slot + rope delta on all axes)."""
    slot = cache.length
    cache.reserve(slot + 1, token.device)
    slot_t = cache.slot_tensor(slot)
    return Rows(
        slots=slot_t,
        embeds=adapter.embed_tokens(token)[0],
        positions=(slot_t + cache.rope_delta).expand(3, 1),
        deepstack=None,
        deferred=torch.zeros_like(slot_t, dtype=torch.bool),
        max_slot=slot,
    )


def decode_step(adapter, cache: DeferredPrefillCache, turn, token: torch.Tensor) -> torch.Tensor:
    """Eager decode step; returns the logits ``[1, 1, V]`` of the decode row."""
    config = turn.config
    turn.step += 1
    plan = cache.plan
    count = carried_tokens(turn.schedule, turn.step, plan.pending if plan is not None else 0)
    if turn.static_step is not None and count <= config.chunk_size:
        logits = turn.static_step(cache, turn, plan, count, token)
    else:
        live = live_row(adapter, cache, token)
        if count and not config.fused:  # the benchmarks' control: the chunk as a forward of its own, then the step
            run_rows(adapter, cache, deferred_rows(plan, count), plan, turn.backend, config.visibility, False)
            logits = run_rows(adapter, cache, live, None, turn.backend, config.visibility, True)
        else:
            rows = concat_rows([deferred_rows(plan, count), live]) if count else live
            logits = run_rows(adapter, cache, rows, plan if count else None, turn.backend, config.visibility, True)
    cache.record_restored("during_decode", count)
    cache.append_fed_token(token)
    return logits


# ---------------------------------------------------------------------------------------------------- compiled
def _step_graph(adapter, cache, token, slot, rope_delta, chunk, backend: str, visibility: str):
    """The traced body of a static step. `chunk` is None (a plain decode step) or a tuple of tensors:
    ``(embeds [c, H], positions [3, c], slots [c], valid [c], deepstack [c, H] per layer or None, boundary 0-d,
    deferred_slots [width])`` where rows past the chunk's real tokens are padding (``valid`` False)."""
    width = cache.layers[0].capacity
    filled = cache._filled[:width]
    live_embeds = adapter.embed_tokens(token)  # [1, 1, H]
    live_positions = (slot + rope_delta).view(1, 1, 1).expand(3, 1, 1)
    if chunk is None:
        embeds, positions, slots, deepstack, flags = live_embeds, live_positions, slot, None, None
        valid = torch.ones_like(slot, dtype=torch.bool)
        boundary, deferred_slots = 0, None
    else:
        d_embeds, d_positions, d_slots, d_valid, d_deepstack, boundary, deferred_slots = chunk
        slots = torch.cat([torch.where(d_valid, d_slots, cache._scratch_slots), slot])
        embeds = torch.cat([d_embeds[None].to(live_embeds.dtype), live_embeds], dim=1)
        positions = torch.cat([d_positions[:, None, :], live_positions], dim=2)
        deepstack = None
        if d_deepstack is not None:
            deepstack = [torch.cat([f, f.new_zeros(1, f.shape[-1])]) for f in d_deepstack]
        flags = torch.cat([d_valid, torch.zeros_like(d_valid[:1])])
        valid = torch.cat([d_valid, torch.ones_like(d_valid[:1])])
    present = filled.clone().index_fill_(0, slots, True)
    mask = visible(present, slots, flags, boundary, deferred_slots, visibility)[None, None]
    cache._write_slots = slots
    hidden = adapter.language_forward(embeds, positions, mask, cache, deepstack, backend)
    filled[slots] = filled[slots] | valid
    return adapter.lm_head(hidden[:, -1:])


class StaticStep:
    """Compiled decode / fused steps on a static `DeferredPrefillCache` (see the module docstring).

    Built once per model and compile config (`compile_options`: ``torch.compile`` keyword arguments, from
    transformers' ``CompileConfig``). Per turn, `prepare` pads the pending plan's deferred store by one chunk so
    every fused step reads fixed-size views.
    """

    def __init__(self, adapter, compile_options: dict):
        self.adapter = adapter
        self.compiled = torch.compile(_step_graph, **compile_options)

    @staticmethod
    def prepare(cache: DeferredPrefillCache, plan: DeferralPlan | None, chunk_size: int) -> None:
        """Scratch slots past the conversation, and the plan's store padded by `chunk_size` rows (once per plan)."""
        width = cache.layers[0].capacity
        device = cache._filled.device
        cache._scratch_slots = torch.arange(width - chunk_size, width, device=device)
        if plan is None or plan.pending == 0:
            return
        padded = plan.padded_store
        if padded is not None and padded["chunk"] == chunk_size and padded["width"] == width:
            return
        total = plan.total_deferred

        def pad(t, dim):
            shape = list(t.shape)
            shape[dim] = chunk_size
            return torch.cat([t, t.new_zeros(shape)], dim=dim)

        valid = torch.zeros(total + chunk_size, dtype=torch.bool, device=device)
        valid[:total] = True
        deferred_slots = torch.zeros(width, dtype=torch.bool, device=device)
        deferred_slots[: plan.boundary] = plan.deferred_slot_mask[: plan.boundary]
        plan.padded_store = dict(
            chunk=chunk_size,
            width=width,
            embeds=pad(plan.store_embeds, 0),
            positions=pad(plan.store_positions, 1),
            slots=pad(plan.deferred_on_device, 0),
            valid=valid,
            deepstack=None if plan.store_deepstack is None else [pad(f, 0) for f in plan.store_deepstack],
            boundary=torch.full((), plan.boundary, dtype=torch.long, device=device),
            deferred_slots=deferred_slots,
        )

    def __call__(self, cache: DeferredPrefillCache, turn, plan: DeferralPlan | None, count: int, token) -> torch.Tensor:
        slot = cache.length
        if slot >= cache.layers[0].capacity - turn.config.chunk_size:
            raise RuntimeError("static Raincheck cache is full: reserve more max_new_tokens")
        rope_delta = turn.rope_delta_tensor
        chunk = None
        if count:
            self.prepare(cache, plan, turn.config.chunk_size)  # done after the prefill already; a no-op here
            store = plan.padded_store
            window = slice(plan.restored, plan.restored + turn.config.chunk_size)
            valid = store["valid"][window]
            if count < min(turn.config.chunk_size, plan.pending):  # a custom schedule carrying a partial chunk
                valid = valid & (torch.arange(valid.shape[0], device=valid.device) < count)
            chunk = (
                store["embeds"][window],
                store["positions"][:, window],
                store["slots"][window],
                valid,
                None if store["deepstack"] is None else [f[window] for f in store["deepstack"]],
                store["boundary"],
                store["deferred_slots"],
            )
        if self.adapter.gdn_glue is not None:  # GDN layers read how the rows split (tensors only)
            cache._gdn_step = GDNGraphStep(
                valid=chunk[3] if count else None,
                count=cache._slot_index[count] if count else None,
                backend=resolve_gdn_backend(turn.config.gdn_backend, token.device),
            )
        try:
            logits = self.compiled(
                self.adapter, cache, token, cache.slot_tensor(slot), rope_delta, chunk, turn.backend,
                turn.config.visibility,
            )
        finally:
            cache._gdn_step = None
        if count:
            plan.restored += count
            if plan.pending == 0:
                plan.release_store()
                cache.release_gdn_checkpoints()
        return logits
