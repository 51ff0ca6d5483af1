"""The Triton greedy kernels (`hf_raincheck.pruning.greedy_triton`) against the torch loops they replace.

GPU tests (CI deselects them); they also run on the CPU under Triton's interpreter:
``TRITON_INTERPRET=1 python -m pytest -m triton tests/test_greedy_triton.py`` (small sizes only there).
"""

from __future__ import annotations

import pytest
import torch

from hf_raincheck.pruning import divprune
from hf_raincheck.pruning.mmtok import (
    coverage_matrix,
    fixed_point,
    fixed_point_scales,
    greedy_coverage_order,
    initial_gains,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.triton,
    # the interpreter takes loop bounds from 1-element arrays, which numpy warns about
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


@pytest.fixture(scope="module")
def device(triton_device) -> torch.device:
    return triton_device


def coverage_order_triton(*args, **kwargs):
    from hf_raincheck.pruning.greedy_triton import coverage_order_triton as kernel  # needs Triton

    return kernel(*args, **kwargs)


def coverage_plan(*args, **kwargs):
    from hf_raincheck.pruning.greedy_triton import coverage_plan as plan

    return plan(*args, **kwargs)


def _torch_path(monkeypatch):
    monkeypatch.setenv("HF_RAINCHECK_TRITON", "0")


def _triton_path(monkeypatch):
    monkeypatch.setenv("HF_RAINCHECK_TRITON", "1")


def _cover(batch, n, m, device, seed, dim=32, vit=16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, n, dim, generator=gen)
    x_c = torch.randn(batch, n, vit, generator=gen)
    z = torch.randn(m, dim, generator=gen)
    return coverage_matrix(x, x_c, z, 0.5, 0.01, 0.2).to(device)


def _sizes(device):
    small = [(1, 50, 6), (2, 64, 0), (3, 100, 8), (1, 17, 3)]
    if device.type == "cuda":
        return small + [(1, 1024, 24), (16, 256, 24), (1, 4096, 24), (2, 2000, 5)]
    return small


def test_mmtok_kernel_picks_the_full_greedy(device, monkeypatch):
    for i, (batch, n, m) in enumerate(_sizes(device)):
        cover = _cover(batch, n, m, device, seed=i)
        budget = max(1, round(0.3 * n))
        _torch_path(monkeypatch)
        want = greedy_coverage_order(cover, budget, lazy=False)
        _triton_path(monkeypatch)
        got = greedy_coverage_order(cover, budget)
        assert torch.equal(got.cpu(), want.cpu()), (batch, n, m)
        assert got.shape == (batch, budget)


def test_mmtok_kernel_every_split_count(device, monkeypatch):
    """Forced split counts (one program per span, several with the per-step barrier) give the same picks."""
    cover = _cover(2, 96, 5, device, seed=7)
    budget = 40
    _torch_path(monkeypatch)
    want = greedy_coverage_order(cover, budget, lazy=False)
    splits_tried = [1] + ([2, 3, 6] if device.type == "cuda" else [])
    width = max(96, 64)
    for splits in splits_tried:
        cover32, scales = _cover_and_scales(cover, width)
        got = coverage_order_triton(cover32, scales, budget, width + 1, splits=splits)
        assert got is not None
        assert torch.equal(got.cpu(), want.cpu()), splits


def test_mmtok_kernel_in_two_launches(device, monkeypatch):
    """A greedy split over two launches (``late``: the state goes through memory, the second launch goes on from
    the step given, with its own split count, and warps and changed-row tile where given) picks what one launch and
    the torch path pick, wherever it switches (before the first step, after it, mid-way, at the budget)."""
    cover = _cover(2, 96, 5, device, seed=9)
    budget, width = 40, 96
    _torch_path(monkeypatch)
    want = greedy_coverage_order(cover, budget, lazy=False)
    cover32, scales = _cover_and_scales(cover, width)
    plans = [(1, (step, 1)) for step in (0, 1, 7, budget)] + [(1, (7, 1, 2, 2))]  # the late launch's warps, tile
    if device.type == "cuda":
        plans += [(6, (5, 2)), (2, (1, 6)), (3, (20, 1)), (None, None), (None, (3, 2))]
    for splits, late in plans:
        got = coverage_order_triton(cover32, scales, budget, width + 1, splits=splits, late=late)
        assert got is not None
        assert torch.equal(got.cpu(), want.cpu()), (splits, late)


def test_raising_rows_lists_the_rows_each_column_raises(device):
    """The late kernel's lists: per column the rows whose entry exceeds ``best`` (ascending, the first `list_len`
    with their entries) and how many there are, past `list_len` too; several spans, sizes off the tiles."""
    from hf_raincheck.pruning.greedy_triton import raising_rows

    gen = torch.Generator().manual_seed(21)
    batch, n, rows_n = 2, 37, 1100  # rows over one chunk of the list pass (LATE_BLOCK_R)
    cover_t = torch.rand(batch, n, rows_n, generator=gen)
    best = torch.rand(batch, rows_n, generator=gen) ** 0.05  # most rows high: short lists, a few long ones
    best[0, :700] = 0.0  # span 0: every column over 700 rows (overflow)
    for list_len in (1, 8, 64):
        rows, values, counts = raising_rows(cover_t.to(device), best.to(device), list_len)
        rows, values, counts = rows.cpu(), values.cpu(), counts.cpu()
        for b in range(batch):
            for j in range(n):
                want = (cover_t[b, j] > best[b]).nonzero()[:, 0]
                assert int(counts[b, j]) == want.numel(), (list_len, b, j)
                k = min(list_len, want.numel())
                assert torch.equal(rows[b, j, :k].long(), want[:k]), (list_len, b, j)
                assert torch.equal(values[b, j, :k], cover_t[b, j, want[:k]]), (list_len, b, j)


def test_late_kernel_picks_the_full_greedy(device, monkeypatch):
    """The late kernel (lists of the rows a column raises, built when it starts) picks what the torch path's full
    greedy picks, from any step, with lists long enough, short enough to overflow for most columns (those compare
    the whole column) and of one row; spans of several sizes, with and without question rows."""
    for i, (batch, n, m) in enumerate([(2, 96, 5), (1, 50, 0), (3, 70, 8)]):
        cover = _cover(batch, n, m, device, seed=60 + i)
        budget, width = max(2, round(0.4 * n)), max(n, 64)
        _torch_path(monkeypatch)
        want = greedy_coverage_order(cover, budget, lazy=False)
        cover32, scales = _cover_and_scales(cover, width)
        for step in (0, 3, budget // 2):
            for list_len in (1, 4, 64):
                got = coverage_order_triton(cover32, scales, budget, width + 1, splits=1,
                                            late=(step, 1, 4, list_len))
                assert got is not None
                assert torch.equal(got.cpu(), want.cpu()), (batch, n, m, step, list_len)


def test_coverage_stages(device):
    """Which launches a greedy takes: one unless a late stage is given or, by default, at least `LATE_STEP` steps
    remain after `LATE_STEP`; the late one runs the late kernel; bad ``late`` values are refused, naming the
    argument."""
    from hf_raincheck.pruning.greedy_triton import LATE_SPLITS, LATE_STEP, coverage_stages

    assert coverage_stages(96, 1, 40, device, splits=1) == [(0, 1, 128, False)]
    assert coverage_stages(96, 1, 40, device, splits=1, late=(7, 1)) == [(0, 1, 128, False), (7, 1, 128, True)]
    assert coverage_stages(96, 1, 40, device, splits=1, late=(0, 1)) == [(0, 1, 128, True)]
    assert coverage_stages(96, 1, 40, device, splits=1, late=(40, 2)) == [(0, 1, 128, False)]
    assert coverage_stages(96, 1, 40, device, splits=1, late=(7, 1, 16, 4)) == [(0, 1, 128, False),
                                                                                (7, 1, 128, True)]
    for bad in ((-1, 2), (3, 0), (3,), (3, 1, 3, 2), (3, 1, 8, 0), (3, 1, 8, 3), (3, 1, 8)):
        with pytest.raises(ValueError, match="late"):
            coverage_stages(96, 1, 40, device, late=bad)
    budget = 2 * LATE_STEP
    default = coverage_stages(4096, 1, budget, device)
    assert [stage[0] for stage in default] == [0, LATE_STEP] and [stage[3] for stage in default] == [False, True]
    assert coverage_stages(4096, 1, budget - 1, device) == default[:1]  # too few steps left for it
    for spans in (1, 4, 17, 200):  # many spans: fewer programs each (one when they cannot all be resident)
        stages = coverage_stages(4096, spans, budget, device)
        assert stages[1][1] <= stages[0][1], spans
        if device.type == "cuda" and stages[0][1] > 1:
            assert stages[0][1] * spans <= torch.cuda.get_device_properties(device).multi_processor_count, spans
    if device.type == "cuda":
        assert default[0][1] == 64 and default[1][1] == LATE_SPLITS
        with pytest.raises(ValueError, match="late"):
            coverage_stages(256, 16, 77, device, late=(5, 64))  # 16 x 64 programs cannot all be resident


def test_late_stage_option_sets_the_late_stage_of_a_selection(device, monkeypatch):
    """mmtok's ``late_stage`` option (`mmtok.late_stage_tuple`, passed by `greedy_coverage_order`) sets the kernel's
    late stage for a whole greedy (GPU sweeps): the picks stay the torch path's, ``"auto"`` leaves the default,
    a malformed value is refused naming the option, and a forced split count ignores it."""
    from hf_raincheck.pruning import greedy_triton, mmtok, resolve_options

    cover = _cover(2, 96, 5, device, seed=9)
    budget, width = 40, 96
    _torch_path(monkeypatch)
    want = greedy_coverage_order(cover, budget, lazy=False)
    _triton_path(monkeypatch)
    cover32, scales = _cover_and_scales(cover, width)
    seen = []
    stages = greedy_triton.coverage_stages
    monkeypatch.setattr(greedy_triton, "coverage_stages", lambda *a, **k: seen.append(a[4:] + (k,)) or stages(*a, **k))
    for option, late in (([7, 1], (7, 1)), ([7, 1, 2, 2], (7, 1, 2, 2)), ("off", (1 << 62, 1)), ("auto", None)):
        resolved = resolve_options("mmtok", {"late_stage": option})["late_stage"]
        assert mmtok.late_stage_tuple(resolved) == late
        got = greedy_coverage_order(cover, budget, late=mmtok.late_stage_tuple(resolved))
        assert torch.equal(got.cpu(), want.cpu()), option
        assert seen[-1] == (None, late, {}), option
    got = coverage_order_triton(cover32, scales, budget, width + 1, splits=1)
    assert seen[-1] == (1, None, {}) and torch.equal(got.cpu(), want.cpu())
    for bad in ("7", [7], [7, 1, 2], "none"):
        with pytest.raises(ValueError, match="'late_stage'"):
            resolve_options("mmtok", {"late_stage": bad})


def test_mmtok_kernel_phases(device, monkeypatch):
    """``phases=`` (benchmarks) leaves the picks alone and records five increasing SM clock readings per step and
    program; a tensor too small for them is refused, naming the argument."""
    if device.type != "cuda":
        pytest.skip("the clock readings are inline PTX: CUDA only (the interpreter runs no asm)")
    cover = _cover(2, 96, 5, device, seed=11)
    budget, width = 30, 96
    _torch_path(monkeypatch)
    want = greedy_coverage_order(cover, budget, lazy=False)
    cover32, scales = _cover_and_scales(cover, width)
    for splits in (1, 3):
        clocks = torch.zeros(2, budget, splits, 5, dtype=torch.long, device=device)
        got = coverage_order_triton(cover32, scales, budget, width + 1, splits=splits, phases=clocks)
        assert torch.equal(got.cpu(), want.cpu()), splits
        steps = clocks.cpu()
        assert bool((steps > 0).all()), splits
        assert bool((steps.diff(dim=-1) >= 0).all()), splits  # within a step, in order
        assert bool((steps[:, 1:, :, 0] >= steps[:, :-1, :, 4]).all()), splits  # and step after step
    with pytest.raises(ValueError, match="phases"):
        coverage_order_triton(cover32, scales, budget, width + 1, splits=3, phases=torch.zeros(5, dtype=torch.long,
                                                                                            device=device))


def _cover_and_scales(cover, width):
    cover = cover.float()
    return cover, fixed_point_scales(cover, width)


def test_prepare_cover_equals_the_torch_fixed_point(device):
    """The kernel's one-pass preparation: the scaled transpose and the initial gains equal `fixed_point` and
    `initial_gains` bit for bit (several spans, sizes off the tiles, a question of 0 rows, a large mass)."""
    from hf_raincheck.pruning.greedy_triton import prepare_cover

    for i, (batch, n, m, scale) in enumerate([(1, 50, 6, 1.0), (3, 70, 0, 1.0), (2, 130, 5, 3e5)]):
        cover = _cover(batch, n, m, device, seed=40 + i) * scale
        for width in (max(n, 64), 4096):
            cover32, scales = _cover_and_scales(cover, width)
            scaled = fixed_point(cover32, width, scales)
            cover_t, gain = prepare_cover(cover32, scales)
            assert torch.equal(cover_t.cpu(), scaled.transpose(1, 2).cpu()), (batch, n, m, width)
            assert torch.equal(gain.cpu(), initial_gains(scaled).cpu()), (batch, n, m, width)


def test_mmtok_kernel_budget_edges(device, monkeypatch):
    cover = _cover(1, 20, 2, device, seed=3)
    _triton_path(monkeypatch)
    for budget in (0, 1, 20):
        got = greedy_coverage_order(cover, budget)
        _torch_path(monkeypatch)
        want = greedy_coverage_order(cover, budget, lazy=False)
        _triton_path(monkeypatch)
        assert torch.equal(got.cpu(), want.cpu()), budget
    assert sorted(greedy_coverage_order(cover, 20)[0].tolist()) == list(range(20))  # every column exactly once


def test_mmtok_kernel_ties_go_to_the_lowest_index(device, monkeypatch):
    """Identical columns: equal gains at every step, so the picks must come in index order among equals."""
    base = torch.rand(1, 12, 4)
    cover = torch.cat([base, base, base], dim=2).to(device)  # columns j, j + 4, j + 8 identical
    _torch_path(monkeypatch)
    want = greedy_coverage_order(cover, 7, lazy=False)
    _triton_path(monkeypatch)
    got = greedy_coverage_order(cover, 7)
    assert torch.equal(got.cpu(), want.cpu())


def test_coverage_plan_keeps_programs_resident(device):
    if device.type != "cuda":
        assert coverage_plan(4096, 1, device) == (1, 4096)
        return
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for n, batch in ((4096, 1), (256, 16), (16384, 1), (1024, 64), (64, 200)):
        splits, block = coverage_plan(n, batch, device)
        assert splits * block >= n and (splits == 1 or splits * batch <= sms), (n, batch, splits, block)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter behaviour: programs run one after another")
def test_barrier_gives_up_and_the_torch_path_runs(device, monkeypatch):
    """Under the interpreter a span's programs cannot meet at the barrier: the kernel reports it (None)."""
    cover = _cover(1, 40, 3, device, seed=5)
    cover32, scales = _cover_and_scales(cover, 64)
    assert coverage_order_triton(cover32, scales, 10, 65, splits=2, spin_limit=3) is None


def test_divprune_kernel_picks_the_torch_loop(device, monkeypatch):
    sizes = [(1, 30, 8), (3, 64, 16), (2, 100, 5)]
    if device.type == "cuda":
        sizes += [(1, 1024, 4096), (16, 256, 4096), (1, 4096, 4096)]
    for i, (batch, n, dim) in enumerate(sizes):
        gen = torch.Generator().manual_seed(i)
        feats = torch.randn(batch, n, dim, generator=gen).to(device)
        budget = max(1, round(0.3 * n))
        _torch_path(monkeypatch)
        want = divprune.divprune_order(feats, budget)
        _triton_path(monkeypatch)
        got = divprune.divprune_order(feats, budget)
        assert torch.equal(got.cpu(), want.cpu()), (batch, n, dim)
        assert all(len(set(row)) == budget for row in got.tolist())


def test_divprune_kernel_ties(device, monkeypatch):
    """Repeated feature vectors: exact ties everywhere."""
    base = torch.randn(1, 5, 8)
    feats = base.repeat(1, 4, 1).to(device)
    for budget in (1, 5, 12, 20):
        _torch_path(monkeypatch)
        want = divprune.divprune_order(feats, budget)
        _triton_path(monkeypatch)
        got = divprune.divprune_order(feats, budget)
        assert torch.equal(got.cpu(), want.cpu()), budget


def test_spans_past_the_register_limit_take_the_torch_loops(device, monkeypatch):
    """Sizes whose register vectors would exceed `MAX_BLOCK` never reach the kernels, and keep the same picks."""
    from hf_raincheck.pruning import greedy_triton

    cover = _cover(1, 40, 3, device, seed=11)  # 43 rows -> a 64-wide block
    feats = torch.randn(1, 40, 8).to(device)  # 40 tokens -> 64
    _torch_path(monkeypatch)
    want_cover = greedy_coverage_order(cover, 12, lazy=False)
    want_div = divprune.divprune_order(feats, 12)
    _triton_path(monkeypatch)
    monkeypatch.setattr(greedy_triton, "MAX_BLOCK", 32)

    def fail(*args, **kwargs):
        raise AssertionError("the kernel ran past MAX_BLOCK")

    monkeypatch.setattr(greedy_triton, "coverage_order_triton", fail)
    monkeypatch.setattr(greedy_triton, "divprune_steps_triton", fail)
    assert torch.equal(greedy_coverage_order(cover, 12).cpu(), want_cover.cpu())
    assert torch.equal(divprune.divprune_order(feats, 12).cpu(), want_div.cpu())
    monkeypatch.setattr(greedy_triton, "MAX_BLOCK", 64)  # at the limit the kernels run
    with pytest.raises(AssertionError, match="MAX_BLOCK"):
        greedy_coverage_order(cover, 12)
    with pytest.raises(AssertionError, match="MAX_BLOCK"):
        divprune.divprune_order(feats, 12)
