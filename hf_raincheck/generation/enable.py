"""`enable_raincheck(model)`: lets `model.generate` take ``raincheck_config=`` (this instance only)."""

from __future__ import annotations

import copy

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from .. import transformers_coupling as hf
from ..cache import DeferredPrefillCache, TurnRestore
from ..cache.batched import BatchedDeferredPrefillCache
from ..config import RaincheckConfig
from . import config_source
from .install import install
from .background import start_background_completion
from .batch import generate_batch
from .row_stops import stopping_criteria
from .shared_batch import shared_step
from .completion import prefill_pending
from .rows import run_rows
from .schedule import FixedChunkSchedule
from .decode import decode_step
from .state import STATE_ATTR as _STATE_ATTR
from .state import RaincheckState, raincheck_state
from .static_step import static_step as _static_step
from .turn import Turn, prepare_turn

# processor outputs that Raincheck consumes itself before handing the call to transformers' generate
_MEDIA_KWARGS = (
    "pixel_values",
    "pixel_values_videos",
    "image_grid_thw",
    "video_grid_thw",
    "mm_token_type_ids",
    "second_per_grid_ts",
)
_UNSUPPORTED_KWARGS = {
    "assistant_model": "assisted decoding",
    "prompt_lookup_num_tokens": "prompt-lookup decoding",
    "inputs_embeds": "inputs_embeds (pass input_ids)",
    "position_ids": "position_ids (Raincheck computes logical positions itself)",
    "custom_generate": "custom_generate",
    "synced_gpus": "synced_gpus",
}


def enable_raincheck(model, force: bool = False):
    """Makes ``model.generate`` accept ``raincheck_config=RaincheckConfig(...)``.

    Patches this model instance only (its ``generate`` and ``forward``, the attention function of its text layers,
    which falls back to the model's own implementation for every call that is not Raincheck's, and the forward of
    its Gated DeltaNet layers); `disable_raincheck` takes it all off again, and ``copy.deepcopy`` of an enabled model
    gives an enabled copy that runs on its own weights. Idempotent; returns the model.

    ``generate`` takes its config from ``raincheck_config=``, else from ``generation_config.raincheck_config`` (a
    passed ``GenerationConfig``, or ``model.generation_config``: a default that ``save_pretrained`` /
    ``from_pretrained`` keep); see `hf_raincheck.generation.config_source`.

    `model` is the ``...ForConditionalGeneration`` model (the one with the LM head), or a transformers pipeline
    built on it (then a top-level ``raincheck_config=`` in a pipeline call raises instead of being dropped; pass
    ``generate_kwargs={"raincheck_config": cfg}``).

    Raises `ValueError` for a model family without an adapter or a model without its LM head, and `RuntimeError`
    when the installed transformers is not a supported version
    (`hf_raincheck.transformers_coupling.SUPPORTED_TRANSFORMERS`); ``force=True`` warns instead.

    A model that was never enabled runs no Raincheck code at all: transformers itself rejects
    ``generate(raincheck_config=...)`` ("The following `model_kwargs` are not used by the model:
    ['raincheck_config']") and ignores a ``generation_config.raincheck_config`` (it keeps unknown generation-config
    entries without reading them). Call ``enable_raincheck(model)`` first.
    """
    return install(model, _generate, _forward, stopping_criteria, force=force)


def _generation_config(model, kwargs: dict):
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    return config


def _validate(model, input_ids, kwargs: dict, gen_config) -> None:
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"generate(raincheck_config=...): {what} is not supported with Raincheck")
    if input_ids is None:
        raise ValueError("generate(raincheck_config=...): pass input_ids (the processor's output)")
    if input_ids.ndim != 2 or input_ids.shape[0] < 1:
        raise ValueError(
            "generate(raincheck_config=...): input_ids must be [batch, length] with batch >= 1, got shape "
            f"{tuple(input_ids.shape)}"
        )
    if (gen_config.num_beams or 1) > 1:
        raise ValueError(f"generate(raincheck_config=...): beam search is not supported (num_beams={gen_config.num_beams})")
    if getattr(gen_config, "prefill_chunk_size", None) is not None:
        raise ValueError("generate(raincheck_config=...): prefill_chunk_size is not supported")
    if gen_config.use_cache is False:
        raise ValueError("generate(raincheck_config=...): use_cache=False is not supported")


def _generate(model, *args, raincheck_config: RaincheckConfig | None = config_source.UNSET, **kwargs):
    state = raincheck_state(model, "generate")
    past = hf.given_cache(kwargs)
    raincheck_config = config_source.resolve(model, raincheck_config, kwargs.get("generation_config"), past)
    if raincheck_config is None:
        return state.original_generate(*args, **kwargs)
    past = hf.pop_cache_argument(kwargs, "generate")
    if args:
        if "input_ids" in kwargs or "inputs" in kwargs:
            raise ValueError("generate: input_ids given twice")
        kwargs["input_ids"], args = args[0], args[1:]
    if "inputs" in kwargs:
        kwargs["input_ids"] = kwargs.pop("inputs")
    input_ids = kwargs.get("input_ids")
    cache_implementation = kwargs.pop("cache_implementation", None)
    gen_config = _generation_config(model, kwargs)
    _validate(model, input_ids, kwargs, gen_config)
    if cache_implementation not in (None, "dynamic", "static"):
        raise ValueError(
            f"generate(raincheck_config=...): cache_implementation must be 'dynamic' or 'static', "
            f"got {cache_implementation!r}"
        )
    if input_ids.shape[0] > 1 or (gen_config.num_return_sequences or 1) > 1:  # rows: generation/batch.py
        if args:
            raise ValueError("generate(raincheck_config=...) with a batch: pass generate's arguments by keyword")
        return generate_batch(model, state, raincheck_config, kwargs, gen_config, cache_implementation, past)

    if past is None:
        static = cache_implementation == "static"
        past = DeferredPrefillCache(state.adapter.num_cache_layers(), static=static)
    elif not isinstance(past, DeferredPrefillCache):
        raise ValueError(
            f"generate(raincheck_config=...): {hf.CACHE_ARGUMENT} must be a DeferredPrefillCache returned by an "
            f"earlier Raincheck generate (or None), got {type(past).__name__}"
        )
    kwargs[hf.CACHE_ARGUMENT] = past
    past.bind_model(model)
    state.register_cache(past)  # disable_raincheck stops its background worker
    # a background worker still completing the previous turn gives way (within one chunk); what it left pending
    # is folded into this call's prefill. An error it hit is raised now, once.
    past.stop_completion()
    past.raise_completion_error()
    past.check_usable("generate")
    past.detach_shared()  # (a row of a batch continued alone: its own buffers, the batch's can be freed)

    call = (model, state, past, raincheck_config, input_ids, args, kwargs, gen_config)
    # (one line: Python skips a `with` block's __exit__ when a trace function raises at the line event of the
    # block's end, which would leave the lock held; a one-line `with` has no such event)
    with past.lock: return _generate_locked(*call)  # noqa: E701


@torch.no_grad()
def _generate_locked(model, state: RaincheckState, past: DeferredPrefillCache, raincheck_config: RaincheckConfig,
                     input_ids: torch.Tensor, args: tuple, kwargs: dict, gen_config):
    """The call on `past` once its lock is held: prepare the turn, run transformers' generate through the
    patched forward, then complete as the config says. The cache keeps `raincheck_config` as given; the turn runs
    with its ``"auto"`` values resolved for the model (`RaincheckConfig.for_model`)."""
    given, raincheck_config = raincheck_config, raincheck_config.for_model(state.adapter.gdn_glue is not None)
    schedule = raincheck_config.schedule or FixedChunkSchedule(raincheck_config.chunk_size, raincheck_config.guard_tokens)
    backend = state.backend(raincheck_config)
    turn = prepare_turn(state.adapter, past, raincheck_config, input_ids, kwargs, schedule, backend)
    if past.static:
        max_new = gen_config.max_new_tokens
        if max_new is None:
            max_new = max(gen_config.max_length - input_ids.shape[1], 1)
        turn.static_step = _static_step(model, state, gen_config, turn.prefill.embeds.device)
        if turn.static_step is not None and state.adapter.gdn_glue is not None:
            glue = state.adapter.gdn_glue
            past.use_fixed_gdn_layout({i: glue.dims(m)[1] for i, m in state.adapter.gdn_modules().items()})
        scratch = raincheck_config.chunk_size if turn.static_step is not None else 0
        past.reserve(input_ids.shape[1] + max_new + scratch, turn.prefill.embeds.device)
        turn.rope_delta_tensor = torch.full((), turn.rope_delta, dtype=torch.long, device=turn.prefill.embeds.device)
    for key in _MEDIA_KWARGS:
        kwargs.pop(key, None)
    # Raincheck compiles its own steps (above); transformers' auto-compile never applies to this cache
    kwargs.pop("compile_config", None)
    kwargs["disable_compile"] = True
    kwargs["attention_mask"] = torch.ones_like(input_ids)
    past.config = given
    past.tidy()  # (what an interrupted clean-up left: a finished plan's store, GDN checkpoints)
    hf.forget_rope_deltas(model)  # (deltas of a call with another batch size break transformers' position ids)
    past.begin_turn(turn)
    try:
        output = state.original_generate(*args, **kwargs)
    finally:
        # also when generate raises (e.g. a stopping criterion interrupts it): every forward is one
        # transaction (slots, plan progress, token_ids, counters, the turn record's pending count), committed
        # whole or not at all, so the cache stays consistent; nothing is completed then, what is pending folds
        # into the next call
        past.end_turn()
    if raincheck_config.completion == "blocking":
        prefill_pending(state, past, past.pending, raincheck_config.completion_chunk_size)
    elif raincheck_config.completion == "background":
        start_background_completion(model, past)
    return output


def _forward(model, *args, **kwargs):
    state = getattr(model, _STATE_ATTR)
    cache = hf.given_cache(kwargs)
    if isinstance(cache, (BatchedDeferredPrefillCache, DeferredPrefillCache)):
        hf.pop_cache_argument(kwargs, "forward")
    if isinstance(cache, BatchedDeferredPrefillCache):
        if cache.active_turn is None:
            raise ValueError("a BatchedDeferredPrefillCache is filled by a batched generate(raincheck_config=...) only")
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        logits = shared_step(state.adapter, cache, cache.active_turn, input_ids)
        return CausalLMOutputWithPast(logits=logits, **{hf.CACHE_ARGUMENT: cache})
    turn: Turn | None = cache.active_turn if isinstance(cache, DeferredPrefillCache) else None
    if turn is None:
        if isinstance(cache, DeferredPrefillCache):
            raise ValueError(
                "a DeferredPrefillCache is filled by generate(raincheck_config=...) only; "
                "a direct forward on it would break its logical-slot layout"
            )
        return state.original_forward(*args, **kwargs)
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    logits = _turn_step(state, cache, turn, input_ids)
    return CausalLMOutputWithPast(logits=logits, **{hf.CACHE_ARGUMENT: cache})


@torch.no_grad()
def _turn_step(state: RaincheckState, cache: DeferredPrefillCache, turn: Turn, input_ids) -> torch.Tensor:
    config = turn.config
    if not turn.prefill_done:
        if input_ids is None or input_ids.shape[-1] != turn.new_ids.numel():
            raise RuntimeError(
                "Raincheck's prefill expected the uncached part of the prompt "
                f"({turn.new_ids.numel()} tokens), got {None if input_ids is None else input_ids.shape[-1]}"
            )
        # the forward and everything the turn records (tokens, plan, grids, counters) in one transaction:
        # interrupted anywhere, the cache is as before the call, and continuing with `cache.token_ids` plus the
        # new turn redoes the whole prefill
        record = TurnRestore(deferred=turn.plan.total_deferred if turn.plan is not None else 0)
        prompt_ids = turn.prompt_ids.tolist()
        with cache.transaction():
            logits = run_rows(
                state.adapter, cache, turn.prefill, turn.prefill_plan, turn.backend, config.visibility,
                want_logits=True,
            )
            cache.commit_prefill(prompt_ids, turn.plan, turn.rope_delta, turn.media_grids, record,
                                 turn.prefill.restored)
        turn.record = record
        turn.restored_in_prefill = turn.prefill.restored
        turn.prefill_done = True
        turn.prefill = None  # free the prompt's rows
        if turn.static_step is not None:  # the plan's store, the scratch slots and GDN states in place now
            turn.static_step.prepare(cache, cache.plan, config.chunk_size)
            cache.persist_gdn_states()
        return logits

    # a decode step: feed y_j, carrying deferred tokens after the guard
    return decode_step(state.adapter, cache, turn, input_ids[:, -1:].to(turn.positions.device))
