"""`hiprune`: HiPrune, anchors / buffers / registers from the vision tower's attention (not query-aware).

Liu et al., "HiPrune: Training-Free Visual Token Pruning via Hierarchical Attention in Vision Encoders" (2025);
official code Danielement321/HiPrune (``Qwen2_5_VL/qwen2_5_vl_HiPrune.py``).

Scores: the ViT attention each merged token receives (``ctx.extras["vision_attention"]``: head mean, summed over
the queries of its image / frame, mean over its 2x2 patches, raster order), at two blocks only: the *object
layer* and the last block. Per span of ``N`` tokens on a merged grid ``h x w`` with budget ``b``:

1. anchors: the ``round(alpha * b / 5)`` tokens with the highest object-layer score;
2. buffers: the 4-neighbours (left, right, up, down on the merged grid, with the row-boundary check the official
   code lacks: no wrap-around from a row's end to the next row) of the anchors. Candidates in the order
   anchors (by score), then every anchor's left, right, up and down neighbour; duplicates dropped; cut at ``b``;
3. registers: the rest of the budget, the highest last-block scores among the tokens not chosen yet.

Ranking is by score, ties to the lowest index (the official ``topk`` leaves ties unspecified); ``round`` is
Python's (half to even), as in the official code. The official code also subtracts 1 from chosen tokens' deep
scores to exclude them, which does not always exclude them (scores are sums over queries): here they are excluded.

Options: ``alpha`` (default 0.1, in [0, 5]: share of the budget for anchors + buffers), ``object_layer`` (default
None: block ``(depth - 1) // 2``, 0-based, the middle block; this gives 15 for Qwen2.5-VL's 32 blocks, the official
choice ``HIPRUNE_OBJECT_LAYER=16`` 1-based, and 13 for Qwen3-VL's 27 blocks, its exact middle), ``register_layer``
(default -1: the last block). Block ids are 0-based; negative ids count from the end.
"""

from __future__ import annotations

import torch

from .base import (
    VISION_ATTENTION,
    VISION_DEPTH,
    SelectionContext,
    assemble,
    check_float,
    check_int_or_none,
    register_selector,
    span_groups,
)

DEFAULTS = {"alpha": 0.1, "object_layer": None, "register_layer": -1}
CHECKS = {
    "alpha": check_float("alpha", 0.0, 5.0),
    "object_layer": check_int_or_none("object_layer"),
    "register_layer": check_int_or_none("register_layer"),
}


def default_object_layer(depth: int) -> int:
    """HiPrune's object layer for a ViT of `depth` blocks: the middle block ``(depth - 1) // 2`` (0-based)."""
    return (depth - 1) // 2


def _layers(opts: dict, depth: int) -> tuple[int, int]:
    obj = opts["object_layer"]
    reg = opts["register_layer"]
    return (default_object_layer(depth) if obj is None else obj), (-1 if reg is None else reg)


def _requires(opts: dict, depth: int) -> dict:
    return {VISION_ATTENTION: list(_layers(opts, depth))}


def anchor_count(budget: int, alpha: float) -> int:
    return min(budget, int(round(alpha * budget / 5)))


def ranking(scores: torch.Tensor) -> torch.Tensor:
    """Indices by descending score, ties by ascending index (``[..., N]`` -> ``[..., N]``)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


@torch.no_grad()
def hiprune_keep(obj_scores: torch.Tensor, reg_scores: torch.Tensor, grid_hw: tuple[int, int], budget: int, alpha: float):
    """HiPrune on a batch of spans sharing a grid: scores ``[B, N]`` -> kept mask ``[B, N]`` (exactly `budget` each)."""
    batch, n = obj_scores.shape
    h, w = grid_hw
    device = obj_scores.device
    a = anchor_count(budget, alpha)
    anchors = ranking(obj_scores)[:, :a]  # [B, a]
    row, col = anchors // w, anchors % w
    invalid = torch.full_like(anchors, -1)
    neighbours = [
        torch.where(col > 0, anchors - 1, invalid),
        torch.where(col < w - 1, anchors + 1, invalid),
        torch.where(row > 0, anchors - w, invalid),
        torch.where(row < h - 1, anchors + w, invalid),
    ]
    candidates = torch.cat([anchors, *neighbours], dim=1)  # [B, 5a] in priority order, -1 = none
    # keep each token's first occurrence, then the first `budget` of those
    positions = torch.arange(candidates.shape[1], device=device).expand_as(candidates)
    big = candidates.shape[1]
    first_pos = torch.full((batch, n + 1), big, dtype=torch.long, device=device)
    first_pos.scatter_reduce_(1, candidates.clamp_min(-1) + 1, positions, reduce="amin")
    first_pos = first_pos[:, 1:]  # [B, N]: priority position of each token, `big` if not a candidate
    is_first = (candidates >= 0) & (first_pos.gather(1, candidates.clamp_min(0)) == positions)
    rank = torch.cumsum(is_first.long(), dim=1)
    take = is_first & (rank <= budget)
    keep = torch.zeros(batch, n + 1, dtype=torch.bool, device=device)
    keep.scatter_(1, torch.where(take, candidates + 1, torch.zeros_like(candidates)), True)
    keep = keep[:, 1:]
    # registers: the best last-block scores among the rest
    rest = budget - keep.sum(dim=1)  # [B]
    order = ranking(reg_scores.masked_fill(keep, float("-inf")))
    slot = torch.arange(n, device=device).expand(batch, n)
    keep.scatter_(1, order, (slot < rest[:, None]) | keep.gather(1, order))
    return keep


@register_selector("hiprune", options=DEFAULTS, checks=CHECKS, requires=_requires)
def select_hiprune(ctx: SelectionContext) -> torch.Tensor:
    opts = select_hiprune.options.resolve(ctx.options)
    obj_layer, reg_layer = opts["object_layer"], opts["register_layer"]
    if obj_layer is None:  # the default object layer depends on the tower's depth
        obj_layer = default_object_layer(int(ctx.require_extra(VISION_DEPTH, "hiprune")))
    if reg_layer is None:
        reg_layer = -1
    chosen = {}
    groups: dict[tuple, list[int]] = {}
    for (n, budget), members in span_groups(ctx).items():
        for m in members:
            t, h, w = ctx.grids[m]
            if t * h * w != n or t != 1:
                raise ValueError(f"hiprune: span {m} has {n} tokens but its merged grid is {ctx.grids[m]}")
            groups.setdefault((n, budget, h, w), []).append(m)
    for (n, budget, h, w), members in groups.items():
        obj = torch.stack([ctx.span_vision_attention(m, obj_layer, "hiprune") for m in members]).float()
        reg = torch.stack([ctx.span_vision_attention(m, reg_layer, "hiprune") for m in members]).float()
        keep = hiprune_keep(obj, reg.to(obj.device), (h, w), budget, opts["alpha"])
        chosen.update({m: keep[i].nonzero().squeeze(1) for i, m in enumerate(members)})
    return assemble(ctx, chosen)
