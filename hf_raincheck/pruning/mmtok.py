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
``tau_vv`` 0.2 (vision-vision temperature, > 0). Two more choose how the greedy runs, never what it picks
(`EXECUTION_OPTIONS`; for benchmarks and debugging):

- ``late_stage`` (Triton kernel only): ``"auto"`` (default: the late stage of
  `hf_raincheck.pruning.greedy_triton.coverage_stages`, from step ``LATE_STEP`` with ``LATE_SPLITS`` programs
  where it applies), ``"off"`` (the whole greedy in one launch), or a list ``[step, splits]`` /
  ``[step, splits, warps, list_len]``: from `step` on, the greedy goes on in a second launch, the late kernel,
  with `splits` programs per span (and that launch's warps per program and rows per column list);
- ``cuda_graphs`` (torch loops on CUDA): True (default) replays the greedy loop as CUDA graphs
  (`hf_raincheck.pruning.greedy`), False runs it eagerly.

Differences from the official code: the question is embedded from the conversation's own tokens (no
``"Question: "`` prefix and no re-tokenisation: Raincheck sees token ids, not text); an empty question
(``m = 0``) leaves only the vision-vision term (the official code would divide by zero); budgets are per span,
and spans of equal size and budget (video frames) run as one batch.

Selection: exact lazy ("accelerated") greedy. Coverage is submodular: a column's gain never grows as ``best`` does,
so a gain computed at an earlier step (stale) bounds it from above. Each column keeps its latest gain as a rank
``j - (W + 1) g_j`` (int64, smaller = better: larger gain, then lower index; ``W`` the padded width), so ranks of
unchosen columns are distinct and `topk` / `min` have no ties to break. A step takes the ``k + 1`` smallest
ranks (``k = LAZY_K = 64``), evaluates the first ``k`` exactly (a ``[B, R, k]`` gather), stores their ranks, and
picks the smallest of them. The pick is certified when its rank is below the ``(k + 1)``-th stale rank: every
other column's current rank is at least its stale rank, which is at least that one, so the pick is the full
greedy's (ties included: equal gains order by index inside the rank). A step that cannot certify (rare; e.g. when
many gains drop together) flags itself; the loop (`hf_raincheck.pruning.greedy`, ``Checked``) reads the flags
once per chunk of 16 steps, keeps the picks before the first flagged step, rewinds to there (ranks saved before
the chunk, still bounds; ``best`` from the kept picks), evaluates every column (`_refresh`, one ``[B, R, n]`` pass)
and goes on. After a refresh every rank is exact, so the next step certifies: each chunk makes progress. No host
synchronisation inside a step; on CUDA the chunk (and the refresh) are CUDA graphs. Where Triton runs
(`kernel_runs`: CUDA), the whole full greedy is one kernel instead, after one preparation pass over the matrix
(`hf_raincheck.pruning.greedy_triton`: the scaled transpose and the initial gains; then gains kept incrementally
over the rows each pick changes, the same fixed-point arithmetic, so the same picks), for spans of every size.
``k = 64``: the fallbacks counted on covers of this shape were a few per span (1 at n = 1024, ~2-7 at n = 4096,
b = 0.3 n; smaller k costs more fallbacks, larger k more work per step).

Exactness of the gains: floating-point sums depend on the reduction order, which PyTorch chooses by shape (on CPU
a column of ``[B, R, 37]`` and the same column gathered into ``[B, R, 16]`` sum to different bits), so the
candidates' gains and a full evaluation could disagree in the last bit, and a stale bound could fall below the
current gain. The gains are therefore fixed point: the matrix is scaled by a power of two (exact; as two factors
computed on the device, `fixed_point_scales`, so no host synchronisation) so that
every column's total stays below ``2^61 / (W + 1)``; each term ``max(C, best) - best`` (= ``max(0, C - best)``,
an fp32 elementwise op, the same bits wherever it runs) is truncated to int64 and summed in int64, which is exact
and independent of order, shape and device. So the lazy step, the refresh, the full greedy (``lazy=False``) and
the CPU and CUDA paths all compute the same gains, monotone in ``best`` (rounding and truncation are monotone),
and pick the same columns. The truncation error is below ``R`` units (a unit is ~1e-14 of the largest column total at
n = 4096), far below fp32 rounding; the previous dense implementation (fp32 sums,
`dense_greedy_coverage_order`) picks the same columns except where two gains agree to fp32 rounding.

Cost: ``O(n^2 D)`` for the matrix, then per step ``O(n)`` (topk over the ranks) + ``O(R k)`` (the candidates),
plus ``O(R n)`` per refresh (once at the start, once per fallback).
"""

from __future__ import annotations

from typing import Any

import torch

from ..triton_support import triton_enabled
from .base import (VISION_HIDDEN, SelectionContext, assemble, check_float, register_selector, span_groups,
                   stacked_spans)
from .divprune import l2_normalize
from .greedy import CHUNK, Checked, run_greedy

DEFAULTS = {"alpha": 0.5, "tau_tv": 0.01, "tau_vv": 0.2, "late_stage": "auto", "cuda_graphs": True}
#: the options that choose how the greedy runs, not which tokens it picks (references ignore them)
EXECUTION_OPTIONS = ("late_stage", "cuda_graphs")
_WARPS = (1, 2, 4, 8, 16, 32)


def _check_late_stage(selector: str, value: Any):
    """``"auto"``, ``"off"``, or ``[step >= 0, splits >= 1]`` / ``[step, splits, warps, list_len]`` (a tuple)."""
    if value in ("auto", "off"):
        return value
    ints = isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if (ints and len(value) in (2, 4) and value[0] >= 0 and value[1] >= 1
            and (len(value) == 2 or (value[2] in _WARPS and value[3] >= 1 and not value[3] & (value[3] - 1)))):
        return tuple(value)
    raise ValueError(f"pruning option 'late_stage' of {selector!r} must be 'auto', 'off', [step, splits] or "
                     f"[step, splits, warps, list_len] (step >= 0, splits >= 1, warps in {list(_WARPS)}, list_len a "
                     f"power of two), got {value!r}")


def _check_cuda_graphs(selector: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"pruning option 'cuda_graphs' of {selector!r} must be True or False, got {value!r}")
    return value


CHECKS = {
    "alpha": check_float("alpha", 0.0),
    "tau_tv": check_float("tau_tv", 0.0, low_open=True),
    "tau_vv": check_float("tau_vv", 0.0, low_open=True),
    "late_stage": _check_late_stage,
    "cuda_graphs": _check_cuda_graphs,
}
#: ``late_stage="off"`` as a `greedy_triton.coverage_stages` late stage: a step no greedy reaches (one launch)
ONE_LAUNCH = (1 << 62, 1)


def late_stage_tuple(option) -> tuple[int, ...] | None:
    """The ``late_stage`` option as `greedy_triton.coverage_order_triton`'s `late` (None: its default)."""
    if option == "auto":
        return None
    return ONE_LAUNCH if option == "off" else tuple(option)


def coverage_matrix(x, x_c, z, alpha: float, tau_tv: float, tau_vv: float) -> torch.Tensor:
    """``C = [P; alpha Q]`` for a batch of spans: ``x [B, n, H]``, ``x_c [B, n, D]``, ``z [m, H]`` -> ``[B, m + n, n]``.

    Written for few passes over the ``[n, n]`` matrices: the temperature is the product's own scale
    (``baddbmm``'s ``alpha``), the softmax is scaled by ``alpha / n`` straight into its rows of the result, and ``P``
    divides the question-by-token products by the tokens' norms instead of normalising ``x`` (the same values to
    float rounding)."""
    n, m = x.shape[1], z.shape[0]
    xc = l2_normalize(x_c)
    logits = torch.baddbmm(xc.new_empty(xc.shape[0], n, n), xc, xc.transpose(1, 2), beta=0, alpha=1.0 / tau_vv)
    q = torch.softmax(logits, dim=-1)
    if m == 0:
        return q.mul_(alpha / n)
    cover = torch.empty(q.shape[0], m + n, n, dtype=q.dtype, device=q.device)
    torch.mul(q, alpha / n, out=cover[:, m:])
    del logits, q
    xf = x.float()
    norms = xf.norm(dim=-1).clamp_min_(1e-8).mul_(tau_tv)  # [B, n]: |x_j| tau_tv
    p = torch.matmul(l2_normalize(z).to(xf.device), xf.transpose(1, 2)).div_(norms[:, None, :])
    cover[:, :m] = torch.softmax(p, dim=-1).div_(m)
    return cover


# ----------------------------------------------------------------------------------------------- lazy greedy
LAZY_K = 64  # candidates evaluated per lazy step
# spans of at least this many tokens use the lazy greedy; smaller ones the dense step (one image, retention 0.3,
# CUDA graphs: at 4096 tokens the lazy greedy was faster, at 1024 the dense step was, by a wider margin; the crossover
# between them was not measured)
LAZY_MIN_TOKENS = 2048
TAKEN = 1 << 62  # rank of a chosen column: after every unchosen one, before the padding


def fixed_point_scales(cover: torch.Tensor, width: int) -> torch.Tensor:
    """Two powers of two ``[s1, s2]`` (fp32, on `cover`'s device, no host synchronisation) such that ``cover * s1
    * s2`` (`fixed_point`) has every column's positive total below ``2^61 / (width + 1)``: gains are integers in
    units of ``2^-e`` (``e`` = log2 of ``s1 s2``, as large as that allows) and ranks ``j - (width + 1) g`` fit in
    int64. Two factors, ``2^floor(e / 2)`` then the rest, keep each within fp32's normal range for any fp32 mass
    (``e`` lies in [-81, 195] for width 4096); multiplying by them is exact unless a result falls below fp32's
    normal range (only when scaling down, i.e. a column mass of 2^47 or more)."""
    if cover.numel():
        mass = cover.clamp_min(0).sum(dim=1).amax()
    else:
        mass = torch.zeros((), dtype=torch.float, device=cover.device)
    exponent = torch.frexp(mass.float()).exponent.to(torch.int32)  # mass < 2^exponent (0 for a mass of 0)
    e = 60 - (width + 1).bit_length() - exponent
    first = torch.div(e, 2, rounding_mode="floor")
    powers = torch.stack([first, e - first]).clamp(-126, 127)
    return ((powers + 127) << 23).view(torch.float32)  # 2^k from its fp32 bits: exact


def fixed_point(cover: torch.Tensor, width: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """``cover [B, R, n]`` (fp32) times the two powers of two of `fixed_point_scales` (exact; see there)."""
    scales = fixed_point_scales(cover, width) if scales is None else scales
    return cover * scales[0] * scales[1]


def initial_gains(scaled: torch.Tensor) -> torch.Tensor:
    """Every column's fixed-point gain with nothing chosen yet (``best = 0``): int64 ``[B, n]``."""
    zeros = torch.zeros(scaled.shape[0], scaled.shape[1], 1, dtype=torch.float, device=scaled.device)
    return _gains(scaled, zeros)


@torch.no_grad()
def greedy_coverage_order(
    cover: torch.Tensor, budget: int, lazy: bool = True, k: int | None = None, graphs: bool = True,
    late: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Greedy maximum coverage on ``cover [B, R, n]`` -> ``[B, budget]`` column offsets in selection order.

    ``lazy=False`` runs the full greedy (every step evaluates every column, with the same arithmetic: the same
    picks, slower); `k` overrides `LAZY_K`. Where the Triton kernel runs, `late` is its late stage
    (`late_stage_tuple`); elsewhere ``graphs=False`` runs the torch loop eagerly on CUDA too (`run_greedy`)."""
    batch, rows_n, n = cover.shape
    device = cover.device
    k = LAZY_K if k is None else k
    order = torch.empty(batch, budget, dtype=torch.long, device=device)
    if budget <= 0:
        return order
    width = max(n, k)  # columns, padded with zero columns if needed: topk always finds k candidates
    cover = cover.float()
    scales = fixed_point_scales(cover, width)
    if lazy and kernel_runs(device, rows_n):  # one kernel pair, same gains and picks
        picked = _kernels().coverage_order_triton(cover, scales, budget, width + 1, late=late)
        if picked is not None:
            return picked
    scaled = fixed_point(cover, width, scales)
    if width > n:  # zero columns (zero after scaling too)
        scaled = torch.cat([scaled, scaled.new_zeros(batch, rows_n, width - n)], dim=2)
    cols = torch.arange(width + 1, device=device)
    # real columns: no bound yet (the first refresh evaluates them); padding n .. width: after everything, distinct
    rank = torch.where(cols < n, torch.iinfo(torch.long).min, (1 << 63) - 1 - (width - cols))
    state = {
        "cover": scaled.contiguous(),
        "best": torch.zeros(batch, rows_n, 1, dtype=torch.float, device=device),  # best_r so far (scaled)
        "rank": rank.expand(batch, -1).contiguous(),  # per column: a bound of its gain as a rank (smaller = better)
        "cols": cols,
        "fail": torch.zeros(batch, CHUNK, dtype=torch.bool, device=device),
        "rows": torch.arange(batch, device=device),
        "k": torch.empty(k, dtype=torch.bool, device=device),  # carries k as a shape (part of the graph's key)
    }
    if lazy:
        check = Checked(flag="fail", mutable=("best", "rank"), rewind=_rewind, refresh=_refresh)
        run_greedy("mmtok", state, _lazy_step, order, 0, budget, check=check, graphs=graphs)
    else:
        run_greedy("mmtok-full", state, _full_step, order, 0, budget, graphs=graphs)
    return order


def _kernels():
    """`hf_raincheck.pruning.greedy_triton`, imported on first use (CPU installs may have no Triton)."""
    from . import greedy_triton

    return greedy_triton


def kernel_runs(device: torch.device, rows_n: int) -> bool:
    """Whether `greedy_coverage_order` runs the Triton kernel for covers of `rows_n` rows on `device`."""
    return triton_enabled(device) and _kernels().coverage_fits(rows_n)


def _gains(cols: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """``sum_r max(0, C_rj - best_r)`` of the columns ``cols [B, R, c]`` -> int64 ``[B, c]`` (fixed point).

    Each term is computed in fp32 (``max(C, best) - best``, an elementwise op) and truncated to an integer; the
    sum is then exact (integers, no overflow), so a column's gain does not depend on which columns are computed
    with it, nor on the reduction order (the candidates' ``[B, R, k]`` slice and the full ``[B, R, n]`` matrix
    give the same bits)."""
    work = torch.maximum(cols, best)
    work.sub_(best)
    return work.sum(dim=1, dtype=torch.long)


def _refresh(state: dict) -> None:
    """Every column evaluated: ranks exact (chosen columns and the padding keep theirs)."""
    cover, rank, cols = state["cover"], state["rank"], state["cols"]
    width = cover.shape[2]
    exact = torch.sub(cols[:width], _gains(cover, state["best"]), alpha=width + 1)
    torch.maximum(exact, rank[:, :width], out=rank[:, :width])


def _evaluate(state: dict):
    """The k columns of smallest rank, evaluated exactly (their ranks updated) -> (the k + 1 smallest ranks before
    the update [B, k + 1], the candidates [B, k], their exact ranks [B, k])."""
    cover, best, rank = state["cover"], state["best"], state["rank"]
    batch, rows_n, width = cover.shape
    k = state["k"].shape[0]
    top_rank, top = torch.topk(rank, k + 1, dim=1, largest=False, sorted=True)
    cand = top[:, :k]
    cols = torch.gather(cover, 2, cand[:, None, :].expand(batch, rows_n, k))
    exact = torch.sub(cand, _gains(cols, best), alpha=width + 1)
    exact = torch.maximum(exact, top_rank[:, :k])  # chosen columns stay chosen
    rank.scatter_(1, cand, exact)
    return top_rank, cand, exact


def _commit(state: dict, picks: torch.Tensor, s: int) -> None:
    """Takes the column ``picks[:, s]``."""
    cover, best, rank, rows = state["cover"], state["best"], state["rank"], state["rows"]
    pick = picks[:, s]
    torch.maximum(best, cover[rows, :, pick].unsqueeze(-1), out=best)
    rank.scatter_(1, pick[:, None], TAKEN)  # a scalar fill: no host tensor (CUDA-graph safe)


def _lazy_step(state: dict, picks: torch.Tensor, s: int) -> None:
    """One lazy step (no host synchronisation): the best of the k candidates; flags ``fail[:, s]`` where it is
    not certified (its exact rank not below the (k + 1)-th smallest rank, a bound for every other column)."""
    top_rank, cand, exact = _evaluate(state)
    low, at = exact.min(dim=1)
    torch.ge(low, top_rank[:, -1], out=state["fail"][:, s])
    torch.gather(cand, 1, at[:, None], out=picks[:, s : s + 1])
    _commit(state, picks, s)


def _rewind(state: dict, saved: dict, done: torch.Tensor) -> None:
    """The state after the steps that picked ``done [B, s]``, from the one saved before them (the ranks saved
    are still bounds: gains only decrease)."""
    state["rank"].copy_(saved["rank"])
    state["rank"].scatter_(1, done, TAKEN)
    best = saved["best"]
    if done.shape[1]:
        picked = torch.gather(state["cover"], 2, done[:, None, :].expand(-1, best.shape[1], -1))
        best = torch.maximum(best, picked.amax(dim=2, keepdim=True))
    state["best"].copy_(best)


def _full_step(state: dict, picks: torch.Tensor, s: int) -> None:
    """The full greedy step: every column evaluated, then the smallest rank."""
    _refresh(state)
    torch.argmin(state["rank"], dim=1, keepdim=True, out=picks[:, s : s + 1])
    _commit(state, picks, s)


# ----------------------------------------------------------------------------------------------- dense greedy
@torch.no_grad()
def dense_greedy_coverage_order(cover: torch.Tensor, budget: int, graphs: bool = True) -> torch.Tensor:
    """The previous implementation, for tests and benchmarks: every step reduces the whole ``[B, R, n]`` matrix
    (``sum(dim=1)`` over all columns at once). Its gains can differ from `greedy_coverage_order`'s in the last
    bit (another reduction order), so the two agree except where two gains are that close."""
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
    run_greedy("mmtok-dense", state, _coverage_step, order, 0, budget, graphs=graphs)
    return order


def _coverage_step(state: dict, picks: torch.Tensor, s: int) -> None:
    """One dense greedy step: the column of largest gain ``sum_r max(0, C_rj - best_r)`` (lowest index on ties)."""
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
    late = late_stage_tuple(opts["late_stage"])
    z = ctx.query_embeds
    chosen = {}
    for (n, budget), members in span_groups(ctx).items():
        x = stacked_spans([ctx.span_embeddings(m) for m in members])
        x_c = stacked_spans([ctx.span_vision_hidden(m, "mmtok") for m in members]).to(x.device)
        cover = coverage_matrix(x, x_c, z.to(x.device), opts["alpha"], opts["tau_tv"], opts["tau_vv"])
        exact = n >= LAZY_MIN_TOKENS or kernel_runs(cover.device, cover.shape[1])
        if exact:
            order = greedy_coverage_order(cover, budget, graphs=opts["cuda_graphs"], late=late)
        else:
            order = dense_greedy_coverage_order(cover, budget, graphs=opts["cuda_graphs"])
        chosen.update({m: order[i] for i, m in enumerate(members)})
    return assemble(ctx, chosen)
