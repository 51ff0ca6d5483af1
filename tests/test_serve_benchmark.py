"""Smoke run of benchmarks/serve.py (both servers, the shipped GridQA model, CPU, a few tokens)."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from hf_raincheck.gridqa import has_default  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


@pytest.mark.skipif(not has_default(), reason="the shipped GridQA checkpoint is missing")
def test_serve_benchmark_smoke(tmp_path):
    import serve as serve_benchmark

    out = tmp_path / "serve.json"
    report = serve_benchmark.main(["--repeats", "1", "--turns", "2", "--concurrency", "1,2", "--max-tokens", "4",
                                   "--think-ms", "0", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert set(report["servers"]) == {"raincheck", "plain"}
    for name, result in report["servers"].items():
        assert result["ttft_turn1_s"] > 0 and result["ttft_turn2_s"] > 0, name
        assert set(result["throughput"]) == {"1", "2"}
        for run in result["throughput"].values():
            assert run["completion_tokens"] > 0 and run["tokens_per_s"] > 0
    pool = report["servers"]["raincheck"]["pool"]
    assert pool["hits"] > 0  # the follow-up turns reused their conversations' caches
    batches = report["servers"]["raincheck"]["batches"]  # 10 requests: warm-up 2, TTFT 2, 1 x 2 and 2 x 2 turns
    assert batches["rows"] == 10 and batches["fallbacks"] == 0 and report["max_batch_size"] >= 1
