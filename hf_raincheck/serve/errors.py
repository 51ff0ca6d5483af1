"""`RequestError`: a bad request, answered with a 4xx and a message that names what is wrong."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the server refuses; ``status`` is the HTTP status (400 unless said otherwise)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
        self.message = message
