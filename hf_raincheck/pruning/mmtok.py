"""`mmtok`: MMTok, multimodal coverage maximisation (query-aware). The default selector.

Dong et al., "MMTok: Multimodal Coverage Maximization for Efficient Inference of VLMs" (2025); official code
Ironieser/MMTok (``mmtok/core/semantic_selector.py``, ``mmtok/qwen/``).

Per span (an image or a video frame) of ``n`` tokens with budget ``b``, all vectors L2-normalised, fp32:

- ``x``: the placeholder embeddings (merger output, LLM space), ``[n, H]``;
- ``x_c``: the last ViT block's output, mean-pooled over each merged token's 2x2 patches, ``[n, D_vit]``
  (``ctx.extras["vision_hidden"]``, requested through ``requires``);
- ``z``: the input embeddings of the question, ``[m, H]`` (``ctx.query_embeds``: the text of the current user
  turn, see `hf_raincheck.pruning.query`);
- ``P = softmax(z x^T / tau_tv, dim=1) / m`` (text-vision), ``Q = softmax(x_c x_c^T / tau_vv, dim=1) / n``
  (vision-vision), ``C = [P; alpha Q]`` (``(m + n) x n``);
- greedy maximum coverage of ``f(S) = sum_r max_{j in S} C_rj``: ``b`` times take
  ``argmax_{j not in S} sum_r max(0, C_rj - best_r)`` (lowest index on ties), then
  ``best = max(best, C[:, j])`` (``best`` starts at 0).

Options (``RaincheckConfig.pruning_options``), with the Qwen defaults of the official code:
``alpha`` 0.5 (weight of vision-vision coverage, >= 0), ``tau_tv`` 0.01 (text-vision temperature, > 0),
``tau_vv`` 0.2 (vision-vision temperature, > 0).

Differences from the official code: the question is embedded from the conversation's own tokens (no
``"Question: "`` prefix and no re-tokenisation: Raincheck sees token ids, not text); an empty question
(``m = 0``) leaves only the vision-vision term (the official code would divide by zero); budgets are per span,
and spans of equal size and budget (video frames) run as one batch. Cost: ``O(n^2 D + b (m + n) n)`` per span,
``b`` sequential steps of a few vectorised kernels each (no host synchronisation inside the loop; on CUDA replayed
as a CUDA graph, `hf_raincheck.pruning.greedy`).
"""

from __future__ import annotations

import torch

from .base import VISION_HIDDEN, SelectionContext, assemble, check_float, register_selector, span_groups
from .divprune import l2_normalize
from .greedy import run_greedy

DEFAULTS = {"alpha": 0.5, "tau_tv": 0.01, "tau_vv": 0.2}
CHECKS = {
    "alpha": check_float("alpha", 0.0),
    "tau_tv": check_float("tau_tv", 0.0, low_open=True),
    "tau_vv": check_float("tau_vv", 0.0, low_open=True),
}


def coverage_matrix(x, x_c, z, alpha: float, tau_tv: float, tau_vv: float) -> torch.Tensor:
    """``C = [P; alpha Q]`` for a batch of spans: ``x [B, n, H]``, ``x_c [B, n, D]``, ``z [m, H]`` -> ``[B, m + n, n]``."""
    n = x.shape[1]
    xc = l2_normalize(x_c)
    q = torch.softmax(torch.matmul(xc, xc.transpose(1, 2)) * (1.0 / tau_vv), dim=-1) / n
    if z.shape[0] == 0:
        return q * alpha
    xn = l2_normalize(x)
    zn = l2_normalize(z).to(xn.device)
    p = torch.softmax(torch.matmul(zn, xn.transpose(1, 2)) * (1.0 / tau_tv), dim=-1) / z.shape[0]
    return torch.cat([p, q * alpha], dim=1)


@torch.no_grad()
def greedy_coverage_order(cover: torch.Tensor, budget: int) -> torch.Tensor:
    """Greedy maximum coverage on ``cover [B, R, n]`` -> ``[B, budget]`` column offsets in selection order."""
    batch, rows_n, n = cover.shape
    device = cover.device
    order = torch.empty(batch, budget, dtype=torch.long, device=device)
    state = {
        "cover": cover,
        "best": torch.zeros(batch, rows_n, 1, dtype=cover.dtype, device=device),  # best_r so far
        "taken": torch.zeros(batch, n, dtype=cover.dtype, device=device),  # -inf once chosen
        "work": torch.empty_like(cover),
        "gain": torch.empty(batch, n, dtype=cover.dtype, device=device),
        "rows": torch.arange(batch, device=device),
    }
    run_greedy("mmtok", state, _coverage_step, order, 0, budget)
    return order


def _coverage_step(state: dict, picks: torch.Tensor, s: int) -> None:
    """One greedy step: the column of largest gain ``sum_r max(0, C_rj - best_r)`` (lowest index on ties)."""
    cover, best, taken, work, gain, rows = (state[k] for k in ("cover", "best", "taken", "work", "gain", "rows"))
    torch.sub(cover, best, out=work)
    work.clamp_min_(0)
    torch.sum(work, dim=1, out=gain)
    gain += taken
    pick = gain.argmax(dim=-1)  # [B]
    picks[:, s] = pick
    torch.maximum(best, cover[rows, :, pick].unsqueeze(-1), out=best)
    taken.scatter_(1, pick[:, None], float("-inf"))  # a scalar fill: no host tensor (CUDA-graph safe)


@register_selector("mmtok", options=DEFAULTS, checks=CHECKS, requires={VISION_HIDDEN: True})
def select_mmtok(ctx: SelectionContext) -> torch.Tensor:
    opts = select_mmtok.options.resolve(ctx.options)
    z = ctx.query_embeds
    chosen = {}
    for (n, budget), members in span_groups(ctx).items():
        x = torch.stack([ctx.span_embeddings(m) for m in members])
        x_c = torch.stack([ctx.span_vision_hidden(m, "mmtok") for m in members]).to(x.device)
        cover = coverage_matrix(x, x_c, z.to(x.device), opts["alpha"], opts["tau_tv"], opts["tau_vv"])
        order = greedy_coverage_order(cover, budget)
        chosen.update({m: order[i] for i, m in enumerate(members)})
    return assemble(ctx, chosen)
