"""The server's streamers: `TextQueueStreamer` (one request's answer, as text, into its SSE queue) and
`FanOutStreamer` (one streamer for a batched `generate`, handing each row's tokens to that row's own streamer).

transformers calls ``streamer.put(prompt)`` once with the prompt ``[B, L]``, then ``put(tokens)`` with the ``[B]``
next tokens of each decode step, and ``end()`` once. A row that stopped early keeps receiving ``pad_token_id``
in the later steps. The fan-out gives row i's streamer what a batch-1 `generate` of that row would have given
it: its prompt row (``[1, L]``, left padding included), then its tokens one step at a time (``[1]``), up to and
including its first end-of-sequence token or its own token limit (``row_limits``: rows of one call with different
``max_tokens``); a padding token is held back until a later real token of the row, or the row reaching its
limit, shows it was part of the answer (a row ended by a stop string is followed by padding only), then
``end()``.

A row's streamer sees nothing before its first token: until then the row can still be run again alone with the
same streamer (``started(i)`` says whether it has seen anything). A row whose streamer raises
`errors.GenerationCancelled` (its client went away) is cancelled alone: it receives nothing more and
``cancelled[i]`` is set; the batch goes on for the other rows, and is aborted (the exception raised) only when
every row is cancelled.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from .errors import GenerationCancelled


class TextQueueStreamer:
    """A `generate` streamer for one request: its answer's tokens decoded as they come (the tokenizers library's
    incremental ``DecodeStream``, special tokens skipped) and handed to `queue` on the event loop `loop`; ``None``
    ends the stream. The first ``put`` (the prompt) is not streamed. `cancel` (the client went away, from the event
    loop) makes the next ``put`` raise `GenerationCancelled`, which stops the generation.

    Args:
        tokenizer: the request's tokenizer (a fast tokenizer: its Rust ``backend_tokenizer`` decodes).
        loop: the event loop the queue belongs to.
        queue: the request's stream queue (text pieces, then ``None``; the server may end it with a
            `errors.StreamError` instead).
    """

    def __init__(self, tokenizer, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        from tokenizers.decoders import DecodeStream

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"TextQueueStreamer: tokenizer must be a fast tokenizer (with a backend_tokenizer), got "
                             f"{type(tokenizer).__name__}")
        self._backend, self._loop, self._queue = backend, loop, queue
        self._decode = DecodeStream(skip_special_tokens=True)
        self._prompt_seen = False
        self._cancelled = threading.Event()
        self.total_tokens = 0

    def put(self, value: torch.Tensor) -> None:
        if self._cancelled.is_set():
            raise GenerationCancelled()
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.total_tokens += 1
            text = self._decode.step(self._backend, token)
            if text:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, text)

    def end(self) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, None)

    def cancel(self) -> None:
        self._cancelled.set()


class FanOutStreamer:
    """One ``put`` / ``end`` streamer for a batch of B rows (see the module docstring).

    Args:
        streamers: one per row: a transformers-style streamer (``put`` / ``end``), or None (the row is not
            streamed).
        eos_token_ids: the tokens that end a row.
        pad_token_id: the token that pads a row after it stopped.
        row_limits: each row's most new tokens (None: no limit of its own; the call's ``max_new_tokens`` ends it).
    """

    def __init__(self, streamers: list, eos_token_ids, pad_token_id: int, row_limits: list[int] | None = None):
        if not isinstance(streamers, (list, tuple)) or not streamers:
            raise ValueError("FanOutStreamer: streamers must be a non-empty list (a streamer or None per row)")
        rows = len(streamers)
        if row_limits is not None and (
                not isinstance(row_limits, (list, tuple)) or len(row_limits) != rows
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in row_limits)):
            raise ValueError(f"FanOutStreamer: row_limits must be None or one int >= 1 per row ({rows}), got "
                             f"{row_limits!r}")
        self.streamers = list(streamers)
        self.eos = {int(t) for t in eos_token_ids}
        self.pad = int(pad_token_id)
        self.row_limits = list(row_limits) if row_limits is not None else [None] * rows
        self._count = [0] * rows  # tokens of the row so far (given or held)
        self.cancelled = [False] * rows
        self._ended = [s is None for s in self.streamers]  # nothing more goes to the row
        self._prompt: list[torch.Tensor | None] = [None] * rows  # given with the row's first token
        self._held = [0] * rows  # padding tokens held back, per row
        self._seen_prompt = False

    @property
    def batch_size(self) -> int:
        return len(self.streamers)

    def started(self, row: int) -> bool:
        """Whether row `row`'s streamer has received anything (its prompt is given with its first token)."""
        return self._prompt[row] is None and self._seen_prompt

    def put(self, value: torch.Tensor) -> None:
        value = value.detach().to("cpu")
        if not self._seen_prompt:
            if value.ndim != 2 or value.shape[0] != self.batch_size:
                raise ValueError(f"FanOutStreamer: the first put must be the prompt [{self.batch_size}, length], "
                                 f"got shape {tuple(value.shape)}")
            self._prompt = [value[i:i + 1] for i in range(self.batch_size)]
            self._seen_prompt = True
            return
        tokens = value.reshape(-1).tolist()
        if len(tokens) != self.batch_size:
            raise ValueError(f"FanOutStreamer: a step's put must hold {self.batch_size} tokens (one per row), got "
                             f"shape {tuple(value.shape)}")
        for row, token in enumerate(tokens):
            if self._ended[row]:
                continue
            self._count[row] += 1
            at_limit = self._count[row] == self.row_limits[row]
            if token == self.pad and token not in self.eos and not at_limit:
                self._held[row] += 1
                continue
            try:
                self._give(row, [self.pad] * self._held[row] + [token])
            except GenerationCancelled:
                self.cancelled[row] = self._ended[row] = True
                continue
            self._held[row] = 0
            if token in self.eos or at_limit:
                self._ended[row] = True
        if all(self.cancelled):
            raise GenerationCancelled()

    def _give(self, row: int, tokens: list[int]) -> None:
        streamer = self.streamers[row]
        if self._prompt[row] is not None:
            prompt, self._prompt[row] = self._prompt[row], None
            streamer.put(prompt)
        for token in tokens:
            streamer.put(torch.tensor([token]))

    def end(self) -> None:
        """Ends every row's stream but the cancelled ones' (a row that produced nothing gets its prompt first)."""
        for row, streamer in enumerate(self.streamers):
            if streamer is None or self.cancelled[row]:
                continue
            try:
                self._give(row, [])
            except GenerationCancelled:
                self.cancelled[row] = True
                continue
            streamer.end()
