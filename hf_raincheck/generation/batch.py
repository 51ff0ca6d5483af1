"""Batched ``generate(raincheck_config=...)`` (B > 1 rows, left-padded): every row is its own conversation.

The batch is split into its rows, padding removed (each row's tokens, ``mm_token_type_ids``, and the pixels and
grids of its own images / videos, of the whole conversation or only its new part), expanded for
``num_return_sequences``. Then either:

* shared forwards (`shared_batch`, the default): each row prepared as its batch-1 call would be, and every forward
  (prefill, fused decode steps, blocking completion) run once for all rows (`shared_rows`);
* one row after the other through the batch-1 path (``attn_backend="flash"``), assembled as transformers' batched
  ``generate`` lays out its outputs.

A static cache (``cache_implementation="static"``) runs the shared engine on a static batch cache
(`BatchedDeferredPrefillCache.reserve_static`: its capacity reserved once per call), its decode steps compiled
(`shared_static.StaticBatchStep`: one graph per batch size for decode-only steps, one for fused steps; Gated
DeltaNet layers with every row's states in batch buffers, `BatchedDeferredPrefillCache.sync_gdn_states`) where
transformers compiles a static cache's steps (accelerators, or a compile config that compiles everywhere).

The cache (given and returned; ``past_key_values``, ``cache`` from transformers 5.24) is a
`BatchedDeferredPrefillCache` of batch-1 row caches. What is not
supported raises a `ValueError` (`check_batch_supported`).
"""

from __future__ import annotations

import contextlib

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .. import transformers_coupling as hf
from ..cache import DeferredPrefillCache
from ..cache.batched import BatchedDeferredPrefillCache
from .row_stops import RowStopsSlot
from .shared_batch import finish_batch, prepare_batch_turn
from .shared_static import StaticBatchStep, scratch_rows
from .static_step import static_step

#: generate arguments that a batched Raincheck call refuses, and why
_UNSUPPORTED_ALWAYS = {
    "output_attentions": "output_attentions",
    "output_hidden_states": "output_hidden_states",
}
#: ... and those the rows-one-after-the-other path refuses besides (the shared steps give them per step)
_UNSUPPORTED_ONE_BY_ONE = {
    "streamer": "a streamer",
    "output_scores": "output_scores (per-step scores of a batch)",
    "output_logits": "output_logits (per-step logits of a batch)",
}


def check_batch_supported(model, state, kwargs: dict, gen_config, cache_implementation, past, batch_size: int,
                          shared: bool) -> None:
    """Raises `ValueError` for what batched Raincheck does not do (see the module docstring)."""
    where = "generate(raincheck_config=...) with a batch of more than one row"
    if past is not None and not isinstance(past, BatchedDeferredPrefillCache):
        raise ValueError(
            f"{where}: {hf.CACHE_ARGUMENT} must be a BatchedDeferredPrefillCache (one row cache per row, None for a "
            f"new conversation), got {type(past).__name__}"
        )
    if past is not None and past.batch_size != batch_size:
        raise ValueError(
            f"{where}: {hf.CACHE_ARGUMENT} holds {past.batch_size} rows but input_ids has {batch_size}"
        )
    unsupported = dict(_UNSUPPORTED_ALWAYS)
    if not shared:
        unsupported.update(_UNSUPPORTED_ONE_BY_ONE)
    for name, what in unsupported.items():
        value = kwargs.get(name, getattr(gen_config, name, None))
        if value:
            suffix = "" if shared else " when the rows run one after the other (attn_backend='flash')"
            raise ValueError(f"{where}: {what} is not supported{suffix}")


def _row_mask(input_ids: torch.Tensor, attention_mask) -> torch.Tensor:
    """bool ``[B, L]``: the real tokens; checks the padding is on the left."""
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"generate(raincheck_config=...): attention_mask has shape {tuple(attention_mask.shape)}, "
            f"input_ids {tuple(input_ids.shape)}"
        )
    mask = attention_mask.bool().cpu()
    for i, row in enumerate(mask):
        n = int(row.sum())
        if n == 0:
            raise ValueError(f"generate(raincheck_config=...): row {i} of attention_mask masks every token")
        if not bool(row[-n:].all()):
            raise ValueError(
                f"generate(raincheck_config=...): row {i} of attention_mask is not left-padded; batched Raincheck "
                "needs left padding (processor(..., padding=True, padding_side='left'); for a pipeline with "
                "batch_size > 1: processor.tokenizer.padding_side = 'left' before building it)"
            )
    return mask


def _media_per_row(adapter, row_ids: list[torch.Tensor], kwargs: dict, cached: list[int]) -> list[dict]:
    """Each row's pixels, grids (and ``second_per_grid_ts``), cut from the batch's concatenated processor outputs.

    The outputs describe either every row's whole conversation or only what is new in each row (the tokens past
    ``cached[i]``, what row i's cache already holds), as for a batch-1 call."""
    out = [dict() for _ in row_ids]
    for modality, token, grid_key, pixel_key in (
        ("image", adapter.image_token_id, "image_grid_thw", "pixel_values"),
        ("video", adapter.video_token_id, "video_grid_thw", "pixel_values_videos"),
    ):
        grid = kwargs.get(grid_key)
        every = [int((ids == token).sum()) for ids in row_ids]
        new = [int((ids[c:] == token).sum()) for ids, c in zip(row_ids, cached)]
        if grid is None:
            if any(new):
                raise ValueError(f"generate(raincheck_config=...): input_ids holds new {modality} placeholders but "
                                 f"`{grid_key}` was not passed")
            continue
        counts = adapter.media_token_counts(grid if modality == "image" else None,
                                            grid if modality == "video" else None)
        per_item = counts[0] if modality == "image" else [sum(v) for v in counts[1]]
        placeholders = every if sum(per_item) == sum(every) else new
        patches = grid.prod(-1).tolist()
        pixels = kwargs.get(pixel_key)
        seconds = kwargs.get("second_per_grid_ts") if modality == "video" else None
        item = row_start = 0
        for i, need in enumerate(placeholders):
            first = item
            got = 0
            while got < need and item < len(per_item):
                got += per_item[item]
                item += 1
            if got != need:
                raise ValueError(
                    f"generate(raincheck_config=...): {grid_key} does not match the {modality} placeholders of "
                    f"row {i} ({need} placeholder tokens); pass the processor's outputs for the same batch (every "
                    "row's whole conversation, or only what is new in each row)"
                )
            if item == first:
                continue
            rows = sum(patches[first:item])
            out[i][grid_key] = grid[first:item]
            if pixels is not None:
                out[i][pixel_key] = pixels[row_start:row_start + rows]
            row_start += rows
            if seconds is not None:
                out[i]["second_per_grid_ts"] = seconds[first:item]
        if item != len(per_item):
            raise ValueError(
                f"generate(raincheck_config=...): {grid_key} describes {len(per_item)} {modality}s but input_ids "
                f"holds placeholders for {item}"
            )
    return out


def _pad_token_id(gen_config) -> int:
    pad = gen_config.pad_token_id
    if pad is None:
        eos = gen_config.eos_token_id
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    if pad is None:
        raise ValueError(
            "generate(raincheck_config=...) with a batch: set pad_token_id (or eos_token_id) in the generation "
            "config; it pads the rows that stopped early"
        )
    return int(pad.item() if torch.is_tensor(pad) else pad)


_MEDIA_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")


def _expand(input_ids, mask, row_ids, media, mm_types, n: int):
    """``num_return_sequences = n``: each row repeated n times in place (its media too), as transformers expands
    a batch; the copies get the prompt's plan (the same selection) and sample on their own from the first step."""
    if n == 1:
        return input_ids, mask, row_ids, media, mm_types
    repeat = lambda t: None if t is None else t.repeat_interleave(n, dim=0)  # noqa: E731
    return (repeat(input_ids), repeat(mask), [r for r in row_ids for _ in range(n)],
            [dict(m) for m in media for _ in range(n)], repeat(mm_types))


def shared_steps_supported(state, cache_implementation, backend: str, past) -> str | None:
    """None when the shared-step engine runs this batch (with ``cache_implementation="static"``: on a static batch
    cache, its decode steps compiled where the compile config applies, `shared_static`), else why the rows run one
    after the other."""
    if backend == "flash":
        return "attn_backend='flash' (its key gather is built for one row)"
    if isinstance(past, BatchedDeferredPrefillCache) and any(r is not None and r.static for r in past.rows):
        return "a static row cache (rows of a batch that ran one after the other)"
    return None


@torch.no_grad()  # as transformers' generate: without it the vision tower's and the prefill's activations stay alive
def generate_batch(model, state, raincheck_config, kwargs: dict, gen_config, cache_implementation, past):
    """A left-padded batch (B > 1 rows, or one row with ``num_return_sequences > 1``): each row its own
    conversation, in shared forwards (`shared_batch`) where supported, else one row after the other through the
    batch-1 path (module docstring). `past`: the cache given (None: new conversations)."""
    input_ids = kwargs.pop("input_ids")
    n_return = gen_config.num_return_sequences or 1
    if n_return > 1 and past is not None:
        raise ValueError(
            "generate(raincheck_config=...): num_return_sequences > 1 starts new conversations; it cannot continue "
            f"{hf.CACHE_ARGUMENT} (continue each returned row through BatchedDeferredPrefillCache.split())"
        )
    backend = state.backend(raincheck_config)
    why_not_shared = shared_steps_supported(state, cache_implementation, backend, past)
    check_batch_supported(model, state, kwargs, gen_config, cache_implementation, past, input_ids.shape[0],
                          shared=why_not_shared is None)
    mask = _row_mask(input_ids, kwargs.pop("attention_mask", None))
    batch = input_ids.shape[0]
    ids_cpu = input_ids.cpu()
    row_ids = [ids_cpu[i][mask[i]] for i in range(batch)]
    cached = [0 if past is None or past.rows[i] is None else past.rows[i].length for i in range(batch)]
    media = _media_per_row(state.adapter, row_ids, kwargs, cached)
    mm_types = kwargs.pop("mm_token_type_ids", None)
    for key in _MEDIA_KEYS:
        kwargs.pop(key, None)
    input_ids, mask, row_ids, media, mm_types = _expand(input_ids, mask, row_ids, media, mm_types, n_return)
    kwargs.pop("num_return_sequences", None)
    rows = []
    for i in range(input_ids.shape[0]):
        row = dict(media[i])
        row["input_ids"] = row_ids[i][None].to(input_ids.device)
        row["attention_mask"] = torch.ones_like(row["input_ids"])
        if mm_types is not None:
            row["mm_token_type_ids"] = mm_types[i][mask[i].to(mm_types.device)][None]
        rows.append(row)
    if why_not_shared is None:
        static_new = None
        if cache_implementation == "static":  # the most new tokens per row (lengths count the padded prompt)
            static_new = gen_config.max_new_tokens
            if static_new is None:
                static_new = max(gen_config.max_length - input_ids.shape[1], 1)
        return _generate_shared(model, state, raincheck_config, kwargs, gen_config, input_ids, mask, rows, past,
                                backend, static_new)
    if cache_implementation is not None:  # (each row's batch-1 call builds its cache of that kind)
        kwargs["cache_implementation"] = cache_implementation
    return _generate_one_by_one(model, raincheck_config, kwargs, gen_config, input_ids, rows, past)


def _generate_shared(model, state, config, kwargs: dict, gen_config, input_ids, mask, rows: list[dict], past,
                     backend: str, static_new: int | None):
    adapter = state.adapter
    if past is None:
        past = BatchedDeferredPrefillCache([None] * input_ids.shape[0])
    for i, row in enumerate(past.rows):
        if row is None:
            past.rows[i] = DeferredPrefillCache(adapter.num_cache_layers())
    for row in past.rows:
        row.bind_model(model)
        state.register_cache(row)
        row.stop_completion()
        row.raise_completion_error()
        row.check_usable("generate")
    kwargs["input_ids"] = input_ids
    kwargs["attention_mask"] = mask.to(device=input_ids.device, dtype=torch.long)
    kwargs[hf.CACHE_ARGUMENT] = past
    kwargs.pop("compile_config", None)
    kwargs["disable_compile"] = True
    with contextlib.ExitStack() as locks:
        for row in sorted(past.rows, key=id):  # (one order everywhere: no deadlock between two batches)
            locks.enter_context(row.lock)
        return _generate_shared_locked(model, state, config, kwargs, gen_config, rows, past, backend, static_new)


def _generate_shared_locked(model, state, config, kwargs, gen_config, rows, past, backend, static_new):
    for row in past.rows:
        row.config = config  # as given; the turn runs with its "auto" values resolved for the model
        row.tidy()
    stops = RowStopsSlot()
    run_config = config.for_model(state.adapter.gdn_glue is not None)
    bturn = prepare_batch_turn(state.adapter, past, run_config, rows, backend, stops)
    if static_new is not None:
        device = bturn.turns[0].positions.device
        past.reserve_static(static_capacity(bturn, past, static_new, run_config), device)
        bturn.static_step = static_batch_step(model, state, gen_config, device)
        if bturn.static_step is not None and state.adapter.gdn_glue is not None:
            # GDN states keep one shape ([S | P_tail] always) from the prefill on, as a compiled batch-1 call's
            glue = state.adapter.gdn_glue
            key_dims = {i: glue.dims(m)[1] for i, m in state.adapter.gdn_modules().items()}
            for row in past.rows:
                row.use_fixed_gdn_layout(key_dims)
    state.row_stops.slot = stops
    hf.forget_rope_deltas(model)  # (deltas of a call with another batch size break transformers' position ids)
    past.begin_turn(bturn)
    try:
        output = state.original_generate(**kwargs)
    finally:
        past.end_turn()
        state.row_stops.slot = None
    finish_batch(model, state.adapter, past, config, backend)
    return output


def static_capacity(bturn, group: BatchedDeferredPrefillCache, max_new: int, config) -> int:
    """Slots a static batch reserves before its prefill, so that nothing in the call reallocates its buffers:
    the shared prefill's width, and the longest row's conversation plus `max_new` tokens plus room for the
    padding of a compiled step (`shared_static.scratch_rows`) or of a blocking completion chunk."""
    kv_real = max(c.length for c in group.rows)
    sizes = []
    for turn in bturn.turns:
        size = 0 if turn.prefill is None else turn.prefill.size
        sizes.append(size)
        if size:
            kv_real = max(kv_real, turn.prefill.max_slot + 1)
    prefill_width = kv_real + (1 if max(sizes) > min(sizes) else 0)  # (padding writes one scratch slot)
    longest = max(turn.prompt_ids.numel() for turn in bturn.turns)
    room = max(scratch_rows(config.chunk_size), config.completion_chunk_size)
    return max(prefill_width, longest + max_new + room)


def static_batch_step(model, state, gen_config, device: torch.device) -> StaticBatchStep | None:
    """The compiled steps of a static batch, where transformers' rules compile a static cache's steps (as for
    one row: `static_step.static_step`), with the same compile options; None: the steps run eagerly."""
    single = static_step(model, state, gen_config, device)
    if single is None:
        return None
    key = ("batch", repr(sorted(single.options.items())))
    step = state.static_steps.get(key)
    if step is None:
        step = state.static_steps[key] = StaticBatchStep(single.options)
    return step


def _generate_one_by_one(model, raincheck_config, kwargs: dict, gen_config, input_ids, rows: list[dict], past):
    width = input_ids.shape[1]
    return_dict = bool(kwargs.pop("return_dict_in_generate", gen_config.return_dict_in_generate))
    # lengths count the padded prompt in transformers' batched generate: keep that meaning for every row
    if gen_config.max_new_tokens is None:
        kwargs["max_new_tokens"] = max(gen_config.max_length - width, 1)
    kwargs.pop("max_length", None)
    if gen_config.min_length:
        kwargs["min_new_tokens"] = max(gen_config.min_new_tokens or 0, gen_config.min_length - width)
        kwargs["min_length"] = 0
    pad = _pad_token_id(gen_config)
    new_parts, caches = [], []
    for i, inputs in enumerate(rows):
        row = dict(kwargs)
        row.update(inputs)
        if past is not None and past.rows[i] is not None:
            row[hf.CACHE_ARGUMENT] = past.rows[i]
        out = model.generate(**row, raincheck_config=raincheck_config, return_dict_in_generate=True)
        new_parts.append(out.sequences[0, inputs["input_ids"].numel():])
        caches.append(hf.output_cache(out))
    longest = max(p.numel() for p in new_parts)
    new = torch.full((len(rows), longest), pad, dtype=input_ids.dtype, device=input_ids.device)
    for i, part in enumerate(new_parts):
        new[i, : part.numel()] = part.to(new.device)
    sequences = torch.cat([input_ids, new], dim=1)
    if not return_dict:
        return sequences
    return GenerateDecoderOnlyOutput(sequences=sequences, **{hf.CACHE_ARGUMENT: BatchedDeferredPrefillCache(caches)})
