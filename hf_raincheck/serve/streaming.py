"""`FanOutStreamer`: one streamer for a batched `generate`, handing each row's tokens to that row's own streamer.

transformers calls ``streamer.put(prompt)`` once with the prompt ``[B, L]``, then ``put(tokens)`` with the ``[B]``
next tokens of each decode step, and ``end()`` once. A row that stopped early keeps receiving ``pad_token_id``
in the later steps. The fan-out gives row i's streamer what a batch-1 `generate` of that row would have given
it: its prompt row (``[1, L]``, left padding included), then its tokens one step at a time (``[1]``), up to and
including its first end-of-sequence token; a padding token is held back until a later real token of the row
shows it was part of the answer (a row ended by a stop string is followed by padding only), then ``end()``.

A row's streamer sees nothing before its first token: until then the row can still be run again alone with the
same streamer (``started(i)`` says whether it has seen anything). A row whose streamer raises transformers'
serving ``_GenerationCancelled`` (its client went away) is cancelled alone: it receives nothing more and
``cancelled[i]`` is set; the batch goes on for the other rows, and is aborted (the exception raised) only when
every row is cancelled.
"""

from __future__ import annotations

import torch
from transformers.cli.serving.utils import _GenerationCancelled


class FanOutStreamer:
    """One ``put`` / ``end`` streamer for a batch of B rows (see the module docstring).

    Args:
        streamers: one per row: a transformers-style streamer (``put`` / ``end``), or None (the row is not
            streamed).
        eos_token_ids: the tokens that end a row.
        pad_token_id: the token that pads a row after it stopped.
    """

    def __init__(self, streamers: list, eos_token_ids, pad_token_id: int):
        if not isinstance(streamers, (list, tuple)) or not streamers:
            raise ValueError("FanOutStreamer: streamers must be a non-empty list (a streamer or None per row)")
        self.streamers = list(streamers)
        self.eos = {int(t) for t in eos_token_ids}
        self.pad = int(pad_token_id)
        rows = len(self.streamers)
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
            if token == self.pad and token not in self.eos:
                self._held[row] += 1
                continue
            try:
                self._give(row, [self.pad] * self._held[row] + [token])
            except _GenerationCancelled:
                self.cancelled[row] = self._ended[row] = True
                continue
            self._held[row] = 0
            if token in self.eos:
                self._ended[row] = True
        if all(self.cancelled):
            raise _GenerationCancelled()

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
            except _GenerationCancelled:
                self.cancelled[row] = True
                continue
            streamer.end()
