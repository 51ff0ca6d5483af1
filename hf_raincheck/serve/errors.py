"""What goes wrong in a request: `RequestError` (a bad request, answered with a 4xx and a message that names what is
wrong), `GenerationCancelled` (its client went away mid-stream) and `StreamError` (a failure reported inside its
stream)."""

from __future__ import annotations

from dataclasses import dataclass


class RequestError(ValueError):
    """A request the server refuses; ``status`` is the HTTP status (400 unless said otherwise)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
        self.message = message


class GenerationCancelled(Exception):
    """Raised by a request's streamer once its client went away: it stops that request's `generate` (or, in a
    batched call, only that row; see `streaming.FanOutStreamer`)."""


@dataclass(frozen=True)
class StreamError:
    """The last item of a request's stream queue when its generation failed: the SSE stream ends with an error
    event carrying ``message``."""

    message: str
