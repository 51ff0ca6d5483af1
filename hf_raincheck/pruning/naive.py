"""Plain-loop references of the selectors, written straight from the formulas (float64 Python, no vectorisation).

For tests only (they are slow: keep inputs small). Each ``naive_<name>(ctx)`` returns the sorted kept indices into
``ctx.input_ids`` like the registered selector of that name, span by span, ties to the lowest index.
"""

from __future__ import annotations

import math

import torch

from .base import VISION_DEPTH, SelectionContext


def _rows(x: torch.Tensor) -> list[list[float]]:
    return x.detach().to("cpu", torch.float64).tolist()


def _normalized(rows: list[list[float]]) -> list[list[float]]:
    out = []
    for r in rows:
        norm = max(math.sqrt(sum(v * v for v in r)), 1e-8)
        out.append([v / norm for v in r])
    return out


def _dot(a: list[float], b: list[float]) -> float:
    return sum(u * v for u, v in zip(a, b))


def _argmax(values: dict[int, float]) -> int:
    """The key with the largest value, the lowest key on ties."""
    best_key, best_val = None, None
    for key in sorted(values):
        if best_val is None or values[key] > best_val:
            best_key, best_val = key, values[key]
    return best_key


def _by_score(scores: list[float]) -> list[int]:
    """Indices by descending score, ties by ascending index."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


def _softmax(values: list[float]) -> list[float]:
    top = max(values)
    e = [math.exp(v - top) for v in values]
    s = sum(e)
    return [v / s for v in e]


# ----------------------------------------------------------------------------------------------- per span
def divprune_span(features: torch.Tensor, budget: int) -> list[int]:
    v = _normalized(_rows(features))
    n = len(v)
    d = [[1.0 - _dot(v[i], v[j]) for j in range(n)] for i in range(n)]
    chosen: list[int] = []
    for _ in range(budget):
        if not chosen:
            scores = {i: min((d[i][j] for j in range(n) if j != i), default=math.inf) for i in range(n)}
        else:
            scores = {i: min(d[i][s] for s in chosen) for i in range(n) if i not in chosen}
        chosen.append(_argmax(scores))
    return sorted(chosen)


def mmtok_span(x, x_c, z, budget: int, alpha: float, tau_tv: float, tau_vv: float) -> list[int]:
    xn, xcn, zn = _normalized(_rows(x)), _normalized(_rows(x_c)), _normalized(_rows(z))
    n, m = len(xn), len(zn)
    cover = []  # rows r of C = [P; alpha Q], columns j
    for zr in zn:
        p = _softmax([_dot(zr, xj) / tau_tv for xj in xn])
        cover.append([pj / m for pj in p])
    for xr in xcn:
        q = _softmax([_dot(xr, xj) / tau_vv for xj in xcn])
        cover.append([alpha * qj / n for qj in q])

    def coverage(subset: list[int]) -> float:  # f(S) = sum_r max_{j in S} C_rj
        return sum(max((row[j] for j in subset), default=0.0) for row in cover)

    chosen: list[int] = []
    for _ in range(budget):
        base = coverage(chosen)
        gains = {j: coverage(chosen + [j]) - base for j in range(n) if j not in chosen}
        chosen.append(_argmax(gains))
    return sorted(chosen)


def hiprune_span(obj_scores, reg_scores, grid_hw: tuple[int, int], budget: int, alpha: float) -> list[int]:
    obj, reg = [float(v) for v in obj_scores.tolist()], [float(v) for v in reg_scores.tolist()]
    h, w = grid_hw
    n = len(obj)
    anchors = _by_score(obj)[: min(budget, int(round(alpha * budget / 5)))]
    candidates = list(anchors)
    candidates += [i - 1 for i in anchors if i % w != 0]  # left, same row
    candidates += [i + 1 for i in anchors if i % w != w - 1]  # right, same row
    candidates += [i - w for i in anchors if i // w > 0]  # up
    candidates += [i + w for i in anchors if i // w < h - 1]  # down
    chosen: list[int] = []
    for c in candidates:
        if c not in chosen and len(chosen) < budget:
            chosen.append(c)
    rest = [i for i in _by_score(reg) if i not in chosen]
    chosen += rest[: budget - len(chosen)]
    assert len(chosen) == budget and n >= budget
    return sorted(chosen)


def visionzip_span(scores, budget: int) -> list[int]:
    return sorted(_by_score([float(v) for v in scores.tolist()])[:budget])


# ----------------------------------------------------------------------------------------------- contexts
def _collect(ctx: SelectionContext, pick) -> torch.Tensor:
    kept = []
    for m, ((start, stop), budget) in enumerate(zip(ctx.spans, ctx.budgets)):
        n = stop - start
        offsets = list(range(n)) if budget >= n else pick(m, budget)
        kept += [start + o for o in offsets]
    return torch.tensor(sorted(kept), dtype=torch.long)


def _block(ctx: SelectionContext, layer: int | None) -> int:
    layer = -1 if layer is None else layer
    return layer if layer >= 0 else layer + int(ctx.extras[VISION_DEPTH])


def naive_divprune(ctx: SelectionContext) -> torch.Tensor:
    return _collect(ctx, lambda m, b: divprune_span(ctx.span_embeddings(m), b))


def naive_mmtok(ctx: SelectionContext, alpha: float = 0.5, tau_tv: float = 0.01, tau_vv: float = 0.2) -> torch.Tensor:
    return _collect(
        ctx,
        lambda m, b: mmtok_span(
            ctx.span_embeddings(m), ctx.span_vision_hidden(m), ctx.query_embeds, b, alpha, tau_tv, tau_vv
        ),
    )


def naive_hiprune(ctx: SelectionContext, alpha: float = 0.1, object_layer: int | None = None, register_layer: int = -1):
    if object_layer is None:
        object_layer = (int(ctx.extras[VISION_DEPTH]) - 1) // 2
    att = ctx.extras["vision_attention"]
    obj, reg = att[_block(ctx, object_layer)], att[_block(ctx, register_layer)]

    def pick(m, b):
        rows = ctx.span_rows(m)
        _, h, w = ctx.grids[m]
        return hiprune_span(obj[rows], reg[rows], (h, w), b, alpha)

    return _collect(ctx, pick)


def naive_visionzip(ctx: SelectionContext, layer: int = -1) -> torch.Tensor:
    scores = ctx.extras["vision_attention"][_block(ctx, layer)]
    return _collect(ctx, lambda m, b: visionzip_span(scores[ctx.span_rows(m)], b))


NAIVE = {"divprune": naive_divprune, "mmtok": naive_mmtok, "hiprune": naive_hiprune, "visionzip": naive_visionzip}
