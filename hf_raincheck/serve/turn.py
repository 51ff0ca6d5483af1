"""One chat turn of the server: a `TurnJob` (what a request asks), `prepare_turn` (its conversation and model
inputs), `finish_turn` / `fail_turn` (the bookkeeping once its generation ended).

`prepare_turn` takes the conversation the request continues out of the pool (or none: a new conversation),
builds the request's model inputs (the cached tokens + the template's rendering of the new messages, as
`RaincheckChat` does; or the whole chat through the template) and checks them against the context; it settles
``prepared`` (the request is valid: a 4xx otherwise, before any streaming starts). The scheduler then runs the
prepared turns, alone or several in one batched `generate` (`batch`), and `finish_turn` puts the extended
conversation back into the pool and settles ``done`` with the answer; `fail_turn` settles it with the error and
drops the conversation. No other conversation's cache is touched.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import traceback
from dataclasses import dataclass, field

import torch

from ..config import RaincheckConfig
from ..conversation import next_turn_inputs
from .errors import RequestError, StreamError
from .messages import ParsedMessage, assistant_message
from .pool import Conversation, ConversationPool
from .stats import raincheck_usage

logger = logging.getLogger("hf_raincheck.serve")


@dataclass
class TurnResult:
    answer: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    raincheck: dict


@dataclass
class TurnJob:
    model: object
    processor: object
    messages: list[ParsedMessage]
    generation_config: object  # transformers GenerationConfig
    raincheck_config: RaincheckConfig
    loop: asyncio.AbstractEventLoop
    max_tokens_given: bool
    context_length: int
    seed: int | None = None
    streamer: object | None = None  # a `streaming.TextQueueStreamer` for SSE
    stream_queue: asyncio.Queue | None = None  # the streamer's queue (an error or a cancellation ends it here)
    prepared: asyncio.Future = field(default=None)
    done: asyncio.Future = field(default=None)
    submitted: float = field(default_factory=time.monotonic)  # when the scheduler received it

    def __post_init__(self):
        self.prepared = self.loop.create_future() if self.prepared is None else self.prepared
        self.done = self.loop.create_future() if self.done is None else self.done

    def resolve(self, future: asyncio.Future, value=None, error: BaseException | None = None) -> None:
        def settle():
            if future.done():
                return
            if isinstance(error, asyncio.CancelledError):
                future.cancel()
            elif error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

        self.loop.call_soon_threadsafe(settle)

    def end_stream(self, error: BaseException | None) -> None:
        """Ends an SSE stream whose generation did not reach ``streamer.end()``: an error item, or the end."""
        if self.stream_queue is None:
            return
        item = StreamError(f"generation failed: {type(error).__name__}: {error}") if error is not None else None
        self.loop.call_soon_threadsafe(self.stream_queue.put_nowait, item)


@dataclass
class PreparedTurn:
    """A valid request, ready to generate: its conversation (None: a new one) and its one-row model inputs."""

    job: TurnJob
    key: tuple  # the request's message keys
    conv: Conversation | None  # checked out of the pool: no other request can use or evict it meanwhile
    inputs: dict  # one row, no padding, on the CPU: the cached tokens + the new ones (media: the new ones only)
    prompt_tokens: int
    cached_tokens: int  # tokens the continued cache already holds (not fed again)
    previous_record: object | None  # the continued cache's last TurnRestore (its previous answer's accounting)
    cache_state: tuple | None  # the continued cache's `cache_state` before generating

    @property
    def prompt_ids(self) -> list[int]:
        return self.inputs["input_ids"][0].tolist()


def context_length(model) -> int:
    config = getattr(model.config, "text_config", model.config)
    return int(getattr(config, "max_position_embeddings", 0) or 0)


def cache_state(cache) -> tuple:
    """What a `generate` call on a cache changes: a cache whose state differs after a failed call was advanced
    by it (its conversation no longer ends where the request started), or left unusable."""
    try:
        cache.check_usable("the server")
        usable = True
    except RuntimeError:
        usable = False
    return cache.length, len(cache.turn_stats), cache.pending, usable


def _inputs(job: TurnJob, conv) -> dict:
    processor = job.processor
    if conv is not None:
        new = [m.message for m in job.messages[len(conv.key):]]
        return dict(next_turn_inputs(processor, conv.sequences, new))
    return dict(processor.apply_chat_template([m.message for m in job.messages], add_generation_prompt=True,
                                              tokenize=True, return_dict=True, return_tensors="pt"))


def _check_context(job: TurnJob, prompt_tokens: int) -> None:
    limit = job.context_length
    if not limit:
        return
    gen = job.generation_config
    if prompt_tokens >= limit:
        raise RequestError(f"the prompt is {prompt_tokens} tokens (images included), beyond the model's context "
                           f"of {limit} tokens; shorten the conversation or send fewer / smaller images")
    if prompt_tokens + gen.max_new_tokens > limit:
        if job.max_tokens_given:
            raise RequestError(f"the prompt ({prompt_tokens} tokens) + max_tokens ({gen.max_new_tokens}) is beyond "
                               f"the model's context of {limit} tokens; lower max_tokens to at most "
                               f"{limit - prompt_tokens}")
        job.generation_config = copy.deepcopy(gen)
        job.generation_config.max_new_tokens = limit - prompt_tokens


def _prepared(job: TurnJob, key: tuple, conv) -> PreparedTurn:
    """Builds and checks the inputs (raises `RequestError`); does not touch the pool."""
    try:
        inputs = _inputs(job, conv)
    except Exception as error:  # noqa: BLE001 - the processor refusing the input (e.g. an image too small)
        raise RequestError(f"the request's inputs cannot be processed: {error}") from None
    prompt_tokens = int(inputs["input_ids"].shape[1])
    _check_context(job, prompt_tokens)
    cache = conv.cache if conv is not None else None
    return PreparedTurn(
        job=job, key=key, conv=conv, inputs=inputs, prompt_tokens=prompt_tokens,
        cached_tokens=cache.length if cache is not None else 0,
        previous_record=cache.turn_stats[-1] if cache is not None and cache.turn_stats else None,
        cache_state=cache_state(cache) if cache is not None else None)


def prepare_turn(job: TurnJob, pool: ConversationPool) -> PreparedTurn | None:
    """Checks a request out of the pool and builds its inputs (on the scheduler's thread); settles
    ``job.prepared``. None: the request was refused (a `RequestError`), its conversation put back untouched."""
    key = tuple(m.key for m in job.messages)
    conv = pool.checkout(job.model, key)
    try:
        turn = _prepared(job, key, conv)
    except RequestError as error:
        if conv is not None:
            pool.checkin(conv)  # nothing was fed: the conversation is as it was
        job.resolve(job.prepared, error=error)
        return None
    job.resolve(job.prepared, True)
    return turn


def restart_as_new(turn: PreparedTurn) -> PreparedTurn:
    """The same request on a new conversation (its whole chat prefilled again): for a turn whose continued cache
    was advanced by a failed batched call (that conversation is dropped). Raises `RequestError`."""
    return _prepared(turn.job, turn.key, None)


def answer_length(new_ids: list[int], eos: set[int], pad: int, max_new_tokens: int) -> int:
    """How many of a batch row's new tokens are its answer (transformers pads a row that stopped early on the
    right with ``pad``): up to its first end-of-sequence token; all of them at ``max_new_tokens``; otherwise (a
    stop string ended it) up to the padding."""
    for i, token in enumerate(new_ids):
        if token in eos:
            return i + 1
    if len(new_ids) >= max_new_tokens:
        return len(new_ids)
    n = len(new_ids)
    while n > 1 and new_ids[n - 1] == pad:
        n -= 1
    return n


def eos_ids(generation_config) -> set[int]:
    eos = generation_config.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def finish_turn(turn: PreparedTurn, pool: ConversationPool, cache, answer_ids: list[int], batch_size: int) -> None:
    """A turn's answer is done: checks the cache holds the conversation + answer (all but at most its last
    token), trims it to the slots it holds (`DeferredPrefillCache.trim`: a row of a batched call leaves the
    batch's shared buffers, a buffer grown for the call shrinks), puts the conversation back into the pool and
    settles ``done`` with the `TurnResult`."""
    job = turn.job
    prompt_ids = turn.prompt_ids
    full = prompt_ids + answer_ids
    fed = cache.token_ids
    if not (len(full) - 1 <= len(fed) <= len(full) and fed == full[:len(fed)]):
        raise RuntimeError(f"the conversation's cache holds {len(fed)} tokens that are not the prompt "
                           f"({len(prompt_ids)} tokens) + the answer ({len(answer_ids)} tokens)")
    answer = job.processor.decode(answer_ids, skip_special_tokens=True)
    completion_tokens = len(answer_ids)
    ended = completion_tokens > 0 and answer_ids[-1] in eos_ids(job.generation_config)
    finish_reason = "length" if not ended and completion_tokens >= job.generation_config.max_new_tokens else "stop"
    record = cache.turn_stats[-1] if cache.turn_stats else None
    usage = raincheck_usage(reused=turn.conv is not None, cached_tokens=turn.cached_tokens, record=record,
                            previous_record=turn.previous_record, batch_size=batch_size)
    new_key = turn.key + (assistant_message(answer).key,)
    sequences = torch.tensor([full], dtype=torch.long)
    conv = turn.conv if turn.conv is not None else pool.new(job.model, new_key, cache, sequences)
    conv.key, conv.cache, conv.sequences = new_key, cache, sequences
    conv.turns += 1
    cache.trim()  # pooled at the size it needs, in buffers of its own (a batch's shared ones are freed after it)
    pool.checkin(conv)
    job.resolve(job.done, TurnResult(answer=answer, prompt_tokens=turn.prompt_tokens,
                                     completion_tokens=completion_tokens, finish_reason=finish_reason,
                                     raincheck=usage))


def fail_turn(turn: PreparedTurn, error: BaseException | None) -> None:
    """A turn whose generation failed (``error``) or was cancelled by its client (None): its stream ends, its
    ``done`` is settled, its conversation (checked out) is dropped."""
    job = turn.job
    error = without_frames(error)
    job.end_stream(error)
    job.resolve(job.done, error=error if error is not None else asyncio.CancelledError())


def log_failure(logger, message: str, *args) -> None:
    """``logger.exception`` with the traceback as text: a log record that kept the traceback object (a capturing
    or buffering handler keeps records) would keep every frame of the failed call alive (see `without_frames`)."""
    logger.error(message + "\n%s", *args, traceback.format_exc())


def without_frames(error: BaseException | None) -> BaseException | None:
    """`error` (already logged) with the tracebacks of it and of the exceptions it chains dropped: a request's
    error is kept until its response is sent, and a traceback keeps every frame of the failed call alive, with its
    tensors (a batch's KV buffers, a forward's activations: on a GPU, memory the next requests need)."""
    seen, chained = set(), error
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        chained.__traceback__ = None
        chained = chained.__cause__ or chained.__context__
    return error
