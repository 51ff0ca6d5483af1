"""`RaincheckChat`: a multi-turn chat session over a model, its processor and a `RaincheckConfig`.

    chat = RaincheckChat(model, processor, RaincheckConfig(retention=0.3), max_new_tokens=256)
    print(chat.ask("What is in the picture?", images="photo.jpg"))
    for piece in chat.stream("And in the top left corner?"):
        print(piece, end="", flush=True)
    print(chat.stats[-1])
    chat.close()

The session keeps the messages, the exact tokens of the conversation and its `DeferredPrefillCache`. Turn 1
goes through the processor's chat template; later turns append the template's rendering of the new message to
the tokens the cache holds (`next_turn_inputs`), so nothing is re-encoded and earlier images are not processed
again. With ``completion="background"`` (the default) the deferred tokens of an answer are restored while the
user reads it; the next question preempts that work.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

from . import transformers_coupling as hf
from .cache import DeferredPrefillCache, TurnRestore
from .config import RaincheckConfig
from .conversation import next_turn_inputs
from .generation import enable_raincheck
from .generation.state import raincheck_state
from .images import eight_bit, open_image

# generate() arguments the session sets itself
_MANAGED = ("input_ids", "inputs", "past_key_values", "cache", "raincheck_config", "return_dict_in_generate", "streamer",
            "attention_mask", "pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw",
            "mm_token_type_ids")
_DEFAULT_MAX_NEW_TOKENS = 256
_EXIT_JOIN_S = 60.0  # how long interpreter exit waits for a stream's generate thread to stop (one decode step)


@dataclass
class TurnStats:
    """Timing and deferred-token accounting of one chat turn.

    ``restored_after_answer`` keeps growing while a background worker restores this turn's deferred tokens
    (``chat.wait()`` for the final numbers); what it had not restored when the next turn came is that turn's
    ``restored_in_prefill``. For a turn that deferred tokens (``policy="raincheck"``):
    ``deferred == restored_during_decode + pending_at_answer_end`` and ``pending_at_answer_end ==
    restored_after_answer + next turn's restored_in_prefill + (still pending)``.

    Attributes:
        ttft_s: seconds from the `generate` call (preemption of a running worker, vision, prefill included) to
            the first new token.
        tpot_s: mean seconds per output token after the first (None for a one-token answer).
        new_tokens: tokens generated.
        deferred: visual tokens of this turn's new images / videos deferred by the first prefill.
        restored_in_prefill: an earlier turn's pending tokens folded into this turn's prefill.
        restored_during_decode: deferred tokens carried by this turn's fused decode steps.
        restored_after_answer: restored after this answer ended (blocking / background completion).
        pending_at_answer_end: deferred tokens still pending when the answer ended.
    """

    ttft_s: float
    tpot_s: float | None
    new_tokens: int
    deferred: int
    restored_in_prefill: int
    restored_during_decode: int
    restored_after_answer: int
    pending_at_answer_end: int


class _Timer(BaseStreamer):
    """Times the tokens `generate` hands out (the first `put` is the prompt) and forwards them to `inner`."""

    def __init__(self, inner: BaseStreamer | None = None):
        self.inner = inner
        self.start = time.perf_counter()
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True
        if self.inner is not None:
            self.inner.put(value)

    def end(self):
        if self.inner is not None:
            self.inner.end()


@dataclass
class _Turn:
    timer: _Timer
    new_tokens: int
    record: TurnRestore | None


@dataclass(frozen=True)
class _Recorded:
    """What a session has recorded (replaced as a whole by each turn)."""

    messages: list  # the chat's messages
    sequences: torch.Tensor | None  # [1, L] the exact tokens of the conversation so far
    turns: list  # one `_Turn` per turn


class RaincheckChat:
    """A multi-turn chat with Raincheck over `model` (enabled here if needed), `processor` and `config`.

    Args:
        model: a vision-language model with a Raincheck adapter (e.g. Qwen3-VL).
        processor: its processor (chat template, tokenizer, image / video processors).
        config: the `RaincheckConfig` of every turn (default ``RaincheckConfig()``).
        system: an optional system prompt, sent with the first turn.
        **generate_kwargs: passed to every `generate` call (``max_new_tokens`` defaults to 256; sampling,
            ``min_new_tokens``, stopping criteria, ...); a turn's own keyword arguments override them.

    Attributes:
        messages: the chat so far (``{"role", "content"}`` dicts; images / videos as given).
        cache: the conversation's `DeferredPrefillCache` (None before the first turn and after `close`).
        stats: one `TurnStats` per turn (a fresh snapshot on every access).

    One session is used from one thread; `stream` runs `generate` in a helper thread while you iterate (at
    interpreter exit a stream still generating ends after its current step). Several sessions on one model may run
    in different threads. Images reach the processor with 8-bit values: 16-bit, 32-bit integer and float images
    are scaled, not clipped (`hf_raincheck.images`); image paths are opened by `hf_raincheck.images.open_image`.
    """

    def __init__(self, model, processor, config: RaincheckConfig | None = None, system: str | None = None,
                 **generate_kwargs):
        if config is None:
            config = RaincheckConfig()
        if not isinstance(config, RaincheckConfig):
            raise ValueError(f"RaincheckChat: config must be a RaincheckConfig or None, got {type(config).__name__}")
        if not hasattr(processor, "apply_chat_template") or not hasattr(processor, "tokenizer"):
            raise ValueError(
                f"RaincheckChat: processor must be the model's processor (with a chat template and a tokenizer), "
                f"got {type(processor).__name__}"
            )
        if system is not None and (not isinstance(system, str) or not system.strip()):
            raise ValueError(f"RaincheckChat: system must be None or a non-empty str, got {system!r}")
        if system is not None:
            _check_encodable("RaincheckChat", "system", system)
        self.model = enable_raincheck(model)
        self.processor = processor
        self.config = config
        self.system = system
        self.generate_kwargs = self._check_generate_kwargs("RaincheckChat", generate_kwargs)
        self.cache: DeferredPrefillCache | None = None
        self._recorded = _Recorded(messages=[], sequences=None, turns=[])
        self._closed = False
        self._busy = False

    # ------------------------------------------------------------------ public API
    @property
    def messages(self) -> list[dict]:
        """The chat so far: ``{"role", "content"}`` dicts (images / videos as given)."""
        return self._recorded.messages

    @property
    def _sequences(self) -> torch.Tensor | None:
        return self._recorded.sequences  # [1, L] the exact tokens of the conversation so far

    @property
    def _turns(self) -> list["_Turn"]:
        return self._recorded.turns

    def ask(self, text: str, images=None, videos=None, **generate_kwargs) -> str:
        """Sends one user message (text plus optional images / videos) and returns the answer.

        Args:
            text: the message text (non-empty).
            images: one image or a list: ``PIL.Image.Image`` or a path to an image file.
            videos: one video or a list: an array / tensor of frames ``(T, H, W, 3)`` or a path to a video file
                (decoded by the processor's video backend: torchcodec in transformers 5.23).
            **generate_kwargs: this turn's `generate` arguments (override the session's).
        """
        message, kwargs = self._prepare("ask", text, images, videos, generate_kwargs)
        timer = _Timer()
        self._busy = True
        try:
            out = self._generate(message, kwargs, timer)
        finally:
            self._busy = False
        return out

    def stream(self, text: str, images=None, videos=None, **generate_kwargs) -> Iterator[str]:
        """Like `ask`, but returns an iterator over pieces of the answer as they are generated.

        Arguments are checked now; `generate` starts (in a helper thread) on the first iteration. The turn is
        recorded when the iterator is exhausted (or closed; then the answer is still generated to its end).
        """
        message, kwargs = self._prepare("stream", text, images, videos, generate_kwargs)
        return self._stream(message, kwargs)

    @property
    def stats(self) -> list[TurnStats]:
        return [self._snapshot(turn) for turn in self._turns]

    @property
    def completion_running(self) -> bool:
        """Whether a background worker is restoring the last answer's deferred tokens now."""
        return self.cache is not None and self.cache.completion_running

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for background completion of the last turn; True when nothing is pending (see cache.wait)."""
        self._check_open("wait")
        return True if self.cache is None else self.cache.wait(timeout)

    def close(self) -> None:
        """Stops a background worker and releases the cache; later use of the session raises ValueError."""
        if self._closed:
            return
        if self._busy:
            raise RuntimeError("RaincheckChat.close: a turn is still being generated; finish its stream first")
        if self.cache is not None:
            self.cache.cancel()
        self.cache = None
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ argument checks
    def _check_open(self, caller: str) -> None:
        if self._closed:
            raise ValueError(f"RaincheckChat.{caller}: this chat session is closed; start a new RaincheckChat")

    @staticmethod
    def _check_generate_kwargs(caller: str, kwargs: dict) -> dict:
        for name in kwargs:
            if name in _MANAGED:
                raise ValueError(f"{caller}: generate argument {name!r} is set by the chat session; leave it out")
        return dict(kwargs)

    def _prepare(self, caller: str, text, images, videos, generate_kwargs) -> tuple[dict, dict]:
        caller = f"RaincheckChat.{caller}"
        self._check_open(caller.split(".")[1])
        if self._busy:
            raise RuntimeError(f"{caller}: the previous turn is still being generated; finish its stream first")
        if not isinstance(text, str):
            raise ValueError(f"{caller}: text must be a str, got {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"{caller}: text is empty; send a non-empty message")
        _check_encodable(caller, "text", text)
        content = [{"type": "image", "image": image} for image in _media(caller, "images", images, _check_image)]
        content += [{"type": "video", "video": video} for video in _media(caller, "videos", videos, _check_video)]
        content.append({"type": "text", "text": text})
        kwargs = dict(self.generate_kwargs)
        kwargs.update(self._check_generate_kwargs(caller, generate_kwargs))
        if "max_new_tokens" not in kwargs and "max_length" not in kwargs:
            kwargs["max_new_tokens"] = _DEFAULT_MAX_NEW_TOKENS
        return {"role": "user", "content": content}, kwargs

    # ------------------------------------------------------------------ one turn
    def _inputs(self, message: dict):
        message = _for_processor(message)
        if self._sequences is None:
            messages = [{"role": "system", "content": self.system}] if self.system else []
            inputs = self.processor.apply_chat_template(
                messages + [message], add_generation_prompt=True, tokenize=True, return_dict=True,
                return_tensors="pt",
            )
        else:
            inputs = next_turn_inputs(self.processor, self._sequences, [message])
        return {k: v.to(self.model.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def _generate(self, message: dict, kwargs: dict, timer: _Timer) -> str:
        inputs = self._inputs(message)
        prompt_len = inputs["input_ids"].shape[1]
        if self.cache is None:
            layers = raincheck_state(self.model, "RaincheckChat").adapter.num_cache_layers()
            self.cache = DeferredPrefillCache(layers, static=kwargs.get("cache_implementation") == "static")
        timer.start = time.perf_counter()
        before = self._recorded
        try:
            out = self.model.generate(
                **inputs, **kwargs, raincheck_config=self.config, streamer=timer,
                return_dict_in_generate=True, **{hf.CACHE_ARGUMENT: self.cache},
            )
            answer_ids = out.sequences[0, prompt_len:]
            answer = self.processor.decode(answer_ids, skip_special_tokens=True)
            self._record(message, answer, out.sequences, timer, int(answer_ids.numel()))
        except BaseException:
            # interrupted (Ctrl-C, a stopping criterion that raises, an error) before the turn was recorded, in
            # generate or after it: the turn is what the cache holds
            if self._recorded is before:
                self._record_interrupted(message, prompt_len, timer)
            raise
        return answer

    def _stream(self, message: dict, kwargs: dict) -> Iterator[str]:
        self._check_open("stream")
        if self._busy:
            raise RuntimeError("RaincheckChat.stream: another turn is still being generated; finish it first")
        self._busy = True
        try:
            streamer = TextIteratorStreamer(self.processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
            timer = _Timer(streamer)
            result: dict = {}
            # interpreter exit ends the answer after the current decode step (`_stop_streams_at_exit`): a daemon
            # thread killed inside torch's kernels aborts the process ("terminate called without an active
            # exception")
            at_exit = _StopAtExit()
            kwargs = dict(kwargs)
            kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), at_exit])

            def work():
                try:
                    result["answer"] = self._generate(message, kwargs, timer)
                except BaseException as error:  # noqa: BLE001 - re-raised in the consumer's thread
                    result["error"] = error
                    streamer.end()
                finally:
                    at_exit.done.set()

            thread = threading.Thread(target=work, name="raincheck-chat-generate", daemon=True)
            _LIVE_STREAMS.add(at_exit)
            thread.start()
            try:
                yield from streamer
            finally:
                thread.join()
            if "error" in result:
                raise result["error"]
        finally:
            self._busy = False

    def _record(self, message: dict, answer: str, sequences: torch.Tensor, timer: _Timer, new_tokens: int) -> None:
        """Adds the turn: the new history is built aside and takes over in one assignment, so an interrupt
        leaves either the old history or the new one, never half of it."""
        record = self.cache.turn_stats[-1] if self.cache is not None and self.cache.turn_stats else None
        recorded = self._recorded
        self._recorded = _Recorded(
            messages=recorded.messages + [message, {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
            sequences=sequences.detach().to("cpu"),
            turns=recorded.turns + [_Turn(timer=timer, new_tokens=new_tokens, record=record)],
        )

    def _record_interrupted(self, message: dict, prompt_len: int, timer: _Timer) -> None:
        """After an interrupted `generate`: keep what the cache holds (prompt + partial answer) as the turn."""
        cache = self.cache
        if cache.length < prompt_len:
            return  # failed before the prefill: nothing changed
        partial = cache.token_ids[prompt_len:]
        answer = self.processor.decode(partial, skip_special_tokens=True)
        self._record(message, answer, torch.tensor([cache.token_ids]), timer, len(partial))

    def _snapshot(self, turn: _Turn) -> TurnStats:
        times = turn.timer.times
        record = turn.record or TurnRestore()
        return TurnStats(
            ttft_s=(times[0] - turn.timer.start) if times else float("nan"),
            tpot_s=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
            new_tokens=turn.new_tokens,
            deferred=record.deferred,
            restored_in_prefill=record.restored_in_prefill,
            restored_during_decode=record.restored_during_decode,
            restored_after_answer=record.restored_after_answer,
            pending_at_answer_end=record.pending_at_answer_end,
        )


class _StopAtExit(StoppingCriteria):
    """Stops a stream's `generate` once the interpreter exits (`_stop_streams_at_exit`); ``done``: it returned."""

    def __init__(self):
        self.exiting = threading.Event()
        self.done = threading.Event()

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.exiting.is_set(), dtype=torch.bool, device=input_ids.device)


_LIVE_STREAMS: "weakref.WeakSet[_StopAtExit]" = weakref.WeakSet()


@atexit.register
def _stop_streams_at_exit() -> None:
    """Ends every stream's generate thread still running (after its current step) and waits for it."""
    streams = list(_LIVE_STREAMS)
    for stream in streams:
        stream.exiting.set()
    for stream in streams:
        stream.done.wait(_EXIT_JOIN_S)


def _check_encodable(caller: str, name: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{caller}: {name} holds a character that is not valid Unicode text ({error.object[error.start]!r} at "
            f"index {error.start}: {error.reason}); lone surrogates cannot be tokenized"
        ) from None


def _for_processor(message: dict) -> dict:
    """The message as the processor gets it: images decoded with 8-bit values (`hf_raincheck.images`); the
    session's ``messages`` keep them as given."""
    content = []
    for part in message["content"]:
        if part.get("type") == "image":
            image = part["image"]
            image = open_image(image, "images") if isinstance(image, (str, os.PathLike)) else eight_bit(image, "images")
            part = {**part, "image": image}
        content.append(part)
    return {**message, "content": content}


def _media(caller: str, name: str, value, check) -> list:
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return [check(caller, f"{name}[{i}]" if isinstance(value, (list, tuple)) else name, item)
            for i, item in enumerate(items)]


def _check_path(caller: str, name: str, value, kind: str) -> str:
    path = os.fspath(value)
    if not os.path.isfile(path):
        raise ValueError(f"{caller}: {name} is not an existing {kind} file: {path!r}")
    return path


def _check_image(caller: str, name: str, value):
    from PIL import Image

    if isinstance(value, Image.Image):
        _check_image_size(caller, name, value.size)
        return value
    if isinstance(value, (str, os.PathLike)):
        path = _check_path(caller, name, value, "image")
        try:
            with Image.open(path) as opened:
                size = opened.size
        except (OSError, Image.DecompressionBombError, SyntaxError) as error:
            raise ValueError(f"{caller}: {name} cannot be read as an image: {path!r} ({type(error).__name__})") from None
        _check_image_size(caller, name, size)
        return value
    raise ValueError(f"{caller}: {name} must be a PIL.Image.Image or a path to an image file, "
                     f"got {type(value).__name__}")


def _check_image_size(caller: str, name: str, size: tuple[int, int]) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ValueError(f"{caller}: {name} is an empty image ({width}x{height} px); an image needs at least 1 px a side")


def _check_video(caller: str, name: str, value):
    import numpy as np

    if isinstance(value, (str, os.PathLike)):
        return _check_path(caller, name, value, "video")
    if isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 4:
        frames, height, width = (int(n) for n in value.shape[:3])
        if min(frames, height, width) < 1:
            raise ValueError(f"{caller}: {name} is an empty video (shape {tuple(value.shape)}); a video needs at least "
                             "1 frame of at least 1 px a side")
        return value
    shape = f" of shape {tuple(value.shape)}" if hasattr(value, "shape") else ""
    raise ValueError(f"{caller}: {name} must be an array / tensor of frames (T, H, W, 3) or a path to a video file, "
                     f"got {type(value).__name__}{shape}")
