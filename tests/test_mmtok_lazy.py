"""MMTok's lazy greedy (`hf_raincheck.pruning.mmtok.greedy_coverage_order`) against the full greedy (every column
evaluated every step, the same arithmetic) and the previous dense implementation: random covers of many shapes,
exact ties, batches, and covers that force the fallback (rewind + full evaluation). CPU; one GPU test."""

from __future__ import annotations

import pytest
import torch

from hf_raincheck.pruning import greedy
from hf_raincheck.pruning.mmtok import coverage_matrix, dense_greedy_coverage_order, greedy_coverage_order


def lazy(cover, budget, k=None):
    return greedy_coverage_order(cover, budget, k=k).tolist()


def full(cover, budget, k=None):
    return greedy_coverage_order(cover, budget, lazy=False, k=k).tolist()


def random_cover(seed, batch, m, n, alpha=0.5, tau_tv=0.01, tau_vv=0.2, dim=16, duplicates=0):
    g = torch.Generator().manual_seed(seed)
    x, x_c = torch.randn(batch, n, dim, generator=g), torch.randn(batch, n, dim // 2, generator=g)
    for _ in range(duplicates):  # identical tokens: identical columns (exact ties)
        i, j = torch.randint(0, n, (2,), generator=g).tolist()
        x[:, j], x_c[:, j] = x[:, i], x_c[:, i]
    return coverage_matrix(x, x_c, torch.randn(m, dim, generator=g), alpha, tau_tv, tau_vv)


@pytest.fixture
def rewinds():
    """The number of fallbacks (rewinds) during the test."""
    start = greedy.STATS["rewinds"]
    return lambda: greedy.STATS["rewinds"] - start


@pytest.mark.parametrize(
    "batch, m, n",
    [(1, 5, 1), (1, 3, 2), (1, 4, 7), (2, 5, 30), (1, 0, 63), (1, 8, 64), (3, 6, 65), (1, 24, 200), (2, 30, 300)],
)
def test_lazy_equals_full_and_dense_on_random_covers(batch, m, n):
    for seed in range(3):
        cover = random_cover(seed, batch, m, n)
        for budget in sorted({1, max(1, int(0.3 * n)), n}):
            expected = full(cover, budget)
            assert lazy(cover, budget) == expected, (seed, budget)
            assert dense_greedy_coverage_order(cover, budget).tolist() == expected, (seed, budget)
            for k in (1, 4, 16):  # small k: many fallbacks
                assert lazy(cover, budget, k) == expected, (seed, budget, k)


@pytest.mark.parametrize("options", [dict(alpha=0.0), dict(alpha=2.0, tau_tv=0.1, tau_vv=0.05), dict(tau_vv=5.0)])
def test_lazy_equals_full_with_options_and_duplicate_tokens(options):
    for seed in range(3):
        cover = random_cover(seed, 2, 7, 120, duplicates=40, **options)
        for budget in (1, 36, 120):
            for k in (2, 8, 64):
                assert lazy(cover, budget, k) == full(cover, budget), (seed, budget, k)


def test_exact_ties():
    g = torch.Generator().manual_seed(0)
    covers = {
        "constant": torch.full((1, 40, 90), 0.25),
        "zeros": torch.zeros(2, 10, 70),
        "levels": torch.randint(0, 3, (2, 50, 100), generator=g).float(),  # few values: many equal gains
        "zero_rows": torch.rand(1, 60, 80, generator=g) * (torch.arange(60) % 3 == 0)[None, :, None],
        "duplicate_columns": torch.rand(1, 30, 20, generator=g).repeat(1, 1, 5),  # each column 5 times
        "one_hot": torch.eye(70)[None].repeat(2, 1, 1),  # every gain 1 until all are chosen
    }
    for name, cover in covers.items():
        n = cover.shape[2]
        for budget in (1, n // 3, n):
            expected = full(cover, budget)
            for k in (1, 3, 16, 64, 200):
                assert lazy(cover, budget, k) == expected, (name, budget, k)
        if name in ("constant", "zeros", "one_hot"):  # every gain ties at every step: the lowest index
            assert lazy(cover, n) == [list(range(n))] * cover.shape[0], name
    # duplicates: the first copy of each column is chosen before its later copies
    order = lazy(covers["duplicate_columns"], 100)[0]
    assert all(order.index(j) < order.index(j + 20) for j in range(80))


def test_batch_rows_are_independent():
    covers = [random_cover(s, 1, 6, 150, duplicates=10 * s) for s in range(4)]
    covers.append(torch.full((1, 156, 150), 0.1))  # constant: falls back while the others may not
    together = greedy_coverage_order(torch.cat(covers), 70, k=8).tolist()
    assert together == [lazy(c, 70, 8)[0] for c in covers]
    assert together == [full(c, 70)[0] for c in covers]


def test_fallback_runs_and_matches(rewinds):
    # a constant matrix: after the first pick every gain drops to 0 while the stale bounds stay at the first
    # gain, so the second step cannot be certified
    cover = torch.full((1, 30, 100), 0.01)
    assert lazy(cover, 50) == [list(range(50))]
    assert rewinds() >= 1
    # random covers with a small k: the pick is often not certified, in the middle of chunks and across them
    before = rewinds()
    for seed in range(4):
        cover = random_cover(seed, 2, 10, 257)
        assert lazy(cover, 200, 2) == full(cover, 200), seed
    assert rewinds() - before >= 4


def test_fallback_is_rare_with_the_default_k(rewinds):
    # query rows and vision rows, b = 0.3 n: a few fallbacks at most (each costs one full evaluation)
    cover = random_cover(0, 1, 24, 1024)
    chunks = greedy.STATS["chunks"]
    assert lazy(cover, 307) == dense_greedy_coverage_order(cover, 307).tolist()
    assert rewinds() <= 3 and greedy.STATS["chunks"] - chunks <= 20 + rewinds()


def test_selection_order_is_greedy_on_a_hand_made_cover():
    # rows 0-2: column 0 covers 3 rows weakly, column 1 two rows strongly, column 2 one row
    cover = torch.tensor([[[0.3, 1.0, 0.0], [0.3, 1.0, 0.0], [0.3, 0.0, 0.5]]])
    # gains: [0.9, 2.0, 0.5] -> 1; then [0.3, -, 0.5] -> 2; then [0, -, -] -> 0
    assert lazy(cover, 3) == [[1, 2, 0]] == full(cover, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_match_cpu():
    # fixed-point gains: the same picks on every device and in every path (graphed, eager, full, CPU)
    for seed, (batch, m, n, budget) in enumerate([(1, 24, 1024, 307), (4, 10, 256, 77), (1, 0, 500, 150)]):
        cover = random_cover(seed, batch, m, n, duplicates=n // 10)
        expected = lazy(cover, budget)
        assert full(cover, budget) == expected
        on_gpu = cover.cuda()
        assert lazy(on_gpu, budget) == expected
        assert lazy(on_gpu, budget) == expected  # the cached graph
        assert lazy(on_gpu, budget, 2) == expected  # many fallbacks through the graphs
        assert full(on_gpu, budget) == expected
        # the eager loops on CUDA (mmtok's ``cuda_graphs=False``): no graph captured, the same picks
        dense = dense_greedy_coverage_order(on_gpu, budget).tolist()  # graphed
        captured = list(greedy._CACHE)
        assert greedy_coverage_order(on_gpu, budget, lazy=False, graphs=False).tolist() == expected
        assert dense_greedy_coverage_order(on_gpu, budget, graphs=False).tolist() == dense
        assert list(greedy._CACHE) == captured
