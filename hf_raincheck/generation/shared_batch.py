"""A batched Raincheck `generate` whose rows share every forward (prefill, fused decode steps, completion).

Each row is prepared as its batch-1 call would be (`prepare_turn` on its own row cache: spans, budgets, selection,
plan, boundary, pending set), then transformers' sampling loop runs the whole batch through the patched forward,
which runs each forward for all rows: the prefill (`run_shared_rows`, row b's prefill rows), then per decode step
row b's decode row after its own deferred chunk (its schedule's count; `carry_counts` shares
``step_deferred_budget`` over the rows): `run_shared_step`, or `run_shared_decode` when no row carries a chunk. A row that stopped is
fed nothing more (transformers feeds it padding: `row_stops`), but keeps restoring its deferred tokens in the
shared steps while the others decode, unless its completion is ``"next_turn"``; what is still pending when the
batch ends is completed per row as the config says (``"blocking"``: in shared forwards of
``completion_chunk_size`` rows per row). Every forward and its bookkeeping are one transaction per row cache.
A static batch (``cache_implementation="static"``) runs its decode steps compiled (`shared_static`) whenever every
row's carry fits ``chunk_size``; the other steps run the eager shared steps on the same buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache import DeferredPrefillCache, TurnRestore
from ..cache.batched import BatchedDeferredPrefillCache
from ..pruning import selector_requirements
from .background import start_background_completion
from .completion import complete_shared
from .row_stops import RowStopsSlot
from .schedule import FixedChunkSchedule, carried_tokens
from .shared_rows import row_transactions, run_shared_decode, run_shared_rows
from .shared_step import StepMasks, run_shared_step
from .turn import Turn, prepare_turn


@dataclass
class BatchTurn:
    """The running batched call: one `Turn` per row (`BatchedDeferredPrefillCache.active_turn`)."""

    turns: list[Turn]
    config: object
    backend: str
    stops: RowStopsSlot
    prefill_done: bool = False
    masks: StepMasks = field(default_factory=StepMasks)  # the rows' boundaries and deferred-slot masks
    static_step: object = None  # a static batch's compiled steps (`shared_static.StaticBatchStep`), or None
    step_budget: int | None = None  # ``step_deferred_budget`` for this model (`RaincheckConfig.step_budget`)
    _rope_deltas: torch.Tensor | None = None

    @property
    def row_rope_deltas(self) -> list[int]:
        """Each row's rope delta: its decode positions are slot + delta."""
        return [t.rope_delta for t in self.turns]

    def rope_deltas(self, device) -> torch.Tensor:
        """`row_rope_deltas` as a ``[B]`` long tensor on `device`, made once."""
        if self._rope_deltas is None:
            self._rope_deltas = torch.tensor(self.row_rope_deltas, dtype=torch.long, device=device)
        return self._rope_deltas


def row_carry_cap(budget: int | None, rows: int) -> int | None:
    """The most deferred tokens one row carries in a shared step of a batch of `rows` rows: ``ceil(budget / rows)``
    (None: no budget, no cap). A fused step's rows are padded to its widest row (``[B, widest + 1]``, eager and
    compiled alike), so this cap bounds a step's work by the budget: at B = 16, budget 128 and chunk 31, a step is
    ``[16, 9]`` (144 rows) instead of ``[16, 32]`` (512 rows, 368 of them padding)."""
    return None if budget is None else -(-budget // rows)


def fused_window(chunk_size: int, budget: int | None, rows: int) -> int:
    """Deferred rows per batch row in a compiled batch's fused step (`shared_static`): ``chunk_size``, or the row
    cap when the budget makes it smaller (fixed per batch size, so one graph per batch size)."""
    cap = row_carry_cap(budget, rows)
    return chunk_size if cap is None else min(chunk_size, cap)


def carry_counts(wanted: list[int], budget: int | None) -> list[int]:
    """Each row's deferred tokens for one shared step: what its schedule asks (`wanted`), at most
    `row_carry_cap` (``ceil(budget / B)``) per row, cut to `budget` in all by water-filling (the smallest asks are
    met first, the rest is split evenly, the earlier rows get the remainder)."""
    if budget is None:
        return list(wanted)
    cap = row_carry_cap(budget, len(wanted))
    wanted = [min(w, cap) for w in wanted]
    if sum(wanted) <= budget:
        return wanted
    counts = [0] * len(wanted)
    left = budget
    order = sorted((w, i) for i, w in enumerate(wanted) if w > 0)
    while order and left > 0:
        share = left // len(order)
        if share == 0:  # fewer tokens than rows: one each, earliest rows first
            for _, i in sorted(order, key=lambda t: t[1])[:left]:
                counts[i] += 1
            break
        w, i = order[0]
        if w - counts[i] <= share:
            left -= w - counts[i]
            counts[i] = w
            order.pop(0)
            continue
        for _, j in order:
            counts[j] += share
        left -= share * len(order)
        # rows still short keep asking for the rest
        order = [(w, j) for w, j in order if counts[j] < w]
    return counts


_MEDIA = (("image", "image_grid_thw", "pixel_values"), ("video", "video_grid_thw", "pixel_values_videos"))


def encode_rows(adapter, config, caches: list[DeferredPrefillCache], row_inputs: list[dict]) -> list[dict] | None:
    """Every row's new images (and videos) through the vision tower in one call per modality, as transformers'
    batched generate does, split back into rows: ``[{modality: VisionFeatures}]``, or None when a row continues a
    conversation (its new media are then found by its own `prepare_turn`). The tower treats every image alone
    (its attention stays within one image), so each row gets what its own call would give, up to float rounding."""
    if any(c.length for c in caches):
        return None
    want = {}
    if config.policy != "full" and config.retention < 1.0:
        want = selector_requirements(config.pruning, config.pruning_options, adapter.vision_depth)
    out = [dict() for _ in row_inputs]
    device = adapter.input_device
    for modality, grid_key, pixel_key in _MEDIA:
        rows = [i for i, r in enumerate(row_inputs) if r.get(grid_key) is not None and r.get(pixel_key) is not None]
        if not rows:
            continue
        grids = [row_inputs[i][grid_key] for i in rows]
        counts = []
        for grid in grids:
            image_counts, video_counts = adapter.media_token_counts(
                grid if modality == "image" else None, grid if modality == "video" else None)
            counts.append(sum(image_counts) if modality == "image" else sum(sum(v) for v in video_counts))
        pixels = torch.cat([row_inputs[i][pixel_key] for i in rows]).to(device)
        feats = adapter.vision_features(modality, pixels, torch.cat(grids).to(device), want=want or None)
        for i, part in zip(rows, feats.split(counts)):
            out[i][modality] = part
    return out


def prepare_batch_turn(adapter, group: BatchedDeferredPrefillCache, config, row_inputs: list[dict], backend: str,
                       stops: RowStopsSlot) -> BatchTurn:
    """Every row's `Turn` (row b: ``row_inputs[b]``, its unpadded ``input_ids [1, L_b]`` and its own media)."""
    turns = []
    vision = encode_rows(adapter, config, group.rows, row_inputs)
    for b, (cache, inputs) in enumerate(zip(group.rows, row_inputs)):
        schedule = config.schedule or FixedChunkSchedule(config.chunk_size, config.guard_tokens)
        turns.append(prepare_turn(adapter, cache, config, inputs["input_ids"], inputs, schedule, backend,
                                  vision=None if vision is None else vision[b]))
    return BatchTurn(turns=turns, config=config, backend=backend, stops=stops,
                     step_budget=config.step_budget(adapter.gdn_glue is not None))


@torch.no_grad()
def shared_step(adapter, group: BatchedDeferredPrefillCache, bturn: BatchTurn, input_ids: torch.Tensor):
    """The patched forward of a batched call: the shared prefill, then one shared decode step per call; returns
    logits ``[B, 1, V]``."""
    config = bturn.config
    caches = group.rows
    if not bturn.prefill_done:
        records = [TurnRestore(deferred=t.plan.total_deferred if t.plan is not None else 0) for t in bturn.turns]
        with row_transactions(caches):
            logits = run_shared_rows(adapter, group, [(t.prefill, t.prefill_plan) for t in bturn.turns],
                                     bturn.backend, config.visibility, want_logits=True)
            for cache, turn, record in zip(caches, bturn.turns, records):
                cache.commit_prefill(turn.prompt_ids.tolist(), turn.plan, turn.rope_delta, turn.media_grids, record,
                                     turn.prefill.restored)
        for turn, record in zip(bturn.turns, records):
            turn.record, turn.restored_in_prefill, turn.prefill_done = record, turn.prefill.restored, True
            turn.prefill = None
        bturn.prefill_done = True
        # (a static batch copies its rows' pending stores into its padded buffers at its first compiled fused
        # step, `StaticBatchStep.__call__`: not here, so a call that ends after its first token, or before any
        # row carries, copies nothing)
        return logits

    stopped = bturn.stops.finished_rows(len(caches))
    wanted = []
    for cache, turn, done in zip(caches, bturn.turns, stopped):
        turn.step += 1
        plan = cache.plan
        pending = plan.pending if plan is not None else 0
        if done and config.completion == "next_turn":
            wanted.append(0)  # folded into the row's next turn, as the user asked
        else:
            wanted.append(carried_tokens(turn.schedule, turn.step, pending))
    counts = carry_counts(wanted, bturn.step_budget)
    tokens = input_ids[:, -1:].to(bturn.turns[0].positions.device)
    live = [not done for done in stopped]
    with row_transactions(caches):
        window = fused_window(config.chunk_size, bturn.step_budget, len(caches))
        if bturn.static_step is not None and max(counts) <= window:  # compiled (`shared_static`)
            logits = bturn.static_step(adapter, group, bturn, tokens, live, counts)
        elif not any(counts):  # the common step: every row feeds its token, or nothing (stopped)
            embeds = adapter.embed_tokens(tokens)  # [B, 1, H]
            logits = run_shared_decode(adapter, group, embeds, live, bturn.rope_deltas(embeds.device), bturn.backend)
        else:
            embeds = adapter.embed_tokens(tokens)
            logits = run_shared_step(adapter, group, embeds, live, counts, bturn.row_rope_deltas, bturn.masks,
                                     bturn.backend, config.visibility)
        for b, (cache, count, alive) in enumerate(zip(caches, counts, live)):
            if alive:
                cache.record_restored("during_decode", count)
                cache.append_fed_token(tokens[b : b + 1])
            else:
                cache.record_restored("after_answer", count)
    return logits


def finish_batch(model, adapter, group: BatchedDeferredPrefillCache, config, backend: str) -> None:
    """What each row's completion mode does once the batch's answers ended."""
    if config.completion == "blocking":
        complete_shared(adapter, group, config, backend)
    elif config.completion == "background":
        for cache in group.rows:
            start_background_completion(model, cache)
