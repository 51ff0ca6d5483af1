"""The selector protocol: a context in, kept indices out, plus the registry of named selectors.

A selector is a callable ``fn(ctx: SelectionContext) -> LongTensor`` returning the kept indices into
``ctx.input_ids`` (exactly ``ctx.budgets[m]`` inside span ``m``). A registered selector may also declare

- ``options``: the defaults of its keyword options (``RaincheckConfig.pruning_options``). Unknown option names
  raise a ``ValueError`` naming the option and the allowed ones, at config construction and at selection.
- ``requires``: which vision-tower features it needs, as ``{"vision_attention": [block ids],
  "vision_hidden": True}`` or a callable ``requires(options, vision_depth) -> that dict`` (options resolved,
  ``vision_depth`` = number of ViT blocks). The generation code asks the model adapter for them during the one
  vision-tower pass, and only when the selector declares them; they arrive in ``ctx.extras``.

A user callable may carry the same two attributes (``fn.options`` an `OptionSpec`, ``fn.requires``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch

#: ``ctx.extras`` keys (all per merged token, concatenated in span order like ``ctx.embeddings``)
VISION_ATTENTION = "vision_attention"  # {block id: [sum N_m] fp32}: ViT attention received per key (head mean,
#                                        summed over the queries of its image / frame), mean over the 2x2 patches
VISION_HIDDEN = "vision_hidden"  # [sum N_m, D_vit] fp32: last ViT block output, mean over the 2x2 patches
VISION_DEPTH = "vision_depth"  # int: number of ViT blocks (resolves negative block ids)


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
        options: the selector's keyword options (``RaincheckConfig.pruning_options``, defaults not filled in).
        seed: the config's seed.
        extras: vision-tower features a selector declared in ``requires`` (see the module docstring and the
            ``VISION_*`` keys); empty unless requested.
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

    def span_rows(self, m: int) -> slice:
        """Rows of span ``m`` in ``embeddings`` (and in the per-token ``extras``)."""
        offset = sum(stop - start for start, stop in self.spans[:m])
        start, stop = self.spans[m]
        return slice(offset, offset + stop - start)

    def span_embeddings(self, m: int) -> torch.Tensor:
        """Embeddings ``[N_m, H]`` of span ``m``."""
        return self.embeddings[self.span_rows(m)]

    def require_extra(self, key: str, selector: str = "selector"):
        """``extras[key]``, or a ValueError saying which selector needs it."""
        if key not in self.extras:
            raise ValueError(
                f"pruning selector {selector!r} needs ctx.extras[{key!r}] (vision-tower features), which this "
                "context does not hold; the model adapter provides them when the selector declares `requires` "
                f"(build the context by hand with extras={{{key!r}: ...}})"
            )
        return self.extras[key]

    def vision_block(self, layer: int, selector: str = "selector") -> int:
        """A ViT block id, negative ids counted from the end (needs ``extras['vision_depth']`` for those)."""
        if layer >= 0:
            return layer
        return normalize_block(layer, int(self.require_extra(VISION_DEPTH, selector)), selector)

    def span_vision_attention(self, m: int, layer: int, selector: str = "selector") -> torch.Tensor:
        """``[N_m]`` ViT attention received by each merged token of span ``m`` at block ``layer``."""
        table = self.require_extra(VISION_ATTENTION, selector)
        block = self.vision_block(layer, selector)
        if block not in table:
            raise ValueError(
                f"pruning selector {selector!r} needs the ViT attention of block {block}; ctx.extras holds blocks "
                f"{sorted(table)}"
            )
        return table[block][self.span_rows(m)]

    def span_vision_hidden(self, m: int, selector: str = "selector") -> torch.Tensor:
        """``[N_m, D_vit]`` last ViT block features of span ``m``, pooled over each merged token's patches."""
        return self.require_extra(VISION_HIDDEN, selector)[self.span_rows(m)]


# ------------------------------------------------------------------------------------------------------- options
def check_float(name: str, low: float | None = None, high: float | None = None, low_open: bool = False):
    """A check that an option is a real number in ``[low, high]`` (``(low, high]`` with ``low_open``)."""

    def check(selector: str, value: Any) -> Any:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
        if ok and low is not None:
            ok = value > low if low_open else value >= low
        if ok and high is not None:
            ok = value <= high
        if not ok:
            lo = "-inf" if low is None else f"{low}"
            bound = f"{'(' if low_open else '['}{lo}, {'inf' if high is None else high}]"
            raise ValueError(f"pruning option {name!r} of {selector!r} must be a number in {bound}, got {value!r}")
        return float(value)

    return check


def check_int_or_none(name: str):
    def check(selector: str, value: Any) -> Any:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"pruning option {name!r} of {selector!r} must be an int or None, got {value!r}")
        return value

    return check


class OptionSpec:
    """The keyword options of a selector: their defaults and value checks."""

    def __init__(self, selector: str, defaults: Mapping[str, Any], checks: Mapping[str, Callable] | None = None):
        self.selector = selector
        self.defaults = dict(defaults)
        self.checks = dict(checks or {})

    def resolve(self, given: Mapping[str, Any] | None) -> dict:
        """The defaults updated with ``given``; unknown names and bad values raise ``ValueError``."""
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            allowed = sorted(self.defaults) if self.defaults else "none"
            raise ValueError(
                f"pruning selector {self.selector!r} has no option {unknown[0]!r}"
                f"{' (also unknown: ' + ', '.join(map(repr, unknown[1:])) + ')' if len(unknown) > 1 else ''}; "
                f"allowed options: {allowed}"
            )
        resolved = dict(self.defaults)
        for name, value in given.items():
            check = self.checks.get(name)
            resolved[name] = check(self.selector, value) if check is not None else value
        return resolved


# ------------------------------------------------------------------------------------------------------ registry
Selector = Callable[[SelectionContext], torch.Tensor]
_REGISTRY: dict[str, Selector] = {}


def register_selector(
    name: str,
    *,
    options: Mapping[str, Any] | None = None,
    checks: Mapping[str, Callable] | None = None,
    requires: Mapping[str, Any] | Callable[[dict, int], Mapping[str, Any]] | None = None,
) -> Callable[[Selector], Selector]:
    """Decorator registering a selector under `name` (usable as ``RaincheckConfig(pruning=name)``).

    Args:
        options: defaults of the selector's keyword options (none when omitted: any option is an error).
        checks: per option, ``check(selector_name, value) -> value`` raising ``ValueError`` on a bad value.
        requires: the vision features the selector needs (see the module docstring).
    """

    def decorate(fn: Selector) -> Selector:
        fn.options = OptionSpec(name, options or {}, checks)
        if requires is not None:
            fn.requires = requires
        fn.selector_name = name
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


def resolve_options(pruning: str | Selector, options: Mapping[str, Any] | None) -> dict:
    """The selector's options with defaults filled in (validated); a callable without an `OptionSpec` gets them as is."""
    spec = getattr(get_selector(pruning), "options", None)
    if isinstance(spec, OptionSpec):
        return spec.resolve(options)
    return dict(options or {})


def normalize_block(layer: Any, depth: int, selector: str = "selector") -> int:
    """A ViT block id in ``[-depth, depth)`` as a non-negative id."""
    if isinstance(layer, bool) or not isinstance(layer, int) or not (-depth <= layer < depth):
        raise ValueError(
            f"pruning selector {selector!r}: vision block {layer!r} is out of range for a vision tower of "
            f"{depth} blocks (use 0..{depth - 1}, or -1 for the last)"
        )
    return layer % depth


def selector_requirements(pruning: str | Selector, options: Mapping[str, Any] | None, vision_depth: int | None) -> dict:
    """What the selector needs from the vision tower: ``{}`` or ``{"vision_attention": (block ids, sorted),
    "vision_hidden": bool}`` with non-negative block ids."""
    selector = get_selector(pruning)
    requires = getattr(selector, "requires", None)
    if requires is None:
        return {}
    name = getattr(selector, "selector_name", getattr(selector, "__name__", repr(selector)))
    if callable(requires):
        if vision_depth is None:
            raise ValueError(f"pruning selector {name!r} needs vision-tower features; this model adapter has none")
        requires = requires(resolve_options(pruning, options), vision_depth)
    requires = dict(requires or {})
    unknown = set(requires) - {VISION_ATTENTION, VISION_HIDDEN}
    if unknown:
        raise ValueError(f"pruning selector {name!r} requires unknown features {sorted(unknown)}")
    layers = tuple(requires.get(VISION_ATTENTION) or ())
    if layers and vision_depth is None:
        raise ValueError(f"pruning selector {name!r} needs ViT attention; this model adapter provides none")
    layers = tuple(sorted({normalize_block(layer, vision_depth, name) for layer in layers}))
    hidden = bool(requires.get(VISION_HIDDEN, False))
    if not layers and not hidden:
        return {}
    return {VISION_ATTENTION: layers, VISION_HIDDEN: hidden}


def select_kept(pruning: str | Selector, ctx: SelectionContext) -> torch.Tensor:
    """Runs a selector and checks its answer: sorted unique indices, exactly ``budgets[m]`` inside span ``m``."""
    name = pruning if isinstance(pruning, str) else getattr(pruning, "__name__", repr(pruning))
    kept: Any = get_selector(pruning)(ctx)
    if not isinstance(kept, torch.Tensor) or kept.dtype not in (torch.int64, torch.int32) or kept.ndim != 1:
        raise ValueError(f"pruning selector {name!r} must return a 1-D LongTensor of indices, got {kept!r}")
    # checked in numpy: a few small array ops (torch's CPU ops on ~10^3 elements cost more in dispatch than in work)
    kept = np.sort(kept.cpu().numpy()).astype(np.int64)
    if kept.size > 1 and bool((kept[1:] == kept[:-1]).any()):
        raise ValueError(f"pruning selector {name!r} returned duplicate indices")
    inside = 0
    for m, ((start, stop), budget) in enumerate(zip(ctx.spans, ctx.budgets)):
        count = int(np.searchsorted(kept, stop) - np.searchsorted(kept, start))
        if count != budget:
            raise ValueError(
                f"pruning selector {name!r} kept {count} tokens in span {m} ({start}..{stop}); "
                f"its budget is exactly {budget}"
            )
        inside += count
    if inside != kept.size:
        outside = [int(k) for k in kept if not any(start <= k < stop for start, stop in ctx.spans)]
        raise ValueError(f"pruning selector {name!r} returned indices outside the placeholder spans: {outside}")
    return torch.from_numpy(kept)


# ------------------------------------------------------------------------------------------------------ helpers
def span_groups(ctx: SelectionContext) -> dict[tuple[int, int], list[int]]:
    """Spans to select in, grouped by ``(N_m, budget)`` (e.g. the frames of a video) so that one batched pass
    serves them all; spans whose budget is 0 or all of their tokens are left out (nothing to choose)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for m, ((start, stop), budget) in enumerate(zip(ctx.spans, ctx.budgets)):
        n = stop - start
        if 0 < budget < n:
            groups.setdefault((n, budget), []).append(m)
    return groups


def stacked_spans(spans: list[torch.Tensor]) -> torch.Tensor:
    """``[B, N, D]`` from the ``[N, D]`` rows of a group's B spans (`span_groups`; one span: a view, no copy)."""
    return spans[0].unsqueeze(0) if len(spans) == 1 else torch.stack(spans)


def assemble(ctx: SelectionContext, chosen: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """Kept indices into ``input_ids`` (sorted) from per-span offsets ``chosen[m]`` (any order); spans not in
    `chosen` keep all their tokens when their budget says so, none when it is 0. The chosen offsets come to the
    host in one copy (one synchronisation however many spans, e.g. the frames of a video)."""
    picked = [m for m in range(len(ctx.spans)) if m in chosen]
    if len(picked) == 1:
        host = chosen[picked[0]].cpu().numpy().reshape(-1)
    elif picked:
        device = chosen[picked[0]].device
        host = torch.cat([chosen[m].reshape(-1).to(device) for m in picked]).cpu().numpy()
    parts, at = [], 0
    for m, ((start, stop), budget) in enumerate(zip(ctx.spans, ctx.budgets)):
        if m in chosen:
            size = chosen[m].numel()
            offsets = np.sort(host[at : at + size]).astype(np.int64)
            at += size
        elif budget >= stop - start:
            offsets = np.arange(stop - start, dtype=np.int64)
        elif budget <= 0:
            offsets = np.zeros(0, dtype=np.int64)
        else:
            raise AssertionError(f"span {m}: no choice made for a budget of {budget} out of {stop - start}")
        parts.append(start + offsets)
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.long)
