"""Finding placeholder spans in a conversation's token ids."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    start: int
    stop: int
    modality: str  # "image" or "video"

    @property
    def size(self) -> int:
        return self.stop - self.start


def find_spans(token_ids: list[int], image_token_id: int, video_token_id: int) -> list[Span]:
    """Maximal runs of one placeholder id (an image, or one video frame), in source order."""
    spans: list[Span] = []
    start = None
    current = None
    for i, tok in enumerate(token_ids + [None]):
        if tok == current:
            continue
        if current is not None:
            spans.append(Span(start, i, "image" if current == image_token_id else "video"))
        if tok == image_token_id or tok == video_token_id:
            start, current = i, tok
        else:
            start, current = None, None
    return spans
