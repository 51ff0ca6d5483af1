"""Smoke runs of benchmarks/serve.py: both servers (the Raincheck one alone on transformers 5.25) on the shipped
GridQA model, and on a tiny random-weight model served from memory (the code path of the H200 run,
``--random-weights qwen3-vl-8b``); CPU, a few tokens."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from hf_raincheck.gridqa import has_default  # noqa: E402
from hf_raincheck.transformers_coupling import SERVING_ENGINE_PROCESS  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

needs_gridqa = pytest.mark.skipif(not has_default(), reason="the shipped GridQA checkpoint (its processor) is missing")
# the plain side needs transformers serve in this process (5.23 / 5.24; test_serve_benchmark_plain_side_needs_an_in_
# process_transformers_serve checks the refusal elsewhere): on 5.25 the smoke runs measure the Raincheck server alone
SERVERS = ["raincheck"] if SERVING_ENGINE_PROCESS else ["raincheck", "plain"]


def _check(report: dict, out, concurrency: set[str]) -> None:
    assert json.loads(out.read_text()) == report
    assert set(report["servers"]) == set(SERVERS) and report["skipped"] == [] and not report["partial"]
    for name, result in report["servers"].items():
        assert result["ttft_turn1_s"] > 0 and result["ttft_turn2_s"] > 0, name
        assert set(result["throughput"]) == concurrency
        for run in result["throughput"].values():
            assert run["completion_tokens"] > 0 and run["tokens_per_s"] > 0
    assert report["servers"]["raincheck"]["pool"]["hits"] > 0  # follow-up turns reused their conversations' caches
    assert ("turn2_ttft_raincheck_over_plain" in report) is ("plain" in SERVERS)
    assert report.get("turn2_ttft_raincheck_over_plain", 1) > 0


@needs_gridqa
def test_serve_benchmark_smoke(tmp_path):
    import serve as serve_benchmark

    out = tmp_path / "serve.json"
    report = serve_benchmark.main(["--repeats", "1", "--turns", "2", "--concurrency", "1,2", "--max-tokens", "4",
                                   "--think-ms", "0", "--servers", ",".join(SERVERS), "--out", str(out)])
    _check(report, out, {"1", "2"})
    batches = report["servers"]["raincheck"]["batches"]  # 10 requests: warm-up 2, TTFT 2, 1 x 2 and 2 x 2 turns
    assert batches["rows"] == 10 and batches["fallbacks"] == 0 and report["max_batch_size"] >= 1


@needs_gridqa
def test_serve_benchmark_random_weights_smoke(tmp_path):
    """``--random-weights tiny``: the model object in both servers, the processor's images of the asked token
    count, and every answer exactly ``--max-tokens`` long in both servers (the random LM head never ends one)."""
    import serve as serve_benchmark

    out = tmp_path / "serve.json"
    report = serve_benchmark.main(["--random-weights", "tiny", "--device", "cpu", "--repeats", "1", "--turns", "2",
                                   "--concurrency", "1,2", "--max-tokens", "6", "--image-tokens", "16",
                                   "--think-ms", "50", "--budget-s", "600", "--servers", ",".join(SERVERS),
                                   "--out", str(out)])
    _check(report, out, {"1", "2"})
    assert report["model"].startswith("random/tiny") and report["image_tokens"] == 16
    assert report["vocab_size"] == 1000 and report["answer_vocabulary"] >= 16
    for name, result in report["servers"].items():
        for n, run in result["throughput"].items():
            assert run["requests"] == int(n) * 2 and run["answers_of_max_tokens"] == run["requests"], name
            assert run["completion_tokens"] == run["requests"] * 6, name
        assert result["gpu_memory"] == {"ttft 1": None, "throughput 1": None, "throughput 2": None}, name  # CPU
    batches = report["servers"]["raincheck"]["batches"]
    assert batches["rows"] == 10 and batches["fallbacks"] == 0
    pool = report["servers"]["raincheck"]["pool"]  # 5 conversations (warm-up, TTFT, 1 + 2), 5 follow-ups
    assert (pool["misses"], pool["hits"], pool["evictions"]) == (5, 5, 0)


def test_serve_benchmark_refuses_bad_options(capsys):
    import serve as serve_benchmark

    for argv, words in ((["--image-tokens", "64"], "--image-tokens: the GridQA model's images"),
                        (["--random-weights", "tiny", "--image-tokens", "50"], "must be a square number"),
                        (["--random-weights", "tiny", "--turns", "0"], "--turns must be >= 1"),
                        (["--random-weights", "tiny", "--concurrency", "1,x"], "--concurrency must be"),
                        (["--random-weights", "qwen3.5-9b"], "invalid choice"),
                        (["--model", "x", "--random-weights", "tiny"], "not allowed with argument")):
        with pytest.raises(SystemExit):
            serve_benchmark.parse_args(argv)
        assert words in capsys.readouterr().err, argv
    args = serve_benchmark.parse_args(["--random-weights", "qwen3-vl-8b", "--servers", "raincheck"])
    assert (args.max_tokens, args.repeats, args.turns, args.image_tokens, args.budget_s) == (32, 3, 3, 4096, 420)


def test_serve_benchmark_plain_side_needs_an_in_process_transformers_serve(capsys, monkeypatch):
    """Under a transformers serve that runs models in engine processes (5.25), the plain side is refused, saying
    which versions run it and what runs instead."""
    import serve as serve_benchmark

    monkeypatch.setattr(serve_benchmark, "SERVING_ENGINE_PROCESS", True)
    with pytest.raises(SystemExit):
        serve_benchmark.parse_args(["--servers", "raincheck,plain"])
    error = capsys.readouterr().err
    assert "--servers plain" in error and "transformers 5.23 or 5.24" in error and "--servers raincheck" in error
    assert serve_benchmark.parse_args(["--servers", "raincheck"]).servers == ["raincheck"]


@needs_gridqa
def test_serve_benchmark_budget_skips_phases_for_both_servers(tmp_path):
    """A budget spent by the setup: the warm-up still runs, every measured phase is skipped for both servers and
    listed, and the report says so (no medians, no ratio)."""
    import serve as serve_benchmark

    out = tmp_path / "serve.json"
    report = serve_benchmark.main(["--random-weights", "tiny", "--device", "cpu", "--repeats", "1", "--turns", "1",
                                   "--concurrency", "1", "--max-tokens", "2", "--image-tokens", "16",
                                   "--budget-s", "0.01", "--servers", ",".join(SERVERS), "--out", str(out)])
    assert report["skipped"] == ["ttft repeat 1 of 1", "throughput at 1 conversations"]
    for result in report["servers"].values():
        assert result["ttft_turn1_s"] is None and result["throughput"] == {}
    assert "turn2_ttft_raincheck_over_plain" not in report and json.loads(out.read_text()) == report


@needs_gridqa
def test_serve_benchmark_failing_phase_still_writes_its_json(tmp_path, monkeypatch):
    """A phase that fails (e.g. the server runs out of memory): the JSON of the phases so far is written, partial,
    with the error and the failing phase's ``gpu_memory`` entry, and the error is raised."""
    import serve as serve_benchmark

    def fail(side, args, n, think_s):
        raise RuntimeError("generation failed: OutOfMemoryError")

    monkeypatch.setattr(serve_benchmark, "throughput_run", fail)
    out = tmp_path / "serve.json"
    with pytest.raises(RuntimeError, match="OutOfMemoryError"):
        serve_benchmark.main(["--random-weights", "tiny", "--device", "cpu", "--repeats", "1", "--turns", "1",
                              "--concurrency", "2", "--max-tokens", "2", "--image-tokens", "16",
                              "--servers", "raincheck", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["partial"] and report["error"] == "RuntimeError: generation failed: OutOfMemoryError"
    result = report["servers"]["raincheck"]
    assert result["ttft_turn1_s"] > 0 and result["throughput"] == {}
    assert result["gpu_memory"] == {"ttft 1": None, "throughput 2": None}


@needs_gridqa
def test_serve_benchmark_logs_the_raincheck_servers_calls(tmp_path):
    """``--log-calls``: every batched call of the Raincheck server, its rows (a continued row: its conversation,
    cached and pending tokens, KV capacity before and after) and memory fields (CUDA only: None on the CPU)."""
    import serve as serve_benchmark
    from hf_raincheck.serve import scheduler as scheduler_module

    original = scheduler_module.run_batch
    out = tmp_path / "serve.json"
    report = serve_benchmark.main(["--random-weights", "tiny", "--device", "cpu", "--repeats", "0", "--turns", "2",
                                   "--concurrency", "2", "--max-tokens", "3", "--image-tokens", "16",
                                   "--think-ms", "0", "--servers", "raincheck", "--log-calls", "--out", str(out)])
    assert scheduler_module.run_batch is original  # uninstalled when the server stopped
    result = report["servers"]["raincheck"]
    calls = result["calls"]
    assert sum(len(c["rows"]) for c in calls) == result["batches"]["rows"] == 6  # warm-up 2, then 2 x 2 turns
    assert len(calls) == result["batches"]["calls"]
    continued = [row for c in calls for row in c["rows"] if row["conversation"] is not None]
    assert len(continued) == result["pool"]["hits"] == 3
    for row in continued:
        assert row["cached"] > 0 and row["capacity"] >= row["cached"] and row["capacity_after"] >= row["prompt"]
    for call in calls:
        assert call["allocated_before"] is None and call["allocated_after"] is None and "error" not in call
        assert call["pool_bytes"] > 0 and call["seconds"] >= 0
    assert json.loads(out.read_text())["servers"]["raincheck"]["calls"] == calls
