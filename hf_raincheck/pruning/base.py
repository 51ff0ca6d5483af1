"""The selector protocol: a context in, kept indices out, plus the registry of named selectors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class SelectionContext:
    """What a selector may look at when it picks the tokens of the first prefill.

    Attributes:
        input_ids: ``[L]`` token ids of the whole conversation.
        spans: ``(start, stop)`` of each placeholder span of the plan (an image, or one video frame), in order.
        budgets: tokens to keep in each span.
        modalities: ``"image"`` or ``"video"`` per span.
        grids: merged-token grid ``(t, h, w)`` per span (``t == 1`` for a frame or an image).
        embeddings: ``[sum N_m, H]`` the placeholder embeddings (vision tower output in the LLM space) of the
            spans, concatenated in span order.
        query_ids: ``[m]`` token ids of the current user turn's text (no template or special tokens).
        query_embeds: ``[m, H]`` their input embeddings.
        options: the selector's keyword options (``RaincheckConfig.pruning_options``).
        seed: the config's seed.
        extras: room for adapter-provided features (e.g. vision attentions); selectors must not require them.
    """

    input_ids: torch.Tensor
    spans: list[tuple[int, int]]
    budgets: list[int]
    modalities: list[str]
    grids: list[tuple[int, int, int]]
    embeddings: torch.Tensor
    query_ids: torch.Tensor
    query_embeds: torch.Tensor
    options: dict = field(default_factory=dict)
    seed: int = 0
    extras: dict = field(default_factory=dict)

    def span_embeddings(self, m: int) -> torch.Tensor:
        """Embeddings ``[N_m, H]`` of span ``m``."""
        offset = sum(stop - start for start, stop in self.spans[:m])
        start, stop = self.spans[m]
        return self.embeddings[offset : offset + stop - start]


Selector = Callable[[SelectionContext], torch.Tensor]
_REGISTRY: dict[str, Selector] = {}


def register_selector(name: str) -> Callable[[Selector], Selector]:
    """Decorator registering a selector under `name` (usable as ``RaincheckConfig(pruning=name)``)."""

    def decorate(fn: Selector) -> Selector:
        _REGISTRY[name] = fn
        return fn

    return decorate


def available_selectors() -> list[str]:
    return sorted(_REGISTRY)


def get_selector(pruning: str | Selector) -> Selector:
    if callable(pruning):
        return pruning
    try:
        return _REGISTRY[pruning]
    except KeyError:
        raise ValueError(f"unknown pruning selector {pruning!r}; available: {available_selectors()}") from None


def select_kept(pruning: str | Selector, ctx: SelectionContext) -> torch.Tensor:
    """Runs a selector and checks its answer: sorted unique indices, exactly ``budgets[m]`` inside span ``m``."""
    name = pruning if isinstance(pruning, str) else getattr(pruning, "__name__", repr(pruning))
    kept: Any = get_selector(pruning)(ctx)
    if not isinstance(kept, torch.Tensor) or kept.dtype not in (torch.int64, torch.int32) or kept.ndim != 1:
        raise ValueError(f"pruning selector {name!r} must return a 1-D LongTensor of indices, got {kept!r}")
    kept = kept.to(device="cpu", dtype=torch.long)
    kept, _ = torch.sort(kept)
    if kept.numel() > 1 and bool((kept[1:] == kept[:-1]).any()):
        raise ValueError(f"pruning selector {name!r} returned duplicate indices")
    inside = torch.zeros_like(kept, dtype=torch.bool)
    for m, ((start, stop), budget) in enumerate(zip(ctx.spans, ctx.budgets)):
        in_span = (kept >= start) & (kept < stop)
        count = int(in_span.sum())
        if count != budget:
            raise ValueError(
                f"pruning selector {name!r} kept {count} tokens in span {m} ({start}..{stop}); "
                f"its budget is exactly {budget}"
            )
        inside |= in_span
    if not bool(inside.all()):
        raise ValueError(f"pruning selector {name!r} returned indices outside the placeholder spans: {kept[~inside].tolist()}")
    return kept
