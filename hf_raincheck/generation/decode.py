"""One decode step of a Raincheck `generate`: feed y_j, carrying the next deferred chunk after the guard.

Two ways to run it, with the same result:

* eager (`decode_step`): builds the step's rows and runs them through `run_rows`. No host-device
  synchronisation: slots and positions are views of persistent device tensors, the fed token stays on the device
  (`DeferredPrefillCache.append_fed_token`), and every count is host-side bookkeeping.
* compiled (`StaticStep`, with ``cache_implementation="static"``): one ``torch.compile``d function with fixed
  shapes, one graph for a plain decode step (1 row) and one for a fused step (``chunk_size + 1`` rows: the last
  chunk is padded with rows written to scratch slots past the conversation that no row ever sees). Mask, cache
  writes, DeepStack, the chunk's gather from the deferred store and the LM head are inside the graph; what
  changes from step to step is passed as tensors: the fed token and 0-d views of a persistent index (the slot, the
  window's start and length), while the store, the scratch slots and the cache are static addresses that CUDA
  graphs read in place.
"""

from __future__ import annotations

import weakref

import torch

from ..attention.flash import flash_mask
from ..cache import DeferralPlan, DeferredPrefillCache, ForwardContext
from ..gdn_state import GDNGraphStep
from ..gdn_state import resolve as resolve_gdn_backend
from ..gdn_state.kernels import functions as gdn_functions
from .rows import Rows, concat_rows, count_restored, deferred_rows, run_rows
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
    """One decode step (compiled when `turn` has a static step and the chunk fits it, else eager); returns the
    logits ``[1, 1, V]`` of the decode row.

    The step's forwards, the deferred tokens it restores, its counters and the fed token are one
    `DeferredPrefillCache.transaction`: interrupted anywhere, the cache is as before the step (the token is not
    fed, nothing restored), so continuing with ``cache.token_ids`` feeds it again.
    """
    config = turn.config
    turn.step += 1
    plan = cache.plan
    count = carried_tokens(turn.schedule, turn.step, plan.pending if plan is not None else 0)
    with cache.transaction():
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
            if turn.static_step is not None:  # an eager step between compiled ones (a chunk larger than chunk_size)
                cache.after_commit(cache.persist_gdn_states)
        cache.record_restored("during_decode", count)
        cache.append_fed_token(token)
    return logits


# ---------------------------------------------------------------------------------------------------- compiled
class CompiledByStepKind:
    """One traced step body compiled as two functions: `decode` for decode-only steps (no chunk), `fused` for steps
    that carry deferred rows. Each has its own code object, so its own dynamo cache: a step checks the guards of
    its own kind's graphs only. With one compiled function for both kinds, every decode-only step after the first
    fused step checked the fused graph's guards first (dynamo tries the newest entry first) and failed them before
    it found its own: host time on every step of the answer that Full's steps never pay."""

    def __init__(self, decode, fused, compile_options: dict, chunk_arg: int):
        self.decode = torch.compile(decode, **compile_options)
        self.fused = torch.compile(fused, **compile_options)
        self.chunk_arg = chunk_arg  # the position of the body's `chunk` argument (None: a decode-only step)

    def __call__(self, *args):
        return (self.decode if args[self.chunk_arg] is None else self.fused)(*args)


def _decode_step_graph(*args):
    """`_step_graph` for decode-only steps (`CompiledByStepKind`: a code object of its own)."""
    return _step_graph(*args)


def _fused_step_graph(*args):
    """`_step_graph` for steps that carry a chunk (`CompiledByStepKind`: a code object of its own)."""
    return _step_graph(*args)


def _step_graph(adapter, cache, token, slot, rope_delta, chunk, backend: str, visibility: str, chunk_size: int):
    """The traced body of a static step. `chunk` is None (a plain decode step) or a tuple of tensors: the plan's
    whole padded store ``(embeds [W, H], positions [3, W], slots [W], valid [W], deepstack [W, H] per layer or None,
    boundary 0-d, deferred_slots [W])`` (static addresses: CUDA graphs read them in place) and two 0-d long tensors
    ``start`` (the window's first store row) and ``limit`` (how many of its `chunk_size` rows are carried); rows
    past them are padding (``valid`` False), written to scratch slots. `token` None: the chunk alone (the unfused
    control), no logits."""
    width = cache.layers[0].capacity
    filled = cache.filled_prefix(width)
    context = cache.forward_context  # installed by `StaticStep._run`; the slots are computed here
    parts = []  # (embeds [1, r, H], positions [3, 1, r], slots [r], deferred flags [r], valid [r], deepstack)
    d_valid = None
    if chunk is not None:
        s_embeds, s_positions, s_slots, s_valid, s_deepstack, boundary, deferred_slots, start, limit = chunk
        rows = torch.arange(chunk_size, device=s_slots.device)
        window = start + rows  # the window is gathered here, so no per-step view is a graph input
        d_valid = s_valid.index_select(0, window) & (rows < limit)
        d_slots = torch.where(d_valid, s_slots.index_select(0, window), cache.scratch_slots)
        d_deepstack = None if s_deepstack is None else [f.index_select(0, window) for f in s_deepstack]
        parts.append((s_embeds.index_select(0, window)[None], s_positions.index_select(1, window)[:, None, :],
                      d_slots, d_valid, d_valid, d_deepstack))
        if context.gdn_step is not None:  # GDN layers read which chunk rows are real
            context.gdn_step.valid = d_valid
    else:
        boundary, deferred_slots = 0, None
    if token is not None:
        live_embeds = adapter.embed_tokens(token)  # [1, 1, H]
        live_positions = (slot + rope_delta).view(1, 1, 1).expand(3, 1, 1)
        live_deepstack = None
        if chunk is not None and chunk[4] is not None:
            live_deepstack = [f.new_zeros(1, f.shape[-1]) for f in chunk[4]]
        no = torch.zeros_like(slot, dtype=torch.bool)
        parts.append((live_embeds, live_positions, slot, no, ~no, live_deepstack))
    dtype = parts[-1][0].dtype if token is not None else parts[0][0].dtype
    embeds = torch.cat([p[0].to(dtype) for p in parts], dim=1)
    positions = torch.cat([p[1] for p in parts], dim=2)
    slots = torch.cat([p[2] for p in parts])
    flags = torch.cat([p[3] for p in parts]) if chunk is not None else None
    valid = torch.cat([p[4] for p in parts])
    deepstack = None
    if parts[0][5] is not None:
        deepstack = [torch.cat([p[5][k] for p in parts]) for k in range(len(parts[0][5]))]
    present = filled.clone().index_fill_(0, slots, True)
    mask = visible(present, slots, flags, boundary, deferred_slots, visibility)[None, None]
    if backend == "flash":  # the keys' gather order per row block (attention/flash.py)
        mask = flash_mask(mask, filled, slots, 0 if chunk is None else chunk_size, d_valid, boundary, visibility)
    context.write_slots = slots
    hidden = adapter.language_forward(embeds, positions, mask, cache, deepstack, backend)
    filled[slots] = filled[slots] | valid
    if token is None:
        return None
    return adapter.lm_head(hidden[:, -1:])


def compiled_gdn_backend(name: str, device: torch.device) -> str:
    """GDN kernels inside a compiled step, resolved as everywhere else (``"auto"``: fla on CUDA when fla-core
    imports, else torch). The kernels are one opaque ``hf_raincheck::gated_delta`` node in the graph
    (`gdn_state.ops`), not traced into: traced, transformers' torch loops were unrolled per layer and fla's Triton
    kernels did not finish compiling. The CPU tests prove the graph (dynamo, fullgraph, torch kernels); on a GPU,
    fla inside compiled steps (Inductor, CUDA graphs) equals eager steps
    (`tests/test_steps_gpu.py::test_compiled_static_steps_equal_eager_on_cuda[qwen3_5]`) and makes Qwen3.5's decode
    steps several times faster than eager ones (the benchmarks page has the numbers)."""
    return resolve_gdn_backend(name, device)


class StaticStep:
    """Compiled decode / fused steps on a static `DeferredPrefillCache` (see the module docstring).

    Built once per model and compile config (`compile_options`: ``torch.compile`` keyword arguments, from
    transformers' ``CompileConfig``). Per plan, `prepare` copies the deferred store into the cache's persistent
    store buffers, so every fused step passes the same tensors and gathers its window inside the graph.
    """

    def __init__(self, adapter, compile_options: dict):
        self.adapter = adapter
        self.options = dict(compile_options)  # (a static batch's steps compile with the same options)
        self.compiled = CompiledByStepKind(_decode_step_graph, _fused_step_graph, compile_options, chunk_arg=5)

    @staticmethod
    def prepare(cache: DeferredPrefillCache, plan: DeferralPlan | None, chunk_size: int) -> None:
        """Scratch slots past the conversation (when the capacity changed), and (once per plan and capacity) the
        plan's store copied into the cache's persistent store buffers, ``W`` (the capacity) rows long, zeros past
        the plan's rows. Compiled steps read the whole buffers and gather their window inside the graph from two
        0-d indices, so the buffers are the same static-address inputs at every step and every turn of a
        conversation (CUDA graphs read them in place: no per-step copy of a window, no re-recording per plan);
        they change only with the capacity, which recompiles anyway."""
        width = cache.layers[0].capacity
        cache.place_scratch_slots(chunk_size)
        if plan is None or plan.pending == 0:
            return
        padded = plan.padded_store
        if padded is not None and padded["width"] == width:
            return
        total = plan.total_deferred
        if total + chunk_size > width:
            raise RuntimeError(f"static Raincheck cache of capacity {width} cannot hold {total} deferred tokens "
                               f"and a chunk of {chunk_size} scratch rows")
        owner = cache.store_buffers["plan"]() if cache.store_buffers is not None else None
        if owner is not None and owner is not plan and owner.pending:
            raise RuntimeError("the deferred store buffers still hold another plan's pending tokens")
        buffers = _store_buffers(cache, plan, width)
        n = plan.restored
        for name, source, dim in (("embeds", plan.store_embeds, 0), ("positions", plan.store_positions, 1),
                                  ("slots", plan.deferred_on_device, 0)):
            target = buffers[name]
            if source is not target:
                target.narrow(dim, n, total - n).copy_(source.narrow(dim, n, total - n))
                target.narrow(dim, total, width - total).zero_()
        if plan.store_deepstack is not None:
            for target, source in zip(buffers["deepstack"], plan.store_deepstack):
                if source is not target:
                    target[n:total].copy_(source[n:total])
                    target[total:].zero_()
        buffers["valid"].zero_()[:total] = True
        buffers["deferred_slots"].zero_()[: plan.boundary] = plan.deferred_slot_mask[: plan.boundary]
        buffers["boundary"].fill_(plan.boundary)
        buffers["plan"] = weakref.ref(plan)
        plan.store_embeds, plan.store_positions = buffers["embeds"], buffers["positions"]
        plan.deferred_on_device = buffers["slots"]
        if plan.store_deepstack is not None:
            plan.store_deepstack = list(buffers["deepstack"])
        plan.padded_store = dict(width=width, tensors=(
            buffers["embeds"], buffers["positions"], buffers["slots"], buffers["valid"],
            None if plan.store_deepstack is None else list(buffers["deepstack"]),
            buffers["boundary"], buffers["deferred_slots"],
        ))

    def _run(self, cache, turn, count: int, token, slot: int, chunk):
        # the write slots are computed inside the graph (`_step_graph` sets them); static layers return their
        # whole buffers, so `kv_len` is the capacity
        context = ForwardContext(write_slots=None, kv_len=cache.layers[0].capacity)
        if self.adapter.gdn_glue is not None:  # GDN layers read how the rows split (tensors only)
            backend = compiled_gdn_backend(turn.config.gdn_backend, cache.device)
            gdn_functions(backend)  # imported here, outside the trace (torch 2.11's dynamo breaks the graph on it)
            # `valid` is set inside the graph, from the gathered window
            # a fused step leaves its windows' joins pending (`gdn_state.ops.lazy_window_`): `begin_forward` folds
            # them in before any other forward, `end_turn` when the call ends
            lazy = chunk is not None and token is not None
            context.gdn_step = GDNGraphStep(
                valid=None, count=chunk[-1] if chunk is not None else None, live=token is not None, backend=backend,
                lazy=lazy,
            )
            if lazy:
                cache.pending_gdn_buffers()
        cache.in_place_update("a compiled static step")  # (GDN states: updated in place, no rollback)
        try:
            cache.begin_forward(context)
            return self.compiled(
                self.adapter, cache, token, cache.slot_tensor(slot), turn.rope_delta_tensor, chunk, turn.backend,
                turn.config.visibility, turn.config.chunk_size,
            )
        finally:
            cache.end_forward()

    def __call__(self, cache: DeferredPrefillCache, turn, plan: DeferralPlan | None, count: int, token) -> torch.Tensor:
        slot = cache.length
        if slot >= cache.layers[0].capacity - turn.config.chunk_size:
            raise RuntimeError("static Raincheck cache is full: reserve more max_new_tokens")
        chunk = None
        if count:
            self.prepare(cache, plan, turn.config.chunk_size)  # done after the prefill already; a no-op here
            # the window as two 0-d views of a persistent index (no host-to-device copy, no new graph input shape)
            chunk = plan.padded_store["tensors"] + (cache.slot_index[plan.restored], cache.slot_index[count])
        if not cache.in_transaction:
            raise RuntimeError("a compiled step runs inside `with cache.transaction():` (see decode_step)")
        if count:  # the graph marks the chunk's slots and the decode row's: a rollback unmarks them
            cache.marks_filled(plan.deferred_on_device[plan.restored : plan.restored + count])
        cache.marks_filled(cache.slot_tensor(slot))
        if count and not turn.config.fused:  # the control: the chunk as a compiled forward of its own, then the step
            self._run(cache, turn, count, None, slot, chunk)
            chunk = None
        logits = self._run(cache, turn, count if chunk is not None else 0, token, slot, chunk)
        if count:
            count_restored(cache, plan, count)
        return logits


def _store_buffers(cache: DeferredPrefillCache, plan: DeferralPlan, width: int) -> dict:
    """The cache's persistent deferred-store buffers for `plan`'s shapes at capacity `width` (taken when there
    are none yet, or when the capacity, hidden size, dtype or DeepStack depth changed): pooled static addresses
    (`hf_raincheck.cache.buffer_pool`), so a new conversation's store reuses a finished one's addresses too."""
    embeds, positions, deepstack = plan.store_embeds, plan.store_positions, plan.store_deepstack
    layers = None if deepstack is None else len(deepstack)
    key = (width, embeds.shape[-1], embeds.dtype, embeds.device, layers,
           None if deepstack is None else deepstack[0].dtype)
    buffers = cache.store_buffers
    if buffers is not None and buffers["key"] == key:
        return buffers
    device = embeds.device
    zeros = cache.pooled_zeros
    cache.store_buffers = buffers = dict(
        key=key,
        plan=lambda: None,
        embeds=zeros("store.embeds", (width, embeds.shape[-1]), embeds.dtype, device),
        positions=zeros("store.positions", (positions.shape[0], width), positions.dtype, device),
        slots=zeros("store.slots", (width,), plan.deferred_on_device.dtype, device),
        valid=zeros("store.valid", (width,), torch.bool, device),
        deepstack=None if layers is None else [
            zeros(f"store.deepstack{k}", (width, f.shape[-1]), f.dtype, device) for k, f in enumerate(deepstack)
        ],
        boundary=zeros("store.boundary", (), torch.long, device),
        deferred_slots=zeros("store.deferred_slots", (width,), torch.bool, device),
    )
    return buffers
