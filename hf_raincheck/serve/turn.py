"""One chat turn of the server: a `TurnJob` (what a request asks) and `run_turn` (what the scheduler runs).

`run_turn` takes the conversation the request continues out of the pool (or starts a new one), builds the model
inputs (the cached tokens + the template's rendering of the new messages, as `RaincheckChat` does; or the whole
chat through the template), checks them against the context, runs Raincheck `generate` with
``completion="next_turn"`` (the scheduler restores what is left between requests) and puts the conversation back.
It reports in two steps: ``prepared`` (the request is valid: a 4xx otherwise, before any streaming starts) and
``done`` (the answer, or the error of a failed generation). A failed or cancelled turn drops its conversation;
no other conversation's cache is touched.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from dataclasses import dataclass, field

import torch

from ..config import RaincheckConfig
from ..conversation import next_turn_inputs
from .errors import RequestError
from .messages import ParsedMessage, assistant_message
from .pool import ConversationPool
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
    streamer: object | None = None  # transformers' DirectStreamer for SSE
    stream_queue: asyncio.Queue | None = None  # the streamer's queue (an error or a cancellation ends it here)
    prepared: asyncio.Future = field(default=None)
    done: asyncio.Future = field(default=None)

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
        from transformers.cli.serving.utils import _StreamError

        item = _StreamError(f"generation failed: {type(error).__name__}: {error}") if error is not None else None
        self.loop.call_soon_threadsafe(self.stream_queue.put_nowait, item)


def context_length(model) -> int:
    config = getattr(model.config, "text_config", model.config)
    return int(getattr(config, "max_position_embeddings", 0) or 0)


def _inputs(job: TurnJob, conv) -> dict:
    processor = job.processor
    if conv is not None:
        new = [m.message for m in job.messages[len(conv.key):]]
        inputs = next_turn_inputs(processor, conv.sequences, new)
    else:
        inputs = processor.apply_chat_template([m.message for m in job.messages], add_generation_prompt=True,
                                               tokenize=True, return_dict=True, return_tensors="pt")
    device = job.model.device
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


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


def run_turn(job: TurnJob, pool: ConversationPool) -> None:
    """Runs one request (on the scheduler's thread); settles ``job.prepared`` then ``job.done``."""
    from transformers.cli.serving.utils import _GenerationCancelled

    model = job.model
    key = tuple(m.key for m in job.messages)
    conv = pool.checkout(model, key)
    try:
        inputs = _inputs(job, conv)
        prompt_tokens = int(inputs["input_ids"].shape[1])
        _check_context(job, prompt_tokens)
    except RequestError as error:
        if conv is not None:
            pool.checkin(conv)  # nothing was fed: the conversation is as it was
        job.resolve(job.prepared, error=error)
        return
    except Exception as error:  # noqa: BLE001 - the processor refusing the input (e.g. an image too small)
        if conv is not None:
            pool.checkin(conv)
        job.resolve(job.prepared, error=RequestError(f"the request's inputs cannot be processed: {error}"))
        return
    job.resolve(job.prepared, True)

    cached_tokens = conv.cache.length if conv is not None else 0
    previous = conv.cache.turn_stats[-1] if conv is not None and conv.cache.turn_stats else None
    job.generation_config.return_dict_in_generate = True
    kwargs = dict(inputs, generation_config=job.generation_config, raincheck_config=job.raincheck_config,
                  tokenizer=job.processor.tokenizer)
    if conv is not None:
        kwargs["past_key_values"] = conv.cache
    if job.streamer is not None:
        kwargs["streamer"] = job.streamer
    try:
        if job.seed is not None:
            torch.manual_seed(job.seed)
        out = model.generate(**kwargs)
    except _GenerationCancelled:  # the client went away mid-stream: the conversation is dropped
        job.end_stream(None)
        job.resolve(job.done, error=asyncio.CancelledError())
        return
    except Exception as error:  # noqa: BLE001 - reported to this request only; the conversation is dropped
        logger.exception("generation failed")
        job.end_stream(error)
        job.resolve(job.done, error=error)
        return

    cache = out.past_key_values
    answer_ids = out.sequences[0, prompt_tokens:]
    answer = job.processor.decode(answer_ids, skip_special_tokens=True)
    completion_tokens = int(answer_ids.numel())
    eos = job.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else set()
    ended = completion_tokens > 0 and int(answer_ids[-1]) in eos
    finish_reason = "length" if not ended and completion_tokens >= job.generation_config.max_new_tokens else "stop"
    record = cache.turn_stats[-1] if cache.turn_stats else None
    usage = raincheck_usage(reused=conv is not None, cached_tokens=cached_tokens, record=record,
                            previous_record=previous)
    new_key = key + (assistant_message(answer).key,)
    sequences = out.sequences.detach().to("cpu")
    if conv is None:
        conv = pool.new(model, new_key, cache, sequences)
    conv.key, conv.cache, conv.sequences = new_key, cache, sequences
    conv.turns += 1
    pool.checkin(conv)
    job.resolve(job.done, TurnResult(answer=answer, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                     finish_reason=finish_reason, raincheck=usage))
