"""Preparing one `generate` call: check the conversation against the cache, encode new media, build the plan."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import transformers_coupling as hf
from ..cache import DeferralPlan, DeferredPrefillCache, TurnRestore
from ..config import RaincheckConfig
from ..models import ModelAdapter
from ..pruning import SelectionContext, select_kept, selector_requirements
from ..pruning.query import question_positions
from ..pruning.vision import gather_extras
from .rows import Rows, concat_rows, deferred_rows
from .spans import Span, find_spans


@dataclass
class Turn:
    """State of one `generate` call on a `DeferredPrefillCache`, read by the patched forward."""

    config: RaincheckConfig
    prompt_ids: torch.Tensor  # [L] whole conversation as passed to generate
    new_ids: torch.Tensor  # [L - old] the tokens this call prefills
    prefill: Rows | None  # rows of the prefill forward (folded deferred rows, then I_0)
    prefill_plan: DeferralPlan | None  # plan whose deferred rows are folded into the prefill
    plan: DeferralPlan | None  # this call's new plan (None when the prompt has no new media)
    positions: torch.Tensor  # [3, L] logical positions of the conversation
    rope_delta: int
    schedule: object
    backend: str
    step: int = 0  # decode steps run so far
    prefill_done: bool = False
    restored_in_prefill: int = 0
    record: TurnRestore | None = None  # this call's entry of cache.turn_stats, from its prefill on
    events: list = field(default_factory=list)
    static_step: object = None  # the compiled step (static caches), or None: eager steps
    rope_delta_tensor: torch.Tensor | None = None
    media_grids: dict = field(default_factory=dict)  # grids of the whole conversation's media, by modality


def _split_runs(runs: list[Span], counts: dict[str, list[int]]) -> list[Span]:
    """Splits runs of placeholders into one span per image / video frame using the processor's grids."""
    queues = {m: list(c) for m, c in counts.items()}
    spans: list[Span] = []
    for run in runs:
        start = run.start
        while start < run.stop:
            queue = queues[run.modality]
            if not queue:
                raise ValueError(
                    f"input_ids holds more {run.modality} placeholder tokens than "
                    f"{run.modality}_grid_thw describes; pass the processor outputs of the whole conversation"
                )
            size = queue.pop(0)
            if start + size > run.stop:
                raise ValueError(
                    f"a {run.modality} span at {run.start}..{run.stop} does not match {run.modality}_grid_thw; "
                    "pass the processor outputs of the whole conversation"
                )
            spans.append(Span(start, start + size, run.modality))
            start += size
    leftover = {m: len(q) for m, q in queues.items() if q}
    if leftover:
        raise ValueError(
            f"image_grid_thw / video_grid_thw describe more media than input_ids holds ({leftover} left over); "
            "pass input_ids and the processor outputs of the same whole conversation"
        )
    return spans


def _conversation_grids(adapter: ModelAdapter, cache: DeferredPrefillCache, ids: list[int], old: int, inputs: dict):
    """The grids of every image / video of the conversation, and whether the pixels cover it all or the new part.

    A later turn may pass the processor outputs of the whole conversation, or only of its new part (then the
    grids of the media already cached come from the cache).
    """
    grids, cover = {}, {}
    for modality, key, token in (
        ("image", "image_grid_thw", adapter.image_token_id),
        ("video", "video_grid_thw", adapter.video_token_id),
    ):
        given = inputs.get(key)
        cached = cache.media_grids.get(modality)
        total = sum(1 for t in ids if t == token)
        new = sum(1 for t in ids[old:] if t == token)
        counts = adapter.media_token_counts(
            given if modality == "image" else None, given if modality == "video" else None
        )
        given_tokens = sum(counts[0]) if modality == "image" else sum(sum(v) for v in counts[1])
        if given is not None and given_tokens == total:
            grids[modality], cover[modality] = given.cpu(), "conversation"
        elif given is not None and given_tokens == new and cached is not None:
            grids[modality], cover[modality] = torch.cat([cached, given.cpu()]), "new"
        elif given is None and total == 0:
            grids[modality], cover[modality] = None, "conversation"
        elif given is None and new == 0 and cached is not None:
            grids[modality], cover[modality] = cached, "conversation"
        else:
            raise ValueError(
                f"{key} describes {given_tokens if given is not None else 0} {modality} placeholder tokens but "
                f"input_ids holds {total} ({new} of them new); pass the processor outputs of the whole "
                "conversation, or of its new part only"
            )
    return grids["image"], grids["video"], cover


def prepare_turn(
    adapter: ModelAdapter,
    cache: DeferredPrefillCache,
    config: RaincheckConfig,
    input_ids: torch.Tensor,
    model_inputs: dict,
    schedule,
    backend: str,
    vision: dict | None = None,
) -> Turn:
    """The `Turn` of one call. `vision`: the vision tower's output for this call's new media, by modality, when
    the caller encoded them already (a batch's rows share one tower call: `shared_batch.encode_rows`)."""
    device = adapter.input_device
    ids = input_ids[0].tolist()
    old = cache.length
    cached = cache.token_ids
    if ids[:old] != cached:
        mismatch = next((i for i, (a, b) in enumerate(zip(ids, cached)) if a != b), min(len(ids), old))
        raise ValueError(
            f"{hf.CACHE_ARGUMENT} does not extend this conversation: the cache holds "
            f"{old} tokens and input_ids differs from them at index {mismatch} (input_ids has {len(ids)} tokens). "
            "Pass the whole conversation so far (e.g. the previous output's `sequences` plus the new turn), "
            f"or start a new conversation without {hf.CACHE_ARGUMENT}"
        )
    if len(ids) <= old:
        raise ValueError(
            f"input_ids ({len(ids)} tokens) holds nothing beyond the {old} tokens already in {hf.CACHE_ARGUMENT}"
        )
    attention_mask = model_inputs.get("attention_mask")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("attention_mask: a single row must not be padded (pass it unpadded; padding is for batches "
                         "of several rows, left-padded)")

    image_grid_thw, video_grid_thw, pixels_cover = _conversation_grids(adapter, cache, ids, old, model_inputs)
    media_grids = {m: g for m, g in (("image", image_grid_thw), ("video", video_grid_thw)) if g is not None}
    image_counts, video_frame_counts = adapter.media_token_counts(image_grid_thw, video_grid_thw)
    runs = find_spans(ids, adapter.image_token_id, adapter.video_token_id)
    spans = _split_runs(runs, {"image": image_counts, "video": [n for v in video_frame_counts for n in v]})
    for span in spans:
        if span.start < old < span.stop:
            raise ValueError(f"{hf.CACHE_ARGUMENT} ends inside an image or video span of input_ids")
    new_spans = [s for s in spans if s.start >= old]
    if ids[-1] in (adapter.image_token_id, adapter.video_token_id):
        raise ValueError(
            "the prompt ends with an image/video placeholder token; Raincheck needs the text after the last "
            "image (e.g. apply_chat_template(..., add_generation_prompt=True))"
        )

    # logical positions of the whole conversation, from the model's own M-RoPE code
    mm_token_type_ids = torch.zeros_like(input_ids, dtype=torch.int)
    mm_token_type_ids[input_ids == adapter.image_token_id] = 1
    mm_token_type_ids[input_ids == adapter.video_token_id] = 2
    given = model_inputs.get("mm_token_type_ids")
    if given is not None and not torch.equal(given.to(mm_token_type_ids), mm_token_type_ids):
        raise ValueError(
            "mm_token_type_ids does not match input_ids (1 at image placeholders, 2 at video placeholders, "
            "0 elsewhere); pass the processor's outputs for the same conversation"
        )
    positions, rope_delta = adapter.logical_positions(
        input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, None, model_inputs=model_inputs
    )
    positions = positions.to(device)

    new_ids_t = input_ids[0, old:].to(device)
    new_embeds = adapter.embed_tokens(new_ids_t[None])[0]
    deepstack_new = None

    # what the selector needs from the vision tower, asked for only when it will select something
    want = {}
    if any(config.kept_budget(s.size) < s.size for s in new_spans):
        want = selector_requirements(config.pruning, config.pruning_options, adapter.vision_depth)

    # vision tower, once, on the media that are new in this call
    placeholder_embeds = []
    for modality, grid, pixel_key, counts in (
        ("image", image_grid_thw, "pixel_values", image_counts),
        ("video", video_grid_thw, "pixel_values_videos", video_frame_counts),
    ):
        n_old = sum(1 for s in spans if s.modality == modality and s.start < old)
        if modality == "video":  # frames -> videos
            frames, n_old_frames = 0, n_old
            n_old = 0
            while frames < n_old_frames:
                frames += len(counts[n_old])
                n_old += 1
        n_total = len(counts)
        if n_total == n_old:
            continue
        pixels = model_inputs.get(pixel_key)
        if pixels is None:
            raise ValueError(f"input_ids holds new {modality} placeholders but `{pixel_key}` was not passed")
        if vision is not None and modality in vision:
            placeholder_embeds.append((modality, vision[modality]))
            continue
        patches = grid.prod(-1).tolist()
        first_row = sum(patches[:n_old]) if pixels_cover[modality] == "conversation" else 0
        feats = adapter.vision_features(modality, pixels[first_row:].to(device), grid[n_old:].to(device), want=want or None)
        placeholder_embeds.append((modality, feats))

    extras_parts = []
    if placeholder_embeds:
        new_embeds = new_embeds.clone()
        deepstack_layers = None
        for modality, feats in placeholder_embeds:
            token = adapter.image_token_id if modality == "image" else adapter.video_token_id
            where = (new_ids_t == token).nonzero().squeeze(1)
            if where.numel() != feats.embeds.shape[0]:
                raise ValueError(
                    f"{modality}: {where.numel()} new placeholder tokens but the vision tower returned "
                    f"{feats.embeds.shape[0]} features"
                )
            new_embeds[where] = feats.embeds.to(new_embeds.device, new_embeds.dtype)
            extras_parts.append((where, feats.extras))
            if feats.deepstack is not None:
                if deepstack_layers is None:
                    deepstack_layers = [
                        new_embeds.new_zeros(new_embeds.shape) for _ in range(len(feats.deepstack))
                    ]
                for layer, feat in zip(deepstack_layers, feats.deepstack):
                    layer[where] = feat.to(layer.device, layer.dtype)
        deepstack_new = deepstack_layers

    # the plan of this call's new spans
    plan = None
    deferred_local = torch.zeros(len(ids) - old, dtype=torch.bool)
    if new_spans:
        budgets = [config.kept_budget(s.size) for s in new_spans]
        if all(b == s.size for b, s in zip(budgets, new_spans)):
            kept = torch.cat([torch.arange(s.start, s.stop) for s in new_spans])
        else:
            special = {adapter.image_token_id, adapter.video_token_id, *adapter.special_token_ids()}
            where_query = question_positions(
                ids, old, [(s.start, s.stop) for s in new_spans], special, adapter.end_of_turn_token_ids()
            )
            query = torch.tensor([ids[i] for i in where_query], dtype=torch.long)
            span_rows = torch.cat([torch.arange(s.start - old, s.stop - old) for s in new_spans]).to(device)
            ctx = SelectionContext(
                input_ids=input_ids[0].cpu(),
                spans=[(s.start, s.stop) for s in new_spans],
                budgets=budgets,
                modalities=[s.modality for s in new_spans],
                grids=adapter.span_grids(new_spans, image_grid_thw, video_grid_thw, spans),
                embeddings=new_embeds[span_rows],
                query_ids=query,
                query_embeds=adapter.embed_tokens(query.to(device)[None])[0],
                options=dict(config.pruning_options),
                seed=config.seed,
                extras=gather_extras(extras_parts, len(ids) - old, span_rows, adapter.vision_depth) if want else {},
            )
            with torch.no_grad():
                kept = select_kept(config.pruning, ctx)
        all_placeholders = torch.cat([torch.arange(s.start, s.stop) for s in new_spans])
        is_kept = torch.zeros(len(ids), dtype=torch.bool)
        is_kept[kept] = True
        deferred = all_placeholders[~is_kept[all_placeholders]]
        boundary = new_spans[-1].stop
        plan = DeferralPlan(
            spans=[(s.start, s.stop) for s in new_spans],
            modalities=[s.modality for s in new_spans],
            budgets=budgets,
            boundary=boundary,
            kept=kept,
            deferred=deferred,
            policy=config.policy,
        )
        deferred_local[deferred - old] = True
        if deferred.numel() and config.policy == "raincheck":
            # the deferred slots, their rows in this call and the slot mask go to the device in one transfer (not
            # one per use: a batch prepares each row's turn, and every transfer is a host round trip)
            count = deferred.numel()
            slot_mask = torch.zeros(boundary, dtype=torch.long)
            slot_mask[deferred] = 1
            moved = torch.cat([deferred, deferred - old, slot_mask]).to(device, non_blocking=True)
            on_device, local = moved[:count], moved[count : 2 * count]
            # (a compiled static step widens the store to the cache's capacity after the prefill: `StaticStep.prepare`)
            plan.store_embeds = new_embeds[local]
            plan.store_deepstack = None if deepstack_new is None else [f[local] for f in deepstack_new]
            plan.store_positions = positions[:, on_device]
            plan.deferred_slot_mask = moved[2 * count :].bool()
            plan.deferred_on_device = on_device

    # rows of the prefill: the earlier plan's pending deferred tokens, then I_0 in source order
    live_local = (~deferred_local).nonzero().squeeze(1).to(device)
    live_slots = live_local + old
    checkpoint_plan = None
    if plan is not None and plan.policy == "raincheck" and plan.total_deferred and adapter.gdn_glue is not None:
        # GDN layers checkpoint their state at the boundary: after the live rows before it
        checkpoint_plan = plan
    live = Rows(
        checkpoint_plan=checkpoint_plan,
        checkpoint_at=(plan.boundary - old - plan.total_deferred) if checkpoint_plan is not None else 0,
        slots=live_slots,
        embeds=new_embeds[live_local],
        positions=positions[:, live_slots],
        deepstack=None if deepstack_new is None else [f[live_local] for f in deepstack_new],
        deferred=torch.zeros(live_local.numel(), dtype=torch.bool, device=device),
        max_slot=len(ids) - 1,
    )
    prefill_plan = cache.plan if cache.plan is not None and cache.plan.pending > 0 else None
    folded = deferred_rows(prefill_plan, prefill_plan.pending) if prefill_plan is not None else None
    prefill = concat_rows([folded, live]) if folded is not None else live
    return Turn(
        config=config,
        prompt_ids=input_ids[0],
        new_ids=new_ids_t,
        prefill=prefill,
        prefill_plan=prefill_plan,
        plan=plan,
        positions=positions,
        rope_delta=rope_delta,
        schedule=schedule,
        backend=backend,
        media_grids=media_grids,
    )
