"""`RaincheckChatHandler`: transformers' `/v1/chat/completions` handler, with Raincheck turns on pooled caches.

It subclasses `transformers.cli.serving.chat_completion.ChatCompletionHandler` and keeps its request validation,
generation settings (``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``,
``frequency_penalty``, ``logit_bias``, ``generation_config``; `transformers_coupling.serving_generation_config`) and
response and SSE chunk builders. What changes: the model is the server's own (`models.RaincheckModelManager`, in
this process), the messages are parsed here (``image_url`` as ``data:`` URLs or local files, refused clearly
otherwise), each request is a `turn.TurnJob` for the scheduler (streamed through a `streaming.TextQueueStreamer`),
and the usage carries ``prompt_tokens_details.cached_tokens`` and the ``raincheck`` extension (`stats`), in the
last chunk of a stream too.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time

from fastapi import HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types.chat.chat_completion_chunk import ChatCompletionChunk, ChoiceDelta
from openai.types.chat.chat_completion_chunk import Choice as ChoiceChunk
from openai.types.completion_usage import CompletionUsage
from transformers.cli.serving.chat_completion import ChatCompletionHandler

from ..config import RaincheckConfig
from ..transformers_coupling import serving_generation_config
from .errors import RequestError, StreamError
from .images import ImageLoader
from .messages import parse_messages
from .models import RaincheckModelManager
from .scheduler import BatchingScheduler
from .streaming import TextQueueStreamer
from .turn import TurnJob, context_length

logger = logging.getLogger("hf_raincheck.serve")

# OpenAI fields this server does not implement: refused unless absent / null / the default value given here
_REFUSED_UNLESS_DEFAULT = {
    "n": 1, "logprobs": False, "top_logprobs": None, "presence_penalty": 0, "tools": None, "tool_choice": None,
    "functions": None, "function_call": None, "response_format": None, "audio": None, "modalities": None,
    "prediction": None, "parallel_tool_calls": None, "reasoning_effort": None, "web_search_options": None,
    "service_tier": None,
}
# accepted and without effect on the answer
_METADATA_FIELDS = ("user", "metadata", "store", "stream_options")
_SAMPLING_FIELDS = ("temperature", "top_p", "max_tokens", "max_completion_tokens", "frequency_penalty", "logit_bias",
                    "stop")


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {type(value).__name__}")
    if value < low or value > high or (low_open and value == low):
        raise RequestError(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value}")


@functools.cache
def _generation_fields() -> frozenset:
    """The fields of transformers' `GenerationConfig` (what a request's ``generation_config`` may set)."""
    from transformers import GenerationConfig

    return frozenset(GenerationConfig().to_dict())


def check_parameters(body: dict) -> None:
    """Refuses unsupported, out-of-range and conflicting request parameters (`RequestError` naming them)."""
    for name, default in _REFUSED_UNLESS_DEFAULT.items():
        if body.get(name) is not None and body[name] != default:
            raise RequestError(f"{name}={body[name]!r} is not supported by the Raincheck server"
                               + (f" (only {default!r})" if default is not None else ""))
    if "messages" not in body:
        raise RequestError("messages is required")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(f"stream must be a boolean, got {stream!r}")
    if body.get("stream_options") is not None and not stream:
        raise RequestError("stream_options is only allowed with stream=true")
    _number(body, "temperature", 0, 2)
    _number(body, "top_p", 0, 1, low_open=True)
    _number(body, "frequency_penalty", -1, 2, low_open=True)
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RequestError(f"{name} must be an integer >= 1, got {value!r}")
    if (body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None
            and body["max_tokens"] != body["max_completion_tokens"]):
        raise RequestError(f"max_tokens ({body['max_tokens']}) and max_completion_tokens "
                           f"({body['max_completion_tokens']}) conflict; send one of them")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise RequestError(f"seed must be an integer >= 0, got {seed!r}")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and 0 < len(stop) <= 4
                                                           and all(isinstance(s, str) and s for s in stop))):
        raise RequestError(f"stop must be a string or a list of 1 to 4 non-empty strings, got {stop!r}")
    if body.get("generation_config") is not None:
        given = [name for name in _SAMPLING_FIELDS if body.get(name) is not None]
        if given:
            raise RequestError(f"generation_config and {given} conflict: put those values in generation_config, "
                               "or leave generation_config out")
        try:
            settings = json.loads(body["generation_config"])
        except (TypeError, ValueError) as error:
            raise RequestError(f"generation_config must be a JSON object string: {error}") from None
        if not isinstance(settings, dict):
            raise RequestError(f"generation_config must be a JSON object string, got {type(settings).__name__}")
        unknown = sorted(set(settings) - _generation_fields())
        if unknown:
            raise RequestError(f"generation_config: {unknown} are not generation settings (GenerationConfig's fields "
                               "only)")
    if body.get("chat_template_kwargs"):
        raise RequestError("chat_template_kwargs is not supported by the Raincheck server (the conversation's "
                           "cached tokens must render the same way in every request)")


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class _Refused:
    """The endpoints of `transformers serve` this server does not run (they would bypass the model's scheduler)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    async def handle_request(self, *args, **kwargs):
        raise HTTPException(status_code=404, detail=f"{self.endpoint} is not served by hf-raincheck serve; "
                                                    "use /v1/chat/completions")


class RaincheckChatHandler(ChatCompletionHandler):
    """`/v1/chat/completions` with Raincheck (see the module docstring).

    Args:
        model_manager: the server's `models.RaincheckModelManager` (its one model).
        generation_state: transformers' serving ``GenerationState`` (as for `ChatCompletionHandler`).
        raincheck_config: the `RaincheckConfig` of every request (its ``completion`` is replaced by
            ``"next_turn"``: the scheduler restores deferred tokens between requests).
        scheduler: the `BatchingScheduler` running the turns.
        image_loader: the `ImageLoader` for ``image_url`` parts.
    """

    def __init__(self, model_manager: RaincheckModelManager, generation_state, raincheck_config: RaincheckConfig,
                 scheduler: BatchingScheduler, image_loader: ImageLoader):
        super().__init__(model_manager=model_manager, generation_state=generation_state)
        self.raincheck_config = raincheck_config
        self.scheduler = scheduler
        self.image_loader = image_loader

    async def handle_request(self, body: dict, request_id: str):
        try:
            return await self._handle(body, request_id)
        except RequestError as error:
            return JSONResponse({"error": {"message": error.message, "type": "invalid_request_error",
                                           "code": error.status}}, status_code=error.status)

    async def _handle(self, body: dict, request_id: str):
        check_parameters(body)
        self._validate_request(body)  # unknown fields: 422
        if not self.scheduler.running:
            raise HTTPException(status_code=503, detail="the model's scheduler has stopped")
        model_id, model, processor = self._resolve_model(body)  # another model than the served one: 400
        messages = await asyncio.to_thread(parse_messages, body["messages"], self.image_loader)
        seed = body.get("seed")
        config_body = {k: v for k, v in body.items() if k != "seed"}
        try:
            gen_config = serving_generation_config(self, config_body, model.generation_config)
            temperature = body.get("temperature")
            if temperature == 0:  # greedy (transformers' validation refuses a temperature without sampling)
                gen_config.do_sample, gen_config.temperature = False, None
            elif temperature is not None or body.get("top_p") is not None:
                gen_config.do_sample = True  # a sampling parameter asks for sampling, whatever the model's default
            gen_config.validate()
        except (TypeError, ValueError) as error:
            raise RequestError(f"invalid generation parameters: {error}") from None
        if (gen_config.num_beams or 1) > 1 or (gen_config.num_return_sequences or 1) > 1:
            raise RequestError("generation_config: beam search and num_return_sequences > 1 are not supported")
        loop = asyncio.get_running_loop()
        job = TurnJob(model=model, processor=processor, messages=messages, generation_config=gen_config,
                      raincheck_config=self.raincheck_config, loop=loop, context_length=context_length(model),
                      max_tokens_given=any(body.get(k) is not None for k in ("max_tokens", "max_completion_tokens")),
                      seed=seed)
        if body.get("stream"):
            job.stream_queue = asyncio.Queue()
            job.streamer = TextQueueStreamer(processor.tokenizer, loop, job.stream_queue)
        self.scheduler.submit(job)
        await job.prepared  # RequestError: a 4xx before anything is streamed
        if body.get("stream"):
            return StreamingResponse(self._sse(job, request_id, model_id), media_type="text/event-stream")
        try:
            result = await job.done
        except Exception as error:  # noqa: BLE001 - this request failed; the server and other conversations go on
            return JSONResponse({"error": {"message": f"generation failed: {type(error).__name__}: {error}",
                                           "type": "server_error"}}, status_code=500)
        completion = self._build_completion(request_id, result.answer, model_id, finish_reason=result.finish_reason,
                                            usage=self._usage(result))
        return JSONResponse(completion, media_type="application/json")

    def _resolve_model(self, body: dict) -> tuple:
        """(name, model, processor) of the served model; a request naming another model is refused (400)."""
        requested, name = body.get("model"), self.model_manager.force_model
        if requested is not None and requested != name:
            raise HTTPException(status_code=400, detail=f"Server is pinned to '{name}'; requested '{requested}'.")
        model, processor = self.model_manager.load_model_and_processor()
        return name, model, processor

    @staticmethod
    def _usage(result) -> CompletionUsage:
        return CompletionUsage.model_validate({
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.raincheck["cached_tokens"]},
            "raincheck": result.raincheck,
        })

    async def _sse(self, job: TurnJob, request_id: str, model_id: str):
        try:
            yield self._build_chunk_sse(request_id, role="assistant", model=model_id)
            while True:
                item = await job.stream_queue.get()
                if item is None:
                    break
                if isinstance(item, StreamError):
                    job.done.add_done_callback(_retrieve)  # the error is reported here, in the stream
                    yield f"data: {json.dumps({'error': {'message': item.message, 'type': 'server_error'}})}\n\n"
                    return
                yield self._build_chunk_sse(request_id, model=model_id, content=item)
            try:
                result = await job.done
            except asyncio.CancelledError:
                if job.done.cancelled():  # the request was cancelled (its client went away): the stream just ends
                    return
                raise
            except Exception as error:  # noqa: BLE001
                message = f"generation failed: {type(error).__name__}: {error}"
                yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
                return
            yield self._last_chunk_sse(request_id, model_id, result.finish_reason, self._usage(result))
            yield "data: [DONE]\n\n"
        except (GeneratorExit, asyncio.CancelledError):
            job.streamer.cancel()  # the client went away: generate stops at its next token
            raise

    def _last_chunk_sse(self, request_id: str, model_id: str, finish_reason: str, usage: CompletionUsage) -> str:
        """The stream's last chunk: its finish reason and its usage together (as transformers 5.23 sends them; from
        5.25 `_build_chunk_sse` sends a usage chunk without choices, which clients that read ``choices[0]`` of
        every chunk cannot take)."""
        chunk = ChatCompletionChunk(
            id=request_id, created=int(time.time()), model=model_id, object="chat.completion.chunk",
            system_fingerprint="", usage=usage,
            choices=[ChoiceChunk(delta=ChoiceDelta(), index=0, finish_reason=finish_reason)])
        return self.chunk_to_sse(chunk)
