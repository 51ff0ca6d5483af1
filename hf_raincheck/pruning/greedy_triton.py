"""Triton kernels for the greedy selectors: each runs a span's whole greedy loop in one launch.

The torch loops (`hf_raincheck.pruning.greedy`) replay a few small kernels per step from a CUDA graph; a greedy of
1229 steps (4096 tokens, retention 0.3) then spends its time in launch gaps and, for MMTok, in re-reading coverage
columns. Here the loop runs inside the kernel and the state stays in registers, so a step is a few dependent
loads and reductions.

- `divprune_order_triton`: one program per span. ``nearest`` (running max cosine to the chosen set) lives in
  registers; a step is an argmin (lowest index on ties) and one row of the similarity matrix. Same arithmetic as
  `hf_raincheck.pruning.divprune` (fp32 ``max``), so the same picks, bit for bit.
- `coverage_order_triton` (MMTok): the full greedy on the fixed-point gains of `hf_raincheck.pruning.mmtok`, kept
  *incrementally*. Taking column ``j`` changes ``best_r`` only on the rows where ``C_rj > best_r`` (at 4096 tokens
  with random features: 4120 rows at the first step, a median of 5 later, 29.5k over the 1229 steps), and a
  column's gain changes only by those rows' terms: ``g_c += sum_{r changed} t(C_rc, C_rj) - t(C_rc, best_r)`` with
  ``t(x, b) = trunc(max(x, b) - b)`` (int64). Integer sums are exact, so every gain equals a full evaluation's,
  and the picks are the full greedy's (`mmtok.greedy_coverage_order`, ``lazy=False``) bit for bit.
  The columns of a span are split over ``splits`` programs that run concurrently; each keeps its columns' gains and
  the whole ``best`` vector in registers (as two vectors, question rows and span rows, so that R = m + n is not
  padded to a power of two whole: 4120 -> 32 + 4096, not 8192). Per step each program stores its best rank in its
  own slot of the step (filled with INT64_MIN by the host, a value no rank takes) and reads the span's slots until
  none is INT64_MIN: a grid barrier of one store and one vector load, with no atomics and no fences (nothing else
  is published), which needs every program of a span resident at once (the host keeps the grid within the GPU's
  SM count). A program that waits too long (``SPIN_LIMIT`` polls: programs not co-resident, or Triton's
  interpreter, which runs programs one after another) raises the span's failure flag and stops; the host then runs
  the torch path for the batch. Long greedies run in two launches (`coverage_stages`): the first steps, which change
  many rows, on many programs (`_coverage_kernel`), the rest on fewer in the late kernel
  (`_coverage_late_kernel`); the state goes through memory between them.
- The late kernel finds the rows a pick raises without comparing its whole column: ``best`` only grows, so the
  rows column ``j`` can raise at any later step are among those it exceeds when the late stage starts. One pass
  (`_raising_rows_kernel`) lists them per column (ascending, at most `LIST_LEN`, with their entries; at steps 128
  and 256 of a 4096-token image the longest list held 38 and 25 rows, against 4120 in the column); a step then reads
  the taken column's list and ``best`` at its rows (``best`` in memory: a private copy per program, so no program
  reads another's writes), and goes on with the same compaction and gain update. A column whose list overflowed is
  compared whole, in chunks.
  The step has no whole-column compare and no 4120-wide compaction: ~1.6 us less per late step than the early
  kernel's (at 4096 tokens the loop runs in 6.9 ms on random features, 8.6-8.8 with the whole-column compare in the
  late stage; `benchmarks/greedy_kernels.py --late`). Tried and removed there: an
  L2 prefetch of the listed rows' cover entries as soon as the list arrives (1-2% at 8 programs, 5-10% slower at 4).
  Tried and removed: several picks per barrier round (each program proposing its K + 1 smallest ranks, later
  picks certified against the round's bounds without another barrier): a small gain at 4096 tokens, a loss at
  1024, because the barrier is not what a step waits on most. ``phases=`` (benchmarks) records where a step's time
  goes: taking the column (its load, the compare with ``best`` and the compaction of the changed rows) and the gain
  update (the compacted rows read back, their cover entries gathered) take most of it, the barrier less and the
  proposal little. Also tried: an L2 prefetch of each program's candidate column and row before the barrier (no
  gain), so the column load is not what the take waits on. The benchmarks page has the numbers.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..triton_support import sm_count

#: the largest register-resident vector a program keeps (DivPrune's ``nearest`` over N tokens, MMTok's ``best`` over
#: R = m + n rows, as the next power of two): sizes above run the torch loops. 8192 is the largest shape run on a
#: GPU (4096 tokens: R = 4120); beyond, the registers would spill
MAX_BLOCK = 8192
SPIN_LIMIT = 1 << 22  # polls of the barrier's slots before a program gives up (far beyond any real wait)
INT64_MAX = (1 << 63) - 1


# ---------------------------------------------------------------------------------------------------- divprune
@triton.jit
def _divprune_kernel(sim_ptr, nearest_ptr, order_ptr, n, start, budget, stride_sb, stride_sr, stride_nb, stride_ob,
                     BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    inside = offs < n
    near = tl.load(nearest_ptr + b * stride_nb + offs, mask=inside, other=float("inf"))
    base = sim_ptr + b * stride_sb
    for s in range(start, budget):
        low = tl.min(near, axis=0)
        pick = tl.min(tl.where(near == low, offs, BLOCK_N), axis=0)  # lowest index on ties
        tl.store(order_ptr + b * stride_ob + s, pick.to(tl.int64))
        row = tl.load(base + pick.to(tl.int64) * stride_sr + offs, mask=inside, other=float("inf"))
        near = tl.maximum(near, row)
        near = tl.where(offs == pick, float("inf"), near)


@torch.no_grad()
def divprune_steps_triton(sim: torch.Tensor, nearest: torch.Tensor, order: torch.Tensor, start: int, budget: int):
    """Steps ``start .. budget - 1`` of DivPrune's loop (`hf_raincheck.pruning.divprune._divprune_step`) on
    ``sim [B, N, N]`` (fp32), from ``nearest [B, N]`` (fp32, chosen = inf), writing ``order[:, start:budget]``."""
    batch, n, _ = sim.shape
    if budget <= start:
        return order
    sim = sim if sim.stride(2) == 1 else sim.contiguous()
    nearest = nearest.contiguous()
    block = max(16, triton.next_power_of_2(n))
    with _on(sim.device):
        _divprune_kernel[(batch,)](
            sim, nearest, order, n, start, budget, sim.stride(0), sim.stride(1), nearest.stride(0), order.stride(0),
            BLOCK_N=block, num_warps=_warps(block),
        )
    return order


def divprune_fits(n: int) -> bool:
    """Whether `divprune_steps_triton` takes spans of `n` tokens."""
    return triton.next_power_of_2(max(n, 1)) <= MAX_BLOCK


def coverage_fits(rows_n: int) -> bool:
    """Whether `coverage_order_triton` takes covers of `rows_n` rows (question tokens + span tokens)."""
    return triton.next_power_of_2(max(rows_n, 1)) <= MAX_BLOCK


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' (a model split over GPUs)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _warps(block: int) -> int:
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


# ------------------------------------------------------------------------------------------------------- mmtok
@triton.jit
def _coverage_kernel(
    cover_ptr, cover_t_ptr, scales_ptr, gain_ptr, best_ptr, taken_ptr, order_ptr, proposals_ptr, fail_ptr,
    scratch_rows_ptr, scratch_old_ptr, scratch_new_ptr, phases_ptr,
    n, m, budget, start, stop, ranks_w, proposal_stride,
    SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, TILE_R: tl.constexpr, SPIN: tl.constexpr, PHASES: tl.constexpr,
):
    """Steps ``start .. stop - 1`` of the full greedy of one span (``program_id(1)``) over the columns of split
    ``program_id(0)``; see the module docstring. The state comes from and goes back to memory: the columns' gains
    (``gain_ptr [B, n]``), ``best`` (``best_ptr [B, m + n]``) and the taken columns (``taken_ptr [B, n]``, int8),
    so that a later launch (another split count) goes on from ``stop``. With ``PHASES`` (benchmarks only), each
    program writes the SM clock at five points of every step to ``phases_ptr [B, budget, SPLITS, 5]`` (int64):
    start, proposal ready, barrier passed, column taken (``best`` and the changed rows), gains updated."""
    split, b, cover, cover_t, cols, col_in, gain, taken, s_rows, s_old, s_new, scale_1, scale_2 = _span_setup(
        cover_ptr, cover_t_ptr, scales_ptr, gain_ptr, taken_ptr, scratch_rows_ptr, scratch_old_ptr, scratch_new_ptr,
        n, m, SPLITS, BLOCK_C, BLOCK_M, BLOCK_N)
    rows_q, q_in, rows_v, v_in, best_q, best_v = _best_vectors(best_ptr + b * (m + n), m, n, BLOCK_M, BLOCK_N)
    others = tl.arange(0, SPLITS_P2)
    failed = 0
    for s in range(start, stop):
        if failed == 0:
            slot = b * budget + s
            at = phases_ptr + (slot * SPLITS + split) * 5
            if PHASES:
                tl.store(at, _clock(slot))
            low = _lowest_rank(cols, gain, taken, ranks_w)
            if PHASES:
                tl.store(at + 1, _clock(low))
            if SPLITS > 1:
                low, failed = _meet(low, proposals_ptr + slot * proposal_stride, split, others, SPLITS, fail_ptr + b,
                                    SPIN)
            if PHASES:
                tl.store(at + 2, _clock(low))
            if failed == 0:
                j = _column_of(low, ranks_w)
                if split == 0:
                    tl.store(order_ptr + slot, j)
                taken = taken | (cols == j)
                best_q, best_v, count = _take_column(cover_t, j, m, n, rows_q, q_in, rows_v, v_in, best_q, best_v,
                                                     s_rows, s_old, s_new)
                if PHASES:
                    tl.store(at + 3, _clock(count.to(tl.int64)))
                gain += _gain_changes(cover, cols, col_in, n, s_rows, s_old, s_new, count, scale_1, scale_2, BLOCK_C,
                                      TILE_R)
                if PHASES:
                    tl.store(at + 4, _clock(tl.min(gain, axis=0)))
                tl.debug_barrier()
    # the state for a later launch: every program its columns, program 0 the (shared) `best`
    tl.store(gain_ptr + b * n + cols, gain, mask=col_in)
    tl.store(taken_ptr + b * n + cols, taken.to(tl.int8), mask=col_in)
    if split == 0:
        tl.store(best_ptr + b * (m + n) + rows_q, best_q, mask=q_in)
        tl.store(best_ptr + b * (m + n) + m + rows_v, best_v, mask=v_in)


@triton.jit
def _lowest_rank(cols, gain, taken, ranks_w):
    """The smallest rank ``j - ranks_w * gain`` among a program's columns not taken (INT64_MAX if none)."""
    rank = cols.to(tl.int64) - ranks_w * gain
    rank = tl.where(taken, 9223372036854775807, rank)
    return tl.min(rank, axis=0)


@triton.jit
def _meet(low, row, split, others, SPLITS: tl.constexpr, fail, SPIN: tl.constexpr):
    """The per-step barrier: the program stores its proposal `low` in its own slot of the step's `row` (one
    store), then waits for the span's other programs' (`_wait_for_proposals`). Returns ``(the span's lowest rank,
    failed)``."""
    tl.store(row + split, low)
    seen, failed = _wait_for_proposals(row, others, SPLITS, fail, SPIN)
    return tl.min(seen, axis=0), failed


@triton.jit
def _column_of(low, ranks_w):
    """The column of rank `low`: ``rank = j - ranks_w * gain`` with ``0 <= j < ranks_w``, so j is the rank modulo
    ranks_w."""
    j = low % ranks_w
    return tl.where(j < 0, j + ranks_w, j)


@triton.jit
def _gain_changes(cover, cols, col_in, n, s_rows, s_old, s_new, count, scale_1, scale_2, BLOCK_C: tl.constexpr,
                  TILE_R: tl.constexpr):
    """The change of the program's columns' gains from the `count` compacted changed rows (``[BLOCK_C]`` int64):
    ``sum_r t(C_rc, new_r) - t(C_rc, old_r)``, the rows read in tiles of ``TILE_R``."""
    delta = tl.zeros([BLOCK_C], dtype=tl.int64)
    for t in range(0, count, TILE_R):
        r, old, new, k_in = _changed_rows(s_rows, s_old, s_new, t, count, TILE_R)
        x = tl.load(cover + r[:, None] * n + cols[None, :], mask=k_in[:, None] & col_in[None, :],
                    other=0.0) * scale_1 * scale_2
        delta += tl.sum(_gain_terms(x, old, new), axis=0)
    return delta


@triton.jit
def _clock(after):
    """The SM's cycle counter (``%clock64``; `PHASES` only), read once the int64 scalar `after` is computed (an
    input of the asm, so the read is not scheduled before it)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,l", [after], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _prepare_kernel(cover_ptr, scales_ptr, cover_t_ptr, gain_ptr, rows_n, n,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One pass over a span's cover ``[R, n]`` (fp32, unscaled) for `_coverage_kernel`: the scaled transpose
    ``cover_t [n, R]`` (`mmtok.fixed_point`'s values) and every column's initial gain (`mmtok.initial_gains`:
    ``sum_r trunc(max(C_rj, 0))`` of the scaled entries, int64), for a tile of ``BLOCK_C`` columns."""
    b = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_in = cols < n
    scale_1 = tl.load(scales_ptr)
    scale_2 = tl.load(scales_ptr + 1)
    gain = tl.zeros([BLOCK_C], dtype=tl.int64)
    for r0 in range(0, rows_n, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = (rows < rows_n)[:, None] & col_in[None, :]
        x = tl.load(cover_ptr + b * rows_n * n + rows[:, None] * n + cols[None, :], mask=ok, other=0.0)
        x = x * scale_1 * scale_2
        gain += tl.sum(tl.maximum(x, 0.0).to(tl.int64), axis=0)
        tl.store(cover_t_ptr + b * n * rows_n + cols[None, :] * rows_n + rows[:, None], x, mask=ok)
    tl.store(gain_ptr + b * n + cols, gain, mask=col_in)


@triton.jit
def _span_setup(cover_ptr, cover_t_ptr, scales_ptr, gain_ptr, taken_ptr, scratch_rows_ptr, scratch_old_ptr,
                scratch_new_ptr, n, m, SPLITS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """A program's view of its span: ``(split, b, cover [R, n], cover_t [n, R], its columns, which are real, their
    gains, taken (chosen columns and the padding), its three compaction buffers, the two fixed-point scales)``
    (`cover` is unscaled: its entries are scaled as they are read; `cover_t` is scaled)."""
    split = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows_n = m + n
    cover = cover_ptr + b * rows_n * n  # fp32, unscaled: question rows 0 .. m-1, then the span's n rows
    cover_t = cover_t_ptr + b * n * rows_n
    cols = split * BLOCK_C + tl.arange(0, BLOCK_C)
    col_in = cols < n
    gain = tl.load(gain_ptr + b * n + cols, mask=col_in, other=0)  # int64, exact fixed point
    taken = (tl.load(taken_ptr + b * n + cols, mask=col_in, other=1) != 0) | (cols >= n)  # padding: never a candidate
    at = (b * SPLITS + split) * (BLOCK_M + BLOCK_N)
    return split, b, cover, cover_t, cols, col_in, gain, taken, scratch_rows_ptr + at, scratch_old_ptr + at, \
        scratch_new_ptr + at, tl.load(scales_ptr), tl.load(scales_ptr + 1)


@triton.jit
def _best_vectors(best, m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``best`` (the span's ``[m + n]`` from memory: 0 before any pick) as two register vectors, question rows and
    span rows (R = m + n is not padded to a power of two whole), with their row offsets and masks: ``(rows_q, q_in,
    rows_v, v_in, best_q, best_v)``."""
    rows_q = tl.arange(0, BLOCK_M)
    rows_v = tl.arange(0, BLOCK_N)
    best_q = tl.load(best + rows_q, mask=rows_q < m, other=0.0)
    best_v = tl.load(best + m + rows_v, mask=rows_v < n, other=0.0)
    return rows_q, rows_q < m, rows_v, rows_v < n, best_q, best_v


@triton.jit
def _wait_for_proposals(row, others, filled, fail, SPIN: tl.constexpr):
    """The barrier's wait: reads the span's `filled` proposal slots at `row` until none is INT64_MIN (the host's
    fill, a value no rank takes). Nothing else is published, so no fence or atomic is needed: (usually) one load.
    After `SPIN` polls gives up, raising the span's `fail` flag. Returns ``(slots, failed)``."""
    seen = tl.load(row + others, mask=others < filled, other=9223372036854775807, volatile=True)
    spins = 0
    while (tl.min(seen, axis=0) == -9223372036854775807 - 1) & (spins < SPIN):
        seen = tl.load(row + others, mask=others < filled, other=9223372036854775807, volatile=True)
        spins += 1
    failed = 0
    if tl.min(seen, axis=0) == -9223372036854775807 - 1:
        tl.atomic_xchg(fail, 1)
        failed = 1
    return seen, failed


@triton.jit
def _take_column(cover_t, j, m, n, rows_q, q_in, rows_v, v_in, best_q, best_v, s_rows, s_old, s_new):
    """Column `j` taken: the rows it raises go to the compaction buffers (`_compact_changed`), then ``best`` rises.
    Returns ``(best_q, best_v, count of changed rows)``."""
    column = cover_t + j * (m + n)
    col_q = tl.load(column + rows_q, mask=q_in, other=0.0)
    col_v = tl.load(column + m + rows_v, mask=v_in, other=0.0)
    count = _compact_changed(col_q, col_v, best_q, best_v, rows_q, q_in, rows_v, v_in, m, s_rows, s_old, s_new)
    best_q = tl.maximum(best_q, col_q)
    best_v = tl.maximum(best_v, col_v)
    tl.debug_barrier()
    return best_q, best_v, count


@triton.jit
def _changed_rows(s_rows, s_old, s_new, t, count, TILE_R: tl.constexpr):
    """Tile `t` of the compacted changed rows: ``(row int64, old best, new best, valid)``, ``[TILE_R]`` each."""
    k = t + tl.arange(0, TILE_R)
    k_in = k < count
    r = tl.load(s_rows + k, mask=k_in, other=0).to(tl.int64)
    old = tl.load(s_old + k, mask=k_in, other=0.0)
    new = tl.load(s_new + k, mask=k_in, other=0.0)
    return r, old, new, k_in


@triton.jit
def _compact_changed(col_q, col_v, best_q, best_v, rows_q, q_in, rows_v, v_in, m, s_rows, s_old, s_new):
    """Writes the rows where the taken column raises ``best`` (row, old best, new value) to the front of the
    program's scratch buffers (question rows first); returns how many."""
    changed_q = (col_q > best_q) & q_in
    changed_v = (col_v > best_v) & v_in
    count_q = tl.sum(changed_q.to(tl.int32), axis=0)
    count = count_q + tl.sum(changed_v.to(tl.int32), axis=0)
    at_q = tl.cumsum(changed_q.to(tl.int32), axis=0) - 1
    at_v = count_q + tl.cumsum(changed_v.to(tl.int32), axis=0) - 1
    tl.store(s_rows + at_q, rows_q, mask=changed_q)
    tl.store(s_old + at_q, best_q, mask=changed_q)
    tl.store(s_new + at_q, col_q, mask=changed_q)
    tl.store(s_rows + at_v, m + rows_v, mask=changed_v)
    tl.store(s_old + at_v, best_v, mask=changed_v)
    tl.store(s_new + at_v, col_v, mask=changed_v)
    return count


@triton.jit
def _gain_terms(x, old, new):
    """``t(x, new) - t(x, old)`` per row (``t(x, b) = trunc(max(x, b) - b)``, int64) for ``x [rows, cols]``."""
    t_new = (tl.maximum(x, new[:, None]) - new[:, None]).to(tl.int64)
    t_old = (tl.maximum(x, old[:, None]) - old[:, None]).to(tl.int64)
    return t_new - t_old



# ---------------------------------------------------------------------------------------- mmtok, late stage
@triton.jit
def _raising_rows_kernel(cover_t_ptr, best_ptr, list_rows_ptr, list_vals_ptr, list_len_ptr, rows_n, n,
                         LIST: tl.constexpr, BLOCK_R: tl.constexpr):
    """For column ``program_id(0)`` of span ``program_id(1)``: the rows it would raise now, ``C_rj > best_r``
    (ascending; the first `LIST` of them, with their scaled entries ``C_rj``), and how many there are (which may
    exceed `LIST`). ``best`` only grows, so these rows contain every row that column can raise later."""
    j = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    column = cover_t_ptr + (b * n + j) * rows_n
    out = (b * n + j) * LIST
    count = 0
    for r0 in range(0, rows_n, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        inside = rows < rows_n
        x = tl.load(column + rows, mask=inside, other=0.0)
        raises = (x > tl.load(best_ptr + b * rows_n + rows, mask=inside, other=0.0)) & inside
        at = count + tl.cumsum(raises.to(tl.int32), axis=0) - 1
        kept = raises & (at < LIST)
        tl.store(list_rows_ptr + out + at, rows, mask=kept)
        tl.store(list_vals_ptr + out + at, x, mask=kept)
        count += tl.sum(raises.to(tl.int32), axis=0)
    tl.store(list_len_ptr + b * n + j, count)


@triton.jit
def _coverage_late_kernel(
    cover_ptr, cover_t_ptr, scales_ptr, gain_ptr, best_ptr, taken_ptr, order_ptr, proposals_ptr, fail_ptr,
    scratch_rows_ptr, scratch_old_ptr, scratch_new_ptr, best_copy_ptr, list_rows_ptr, list_vals_ptr, list_len_ptr,
    n, m, budget, start, stop, ranks_w, proposal_stride,
    SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, TILE_R: tl.constexpr, LIST: tl.constexpr, BLOCK_R: tl.constexpr, SPIN: tl.constexpr,
):
    """Steps ``start .. stop - 1`` of the full greedy, as `_coverage_kernel` (same state in memory, same gains and
    picks), with the rows a pick raises taken from the column's list (`_raising_rows_kernel`, built from ``best``
    at `start`) instead of a compare over the whole column: ``best`` lives in memory, a private copy per program
    (``best_copy_ptr [B, SPLITS, R]``), and a step reads the column's list, ``best`` at its rows and, for the rows
    raised, the program's cover entries. A column whose list overflowed (more than `LIST` rows) is compared whole,
    in chunks of `BLOCK_R` rows."""
    split, b, cover, cover_t, cols, col_in, gain, taken, s_rows, s_old, s_new, scale_1, scale_2 = _span_setup(
        cover_ptr, cover_t_ptr, scales_ptr, gain_ptr, taken_ptr, scratch_rows_ptr, scratch_old_ptr, scratch_new_ptr,
        n, m, SPLITS, BLOCK_C, BLOCK_M, BLOCK_N)
    rows_n = m + n
    best = best_copy_ptr + (b * SPLITS + split) * rows_n
    _copy_rows(best, best_ptr + b * rows_n, rows_n, BLOCK_R)
    tl.debug_barrier()
    others = tl.arange(0, SPLITS_P2)
    failed = 0
    for s in range(start, stop):
        if failed == 0:
            slot = b * budget + s
            low = _lowest_rank(cols, gain, taken, ranks_w)
            if SPLITS > 1:
                low, failed = _meet(low, proposals_ptr + slot * proposal_stride, split, others, SPLITS, fail_ptr + b,
                                    SPIN)
            if failed == 0:
                j = _column_of(low, ranks_w)
                if split == 0:
                    tl.store(order_ptr + slot, j)
                taken = taken | (cols == j)
                # the list is read with its length (no wait for one before the other); entries past the length
                # are masked once it arrives
                k = tl.arange(0, LIST)
                listed = tl.load(list_len_ptr + b * n + j)
                rows = tl.load(list_rows_ptr + (b * n + j) * LIST + k)
                new = tl.load(list_vals_ptr + (b * n + j) * LIST + k)
                if listed <= LIST:
                    count = _raise_listed(rows, new, k < listed, best, s_rows, s_old, s_new)
                else:
                    count = _raise_whole_column(cover_t + j * rows_n, rows_n, best, s_rows, s_old, s_new, BLOCK_R)
                tl.debug_barrier()
                gain += _gain_changes(cover, cols, col_in, n, s_rows, s_old, s_new, count, scale_1, scale_2, BLOCK_C,
                                      TILE_R)
                tl.debug_barrier()
    tl.store(gain_ptr + b * n + cols, gain, mask=col_in)
    tl.store(taken_ptr + b * n + cols, taken.to(tl.int8), mask=col_in)
    if split == 0:
        _copy_rows(best_ptr + b * rows_n, best, rows_n, BLOCK_R)


@triton.jit
def _copy_rows(dst, src, rows_n, BLOCK_R: tl.constexpr):
    """``dst[:rows_n] = src[:rows_n]`` (fp32), in chunks of `BLOCK_R`."""
    for r0 in range(0, rows_n, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        inside = rows < rows_n
        tl.store(dst + rows, tl.load(src + rows, mask=inside, other=0.0), mask=inside)


@triton.jit
def _raise_listed(rows, new, listed, best, s_rows, s_old, s_new):
    """The taken column's listed rows (`rows`, their entries `new`, valid where `listed`) that it raises (entry
    above ``best``) to the compaction buffers (row, old best, new value), ``best`` raised there; returns how
    many."""
    old = tl.load(best + rows, mask=listed, other=0.0)
    raised = listed & (new > old)
    at = tl.cumsum(raised.to(tl.int32), axis=0) - 1
    tl.store(s_rows + at, rows, mask=raised)
    tl.store(s_old + at, old, mask=raised)
    tl.store(s_new + at, new, mask=raised)
    tl.store(best + rows, new, mask=raised)
    return tl.sum(raised.to(tl.int32), axis=0)


@triton.jit
def _raise_whole_column(column, rows_n, best, s_rows, s_old, s_new, BLOCK_R: tl.constexpr):
    """`_raise_listed` for a column without a complete list: every row compared, in chunks of `BLOCK_R` (each
    chunk's raised rows appended to the compaction buffers)."""
    count = 0
    for r0 in range(0, rows_n, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        inside = rows < rows_n
        new = tl.load(column + rows, mask=inside, other=0.0)
        count += _raise_listed(rows, new, inside, best, s_rows + count, s_old + count, s_new + count)
    return count


#: the most programs a span's columns are split over (the per-step time was flat from 64 to 128 programs and longer
#: at 32; `benchmarks/greedy_kernels.py`)
MAX_SPLITS = 64
#: the late stage (`coverage_stages`): from step `LATE_STEP` on, a span's greedy goes on in the late kernel
#: (`_coverage_late_kernel`) with `LATE_SPLITS` programs, where at least `LATE_STEP` steps remain. Early steps raise
#: many rows of ``best`` (4096 tokens: all of them at step 0, then half, a third, ..., a few hundred by step 20,
#: a median of 5 later) and want many programs for their gain updates and the whole-column compare; later steps
#: raise a few rows, which the late kernel finds from the taken column's list (at steps 128 and 256 of a
#: 4096-token image the longest list held 25-49 rows, random and smooth features, so `LIST_LEN` rows leave room).
#: Of the switch steps and late split counts swept at 4096 tokens (`benchmarks/greedy_kernels.py --late`), 192 with 8
#: programs was the fastest on random features, or within the run-to-run spread of the fastest; 4 programs won on
#: spatially smooth features and lost on random ones. A 1024-token image (307 steps) keeps one launch (the late
#: stage did not pay there), hence the "steps remaining" condition. mmtok's ``late_stage`` option
#: (`hf_raincheck.pruning.mmtok`) overrides it.
LATE_STEP = 192
LATE_SPLITS = 8
#: the late kernel's lists: rows per column (`raising_rows`), and the chunk of rows it compares at a time (list
#: building, columns whose list overflowed)
LIST_LEN = 64
LATE_BLOCK_R = 1024


def coverage_plan(n: int, batch: int, device: torch.device, splits: int | None = None) -> tuple[int, int]:
    """``(splits, block_c)``: columns per program a power of two >= 16 (at most 1024), at most `MAX_SPLITS`
    programs per span, programs of all spans within the SM count (they must be resident together for the per-step
    barrier). `splits` forces a split count."""
    if splits is None:
        sms = sm_count(device)
        block_c = 16
        while block_c < 1024 and (triton.cdiv(n, block_c) * batch > sms or triton.cdiv(n, block_c) > MAX_SPLITS):
            block_c *= 2
        splits = triton.cdiv(n, block_c)
        if splits * batch > sms:
            splits = 1  # too many spans for one resident grid: one program per span (no barrier)
    block_c = max(16, triton.next_power_of_2(triton.cdiv(n, splits)))
    return triton.cdiv(n, block_c), block_c


def coverage_stages(n: int, batch: int, budget: int, device: torch.device, splits: int | None = None,
                    late: tuple[int, ...] | None = None) -> list[tuple[int, int, int, bool]]:
    """The launches of a greedy: ``[(first step, splits, block_c, late)]``. The early stage (`_coverage_kernel`)
    runs `coverage_plan`'s split count (or `splits`); ``late = (step, splits)`` goes on from that step with that
    many programs in the late kernel (`_coverage_late_kernel`; a step at or past the budget: one stage);
    ``(step, splits, warps, list_len)`` also sets the late launch's warps per program and list length. By default
    (neither given) `LATE_STEP` and `LATE_SPLITS` (at most the early stage's count, which `coverage_plan` keeps
    resident), where at least `LATE_STEP` steps remain after it."""
    early, block_c = coverage_plan(n, batch, device, splits)
    stages = [(0, early, block_c, False)]
    if late is None:
        if splits is not None or budget - LATE_STEP < LATE_STEP:
            return stages
        late = (LATE_STEP, min(LATE_SPLITS, early))  # no more programs than the early stage's resident grid
    elif (len(late) not in (2, 4) or late[0] < 0 or late[1] < 1
          or (device.type == "cuda" and late[1] > 1 and late[1] * batch > sm_count(device))
          or (len(late) == 4 and (late[2] not in (1, 2, 4, 8, 16, 32) or late[3] < 1 or late[3] & (late[3] - 1)))):
        raise ValueError(f"late stage (mmtok's pruning option 'late_stage') must be (step >= 0, splits >= 1) or "
                         f"(step, splits, warps in 1/2/4/8/16/32, list_len a power of two), with splits x spans "
                         f"({batch}) within the SM count (the programs of a launch must be resident together), "
                         f"got {late}")
    step, late_splits = late[:2]
    late_splits, late_block = coverage_plan(n, batch, device, late_splits)
    if step < budget:
        stages = (stages if step > 0 else []) + [(step, late_splits, late_block, True)]
    return stages


@torch.no_grad()
def raising_rows(cover_t: torch.Tensor, best: torch.Tensor, list_len: int):
    """``(rows [B, n, list_len] int32, values [B, n, list_len] fp32, counts [B, n] int32)``: for every column of
    ``cover_t [B, n, R]`` (scaled) the rows where it exceeds ``best [B, R]``, ascending, the first `list_len` of
    them with their entries, and how many there are (`_raising_rows_kernel`)."""
    batch, n, rows_n = cover_t.shape
    rows = torch.empty(batch, n, list_len, dtype=torch.int32, device=cover_t.device)
    values = torch.empty(batch, n, list_len, dtype=torch.float32, device=cover_t.device)
    counts = torch.empty(batch, n, dtype=torch.int32, device=cover_t.device)
    if batch * n:
        with _on(cover_t.device):
            _raising_rows_kernel[(n, batch)](cover_t, best, rows, values, counts, rows_n, n, LIST=list_len,
                                             BLOCK_R=LATE_BLOCK_R, num_warps=4)
    return rows, values, counts


@torch.no_grad()
def prepare_cover(cover: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cover_t [B, n, R], gain [B, n])``: the scaled transpose and the initial fixed-point gains of ``cover
    [B, R, n]`` (fp32, unscaled) under `mmtok.fixed_point_scales` `scales`, in one pass (`_prepare_kernel`)."""
    batch, rows_n, n = cover.shape
    cover = cover.contiguous()
    cover_t = torch.empty(batch, n, rows_n, dtype=torch.float32, device=cover.device)
    gain = torch.empty(batch, n, dtype=torch.long, device=cover.device)
    if batch * n:
        with _on(cover.device):
            _prepare_kernel[(triton.cdiv(n, 64), batch)](cover, scales, cover_t, gain, rows_n, n,
                                                         BLOCK_R=64, BLOCK_C=64, num_warps=4)
    return cover_t, gain


@torch.no_grad()
def coverage_order_triton(cover: torch.Tensor, scales: torch.Tensor, budget: int, ranks_w: int,
                          splits: int | None = None, spin_limit: int = SPIN_LIMIT,
                          num_warps: int | None = None, tile_r: int | None = None,
                          phases: torch.Tensor | None = None,
                          late: tuple[int, ...] | None = None) -> torch.Tensor | None:
    """The full greedy on ``cover [B, R, n]`` (fp32, unscaled) with the fixed-point scales ``scales [2]``
    (`mmtok.fixed_point_scales`; the same gains and picks as `mmtok.greedy_coverage_order`'s torch paths on
    ``fixed_point(cover)``) -> ``[B, budget]`` picks in order, or None when a program gave up waiting at the
    barrier (the caller then runs the torch path). `splits` forces the number of programs per span
    (`coverage_plan`; then one launch unless `late` is given), ``late = (step, splits)`` the step from which a
    second launch goes on with that many programs in the late kernel (`coverage_stages`; ``(step, splits, warps,
    list_len)`` also sets that launch's warps and list length), `spin_limit` the barrier's patience
    (tests), `num_warps` the warps per program and `tile_r` the changed rows per tile of the gain update
    (benchmarks; defaults: 8 warps for spans of 4096+ tokens, else 4; ``4096 // block_c`` rows, at most 64);
    `phases`, an int64 tensor of ``B * budget * splits * 5`` elements, receives the kernel's per-step clock
    readings (`_coverage_kernel`; benchmarks; one launch: with `splits`, without `late`)."""
    batch, rows_n, n = cover.shape
    device = cover.device
    if budget <= 0:
        return torch.zeros(batch, max(budget, 0), dtype=torch.long, device=device)
    if phases is not None and (splits is None or late is not None):
        raise ValueError("phases needs one launch: pass splits, and no late stage")
    stages = coverage_stages(n, batch, budget, device, splits, late)
    # the preparation pass first: the GPU's next work, queued before the host builds the rest
    cover = cover.contiguous()
    scales = scales.to(device=device, dtype=torch.float32).contiguous()
    cover_t, gain = prepare_cover(cover, scales)
    order = torch.empty(batch, budget, dtype=torch.long, device=device)  # every step writes its pick
    m = rows_n - n  # question rows first, then the span's rows (`mmtok.coverage_matrix`)
    block_m = max(16, triton.next_power_of_2(max(m, 1)))
    block_n = max(16, triton.next_power_of_2(n))
    best = torch.zeros(batch, rows_n, dtype=torch.float32, device=device)  # the state between launches
    taken = torch.zeros(batch, n, dtype=torch.int8, device=device)
    most = max(stage[1] for stage in stages)
    # per step, span and program, one slot; INT64_MIN = "not proposed yet" (ranks are > -2^62)
    proposals = torch.full((batch, budget, most), -INT64_MAX - 1, dtype=torch.long, device=device)
    if phases is not None and phases.numel() < batch * budget * most * 5:
        raise ValueError(f"phases must hold batch * budget * splits * 5 = {batch * budget * most * 5} int64 clock "
                         f"readings, got {phases.numel()}")
    fail = torch.zeros(batch, dtype=torch.int32, device=device)
    scratch = batch * most * (block_m + block_n)
    scratch_rows = torch.empty(scratch, dtype=torch.int32, device=device)
    scratch_old = torch.empty(scratch, dtype=torch.float32, device=device)
    scratch_new = torch.empty_like(scratch_old)
    with _on(device):
        for k, (start, stage_splits, block_c, late_kernel) in enumerate(stages):
            stop = stages[k + 1][0] if k + 1 < len(stages) else budget
            shapes = dict(SPLITS=stage_splits, SPLITS_P2=max(2, triton.next_power_of_2(stage_splits)),
                          BLOCK_C=block_c, BLOCK_M=block_m, BLOCK_N=block_n,
                          TILE_R=tile_r or max(1, min(64, 4096 // block_c)), SPIN=spin_limit,
                          num_warps=num_warps or (8 if block_n >= 4096 else 4))
            state = (cover, cover_t, scales, gain, best, taken, order, proposals, fail, scratch_rows, scratch_old,
                     scratch_new)
            steps = (n, m, budget, start, stop, ranks_w, most)
            if not late_kernel:
                _coverage_kernel[(stage_splits, batch)](*state, order if phases is None else phases, *steps,
                                                        PHASES=phases is not None, **shapes)
                continue
            list_len = LIST_LEN
            if late is not None and len(late) == 4:  # the late launch's own settings
                shapes["num_warps"], list_len = late[2], late[3]
            lists = raising_rows(cover_t, best, list_len)
            best_copy = torch.empty(batch, stage_splits, rows_n, dtype=torch.float32, device=device)
            _coverage_late_kernel[(stage_splits, batch)](*state, best_copy, *lists, *steps, LIST=list_len,
                                                         BLOCK_R=LATE_BLOCK_R, **shapes)
    if most > 1 and fail.cpu().numpy().any():  # one host synchronisation
        return None
    return order
