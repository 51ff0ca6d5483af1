"""`divprune`: DivPrune, max-min diversity of the visual tokens (not query-aware).

Alvar et al., "DivPrune: Diversity-based Visual Token Pruning for Large Multimodal Models" (CVPR 2025);
official code vbdi/divprune (``LLaVA/llava/model/llava_arch.py``).

Per span (an image or a video frame) of ``N`` tokens with budget ``b``, on the placeholder embeddings
``v_i`` (vision tower output in the LLM space), in fp32, with ``d_ij = 1 - cos(v_i, v_j)``:

1. first token: ``argmax_i min_{j != i} d_ij``;
2. then, ``b - 1`` times: ``argmax_{i not in S} min_{s in S} d_is``;

ties go to the lowest index; the kept indices are returned sorted. Better than the official loop: a running
minimum (``O(bN)`` after the ``O(N^2 D)`` similarity matrix, instead of re-reducing ``|S| x N`` every step),
chosen tokens excluded (the official code can pick a token twice), per-span budgets, spans of equal size and
budget (the frames of a video) selected in one batched pass, and on CUDA the loop as one Triton kernel
(`hf_raincheck.pruning.greedy_triton`, same picks) or, without Triton, replayed as a CUDA graph
(`hf_raincheck.pruning.greedy`). Computed as ``argmin max cos`` (the same order, and exact ties stay ties).
No options.
"""

from __future__ import annotations

import torch

from ..triton_support import triton_enabled
from .base import SelectionContext, assemble, register_selector, span_groups, stacked_spans
from .greedy import run_greedy


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """Rows of `x` in fp32 divided by their norm (clamped at 1e-8, as the official MMTok / DivPrune code)."""
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-8)


@torch.no_grad()
def divprune_order(features: torch.Tensor, budget: int) -> torch.Tensor:
    """DivPrune on a batch of spans: ``features [B, N, D]`` -> ``[B, budget]`` offsets in selection order."""
    batch, n, _ = features.shape
    device = features.device
    x = l2_normalize(features)
    sim = torch.matmul(x, x.transpose(1, 2))  # [B, N, N] cos
    order = torch.empty(batch, budget, dtype=torch.long, device=device)
    if budget == 0:
        return order
    rows = torch.arange(batch, device=device)
    # step 1: min_{j != i} d_ij  <=>  max_{j != i} cos_ij; keep the smallest
    eye = torch.eye(n, dtype=torch.bool, device=device)
    pick = sim.masked_fill(eye, float("-inf")).amax(dim=-1).argmin(dim=-1)  # [B]
    order[:, 0] = pick
    nearest = sim[rows, pick].clone()  # [B, N] running max cos to the chosen set (= running min distance)
    nearest[rows, pick] = float("inf")  # chosen: never again
    if triton_enabled(device):  # the whole loop in one kernel (same picks)
        from . import greedy_triton

        if greedy_triton.divprune_fits(n):
            return greedy_triton.divprune_steps_triton(sim, nearest, order, 1, budget)
    run_greedy("divprune", {"sim": sim, "nearest": nearest, "rows": rows}, _divprune_step, order, 1, budget)
    return order


def _divprune_step(state: dict, picks: torch.Tensor, s: int) -> None:
    """One max-min step: the token farthest from the chosen set (lowest index on ties), then the running max."""
    sim, nearest, rows = state["sim"], state["nearest"], state["rows"]
    pick = nearest.argmin(dim=-1)
    picks[:, s] = pick
    torch.maximum(nearest, sim[rows, pick], out=nearest)
    nearest.scatter_(1, pick[:, None], float("inf"))  # a scalar fill: no host tensor (CUDA-graph safe)


@register_selector("divprune")
def select_divprune(ctx: SelectionContext) -> torch.Tensor:
    select_divprune.options.resolve(ctx.options)
    chosen = {}
    for (n, budget), members in span_groups(ctx).items():
        feats = stacked_spans([ctx.span_embeddings(m) for m in members])
        order = divprune_order(feats, budget)
        chosen.update({m: order[i] for i, m in enumerate(members)})
    return assemble(ctx, chosen)
