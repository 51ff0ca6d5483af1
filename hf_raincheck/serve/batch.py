"""Running prepared turns: several requests in ONE batched Raincheck `generate`, or one alone.

Which requests share a call (`batch_key`): those with the same model, Raincheck config and generation config
(``temperature`` / ``top_p`` / ``stop`` / ``frequency_penalty`` / ``logit_bias`` / ``generation_config``: one
`GenerationConfig` per call, so equal settings only) but any ``max_tokens``: the call runs the largest
``max_new_tokens`` of its rows and stops each row at its own (`RowTokenLimits`, a stopping criterion: a stopped
row is fed nothing more, so its cache holds exactly its prompt and its own answer). Under
``attn_backend="flash"`` the batched engine runs the rows one after the other (`generation.batch`), where one
criterion cannot tell the rows apart: there ``max_tokens`` stays part of the key. A request runs alone (a batch of
one) when it samples with a ``seed`` (its random draws must not depend on what it is batched with) or when it
streams while `STREAM_IN_BATCHES` is False.

A batch (`run_batch`): each row is one conversation, continued from its pooled `DeferredPrefillCache` (its
cached tokens + the new ones) or new (its whole chat); the rows are left-padded into one batch
(`conversation.batch_inputs`) and run as ``model.generate(**batch, **cache_argument(
BatchedDeferredPrefillCache([cache or None, ...])), ...)``. Row i's answer is its new tokens up to its first
end-of-sequence token or its own ``max_tokens`` (`turn.answer_length`); its cache is the returned cache's ``rows[i]``.
Streaming rows get their tokens through a `FanOutStreamer` (which ends each row at its own limit too).

A batched call that raises runs its requests again one at a time, so a bad request fails only itself: a row
whose cache the failed call left as it was runs on it; a row whose cache it advanced (the call ran in part) or
left unusable starts a new conversation with its whole chat (that cache is dropped); a streaming row whose
client already received tokens fails. A cancelled streaming row (its client went away) drops its conversation
only.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ..cache.batched import BatchedDeferredPrefillCache
from ..conversation import batch_inputs, cache_argument, output_cache
from .errors import GenerationCancelled, RequestError
from .pool import ConversationPool
from .streaming import FanOutStreamer
from .turn import (PreparedTurn, answer_length, cache_state, eos_ids, fail_turn, finish_turn, log_failure,
                   restart_as_new)

logger = logging.getLogger("hf_raincheck.serve")

#: whether streaming requests join batches (through a `FanOutStreamer`; the batched engine accepts a streamer at
#: B > 1). False: each streaming request runs alone, with its own streamer.
STREAM_IN_BATCHES = True


@dataclass
class BatchStats:
    """The server's `generate` calls for requests: how many, their rows, and the batched calls that failed and
    were run again one request at a time (``GET /v1/raincheck/stats``, ``batches``)."""

    calls: int = 0
    rows: int = 0
    max_rows: int = 0
    sizes: dict = field(default_factory=dict)  # rows per call -> calls
    fallbacks: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, rows: int) -> None:
        with self._lock:
            self.calls += 1
            self.rows += rows
            self.max_rows = max(self.max_rows, rows)
            self.sizes[rows] = self.sizes.get(rows, 0) + 1

    def count_fallback(self) -> None:
        with self._lock:
            self.fallbacks += 1

    def snapshot(self) -> dict:
        """The counters (read from any thread)."""
        with self._lock:
            return {"calls": self.calls, "rows": self.rows, "max_rows": self.max_rows,
                    "sizes": {str(k): v for k, v in sorted(self.sizes.items())}, "fallbacks": self.fallbacks}


#: generation-config fields that may differ between the rows of one call (each row stops at its own limit)
PER_ROW_FIELDS = ("max_new_tokens",)


def batch_key(turn: PreparedTurn) -> tuple | None:
    """Requests with equal keys may share a batched call; None: the request runs alone (module docstring)."""
    job = turn.job
    gen = job.generation_config
    if gen.do_sample and job.seed is not None:
        return None
    if job.streamer is not None and not STREAM_IN_BATCHES:
        return None
    settings = gen.to_dict()
    if job.raincheck_config.attn_backend != "flash":  # (flash: the rows run one by one, module docstring)
        for name in PER_ROW_FIELDS:
            if isinstance(settings.get(name), int):
                settings.pop(name)
    settings = json.dumps(settings, sort_keys=True, default=repr)
    return id(job.model), id(job.processor), id(job.raincheck_config), settings


class RowTokenLimits(StoppingCriteria):
    """Stops row i of a batched `generate` once it has produced ``limits[i]`` new tokens.

    transformers calls stopping criteria once per step, after appending that step's tokens, with the whole
    ``[B, prompt width + new tokens]`` sequences; a row it reports done gets padding from then on and the Raincheck
    batch feeds it nothing more (`hf_raincheck.generation.row_stops`).

    Args:
        limits: each row's ``max_new_tokens`` (ints >= 1).
        prompt_width: the width of the call's (left-padded) prompt.
    """

    def __init__(self, limits: list[int], prompt_width: int):
        if not limits or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in limits):
            raise ValueError(f"RowTokenLimits: limits must be a non-empty list of ints >= 1, got {limits!r}")
        if isinstance(prompt_width, bool) or not isinstance(prompt_width, int) or prompt_width < 1:
            raise ValueError(f"RowTokenLimits: prompt_width must be an int >= 1, got {prompt_width!r}")
        self.limits = list(limits)
        self.prompt_width = prompt_width
        self._limits_tensor: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        if input_ids.shape[0] != len(self.limits):
            raise ValueError(f"RowTokenLimits: built for {len(self.limits)} rows, called with a batch of "
                             f"{input_ids.shape[0]} (the rows must run in one batched call)")
        if self._limits_tensor is None or self._limits_tensor.device != input_ids.device:
            self._limits_tensor = torch.tensor(self.limits, device=input_ids.device)
        return (input_ids.shape[1] - self.prompt_width) >= self._limits_tensor


def group_turns(turns: list[PreparedTurn], max_batch_size: int) -> list[list[PreparedTurn]]:
    """The turns in groups that share a call (at most `max_batch_size` each), in order of their first request."""
    groups: list[list[PreparedTurn]] = []
    open_groups: dict[tuple, list[PreparedTurn]] = {}
    for turn in turns:
        key = batch_key(turn)
        group = open_groups.get(key) if key is not None else None
        if group is None or len(group) >= max_batch_size:
            group = [turn]
            groups.append(group)
            if key is not None:
                open_groups[key] = group
        else:
            group.append(turn)
    return groups


def _pad_token_id(processor, generation_config) -> int:
    """The token padding the rows (on the left in the prompt, on the right after a row stopped): the generation
    config's, else its first end-of-sequence token (as batched `generate` picks it), else the tokenizer's."""
    pad = generation_config.pad_token_id
    if pad is None:
        eos = generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    if pad is None:
        pad = processor.tokenizer.pad_token_id
    if pad is None:
        raise ValueError("the model's generation config and tokenizer name no pad_token_id or eos_token_id: a "
                         "batch needs one to pad its rows")
    return int(pad)


def _to_device(inputs: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _call_kwargs(turn: PreparedTurn) -> dict:
    job = turn.job
    gen = job.generation_config
    gen.return_dict_in_generate = True
    return dict(generation_config=gen, raincheck_config=job.raincheck_config, tokenizer=job.processor.tokenizer)


def run_alone(turn: PreparedTurn, pool: ConversationPool, stats: BatchStats) -> None:
    """One request in its own `generate` call (the batch-1 path, its streamer as is)."""
    job = turn.job
    kwargs = _call_kwargs(turn)
    if turn.conv is not None:
        kwargs.update(cache_argument(turn.conv.cache))
    if job.streamer is not None:
        kwargs["streamer"] = job.streamer
    stats.count(1)
    try:
        if job.seed is not None:
            torch.manual_seed(job.seed)
        out = job.model.generate(**_to_device(turn.inputs, job.model.device), **kwargs)
        answer_ids = out.sequences[0, turn.prompt_tokens:].tolist()
        finish_turn(turn, pool, output_cache(out), answer_ids, batch_size=1)
    except GenerationCancelled:  # the client went away mid-stream: the conversation is dropped
        fail_turn(turn, None)
    except Exception as error:  # noqa: BLE001 - reported to this request only; its conversation is dropped
        log_failure(logger, "generation failed")
        fail_turn(turn, error)


def run_batch(turns: list[PreparedTurn], pool: ConversationPool, stats: BatchStats) -> None:
    """Runs a group of prepared turns (`group_turns`): one batched `generate` call, or the turn alone."""
    if len(turns) == 1:
        run_alone(turns[0], pool, stats)
        return
    first = turns[0].job
    model, processor = first.model, first.processor
    kwargs = _call_kwargs(turns[0])
    limits = [t.job.generation_config.max_new_tokens for t in turns]  # (unequal only if all are ints: batch_key)
    if len(set(limits)) > 1:  # the call runs the largest; each row stops at its own (RowTokenLimits)
        kwargs["generation_config"] = copy.deepcopy(kwargs["generation_config"])
        kwargs["generation_config"].max_new_tokens = max(limits)
    gen = kwargs["generation_config"]
    streamer = None
    stats.count(len(turns))
    try:
        pad = gen.pad_token_id = _pad_token_id(processor, gen)  # the call pads with the same token
        eos = eos_ids(gen)
        if any(t.job.streamer is not None for t in turns):
            streamer = kwargs["streamer"] = FanOutStreamer([t.job.streamer for t in turns], eos, pad,
                                                           limits if len(set(limits)) > 1 else None)
        batch = batch_inputs([t.inputs for t in turns], pad)
        width = int(batch["input_ids"].shape[1])
        if len(set(limits)) > 1:
            kwargs["stopping_criteria"] = StoppingCriteriaList([RowTokenLimits(limits, width)])
        past = BatchedDeferredPrefillCache([t.conv.cache if t.conv is not None else None for t in turns])
        out = model.generate(**_to_device(dict(batch), model.device), **cache_argument(past), **kwargs)
    except GenerationCancelled:  # every row's client went away
        for turn in turns:
            fail_turn(turn, None)
        return
    except Exception:  # noqa: BLE001 - each request again on its own: only a bad one fails
        log_failure(logger, "a batched generate of %d requests failed; running them one at a time", len(turns))
        failed = True
    else:
        failed = False
    if failed:  # outside the handler: the failed call's frames (its buffers, its activations) are gone by now
        past = None
        stats.count_fallback()
        _one_at_a_time(turns, streamer, pool, stats)
        return
    caches = output_cache(out).split()
    sequences = out.sequences[:, width:].tolist()
    for i, turn in enumerate(turns):
        if streamer is not None and streamer.cancelled[i]:
            fail_turn(turn, None)
            continue
        try:
            new_ids = sequences[i][:limits[i]]  # (after its limit a row holds padding only)
            answer_ids = new_ids[:answer_length(new_ids, eos, pad, limits[i])]
            finish_turn(turn, pool, caches[i], answer_ids, batch_size=len(turns))
        except Exception as error:  # noqa: BLE001 - this row only
            log_failure(logger, "finishing row %d of a batched generate failed", i)
            fail_turn(turn, error)


def _one_at_a_time(turns: list[PreparedTurn], streamer: FanOutStreamer | None, pool: ConversationPool,
                   stats: BatchStats) -> None:
    for i, turn in enumerate(turns):
        if streamer is not None and (streamer.started(i) or streamer.cancelled[i]):
            fail_turn(turn, RuntimeError("the batched generate this streamed request was part of failed after "
                                         "its answer had begun") if not streamer.cancelled[i] else None)
            continue
        if turn.conv is not None and cache_state(turn.conv.cache) != turn.cache_state:
            logger.warning("conversation %s: the failed batched call advanced its cache (or left it unusable); the "
                           "request starts a new conversation", turn.conv.id)
            try:
                turn = restart_as_new(turn)
            except RequestError as error:
                fail_turn(turn, error)
                continue
        run_alone(turn, pool, stats)
