"""Smoke run of the latency benchmark (`benchmarks/latency.py --quick`: tiny shapes on the CPU, ~20 s)."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD_KEYS = {"model", "workload", "policy", "chunk_size", "fused", "ttft_ms", "tpot_ms", "restore_step_ms",
               "decode_step_ms", "e2e_ms", "restored_at_token", "peak_mem_gib", "cache", "gpus", "step_ms",
               "rounds", "tpot_ms_rounds", "tpot_vs_full_paired", "tpot_vs_plain_paired", "one_off_steps",
               "ttft_ms_calls", "warmup_s"}


def test_latency_quick_writes_the_issue_records(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "latency.py"), "--quick", "--save", "--profile",
           "--results-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| model | GPUs | workload | cache | policy |" in done.stdout

    report = json.loads((tmp_path / "latency.json").read_text())
    header, records = report["header"], report["records"]
    assert {"torch", "transformers", "hf_raincheck", "gpu"} <= set(header)
    assert header["errors"] == [] and header["skipped"] == []
    assert records and all(set(r) == RECORD_KEYS and r["gpus"] == 1 for r in records)
    # every decode step's duration (24 forced tokens: 23 steps), and TPOT is their mean
    for r in records:
        assert len(r["step_ms"]) == 23 and all(s > 0 for s in r["step_ms"])
        median = sorted(r["step_ms"])[11]
        assert r["one_off_steps"] == [[j + 1, ms] for j, ms in enumerate(r["step_ms"]) if ms > 3 * median]
        assert len(r["ttft_ms_calls"]) == report["header"]["settings"]["ttft_repeats"] + r["rounds"]
        assert abs(statistics.median(r["ttft_ms_calls"]) - r["ttft_ms"]) < 0.01
        assert abs(sum(r["step_ms"]) / 23 - r["tpot_ms"]) < 0.01 * r["tpot_ms"] + 0.01
        assert r["warmup_s"] > 0  # the warm-up answer's seconds
    # every model x workload x cache has the five policies side by side
    groups = {(r["model"], r["workload"], r["cache"]) for r in records}
    assert len(groups) == 2 * 3 * 2
    for group in groups:
        rows = [(r["policy"], r["fused"]) for r in records if (r["model"], r["workload"], r["cache"]) == group]
        assert {("plain", None), ("full", None), ("hard", None), ("raincheck", True), ("raincheck", False)} <= set(rows)
    # the main chunk is the package's "auto" (31; 63 with Gated DeltaNet layers), the sweep adds 15 and 31
    for model, chunks in (("tiny", {15, 31}), ("tiny-qwen3.5", {15, 31, 63})):
        assert {r["chunk_size"] for r in records if r["policy"] == "raincheck" and r["model"] == model} == chunks
    for r in records:
        assert r["ttft_ms"] > 0 and r["tpot_ms"] > 0 and r["e2e_ms"] >= r["ttft_ms"]
        if r["policy"] == "raincheck":  # the quick prompts are restored within the 24-token answer
            workload = header["workloads"][r["workload"]]
            per_span = workload["visual_tokens"] // workload["spans"]
            deferred = workload["spans"] * math.floor(0.7 * per_span + 1e-9)
            # guard steps, then ceil(D / chunk) carrying steps; the last one produces the next token
            assert r["restored_at_token"] == 16 + math.ceil(deferred / r["chunk_size"]) + 1
            assert r["restore_step_ms"] > 0
        else:
            assert r["restored_at_token"] is None and r["restore_step_ms"] is None
    targets = {(t["model"], t["cache"], t["target"]) for t in report["targets"]}
    assert targets >= {("tiny", "static", "TTFT <= 1.03 x hard"), ("tiny", "static", "TPOT <= 1.03 x full"),
                       ("tiny", "static", "restore step <= 1.15 x decode step"),
                       ("tiny", "dynamic", "TPOT <= 1.05 x full"),
                       ("tiny-qwen3.5", "static", "TPOT <= 1.05 x full"),
                       ("tiny-qwen3.5", "static", "restore step <= 1.2 x decode step"),
                       ("tiny-qwen3.5", "dynamic", "TPOT <= 1.1 x full")}
    profile = (tmp_path / "latency_profile.txt").read_text()
    assert "fused step" in profile and "decode-only after restoration step" in profile and "Full decode (late)" in profile


def run_script(args, tmp_path, timeout=300, **env_vars):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **env_vars)
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_latency_quick_split_over_devices(tmp_path):
    """``--gpus 1,2`` on the CPU: the second placement dispatches the model through accelerate's hooks ("cpu"
    twice), and its records sit next to the one-device ones, with their own ratios and targets."""
    out = run_script([os.path.join(ROOT, "benchmarks", "latency.py"), "--quick", "--save", "--gpus", "1,2",
                      "--models", "tiny-qwen3.5", "--workloads", "image1024", "--caches", "dynamic",
                      "--policies", "full,raincheck", "--chunk-sweep", "", "--results-dir", str(tmp_path)], tmp_path)
    assert "on 2 GPUs (cpu, cpu)" in out
    report = json.loads((tmp_path / "latency.json").read_text())
    rows = sorted((r["gpus"], r["policy"]) for r in report["records"])
    assert rows == [(1, "full"), (1, "raincheck"), (2, "full"), (2, "raincheck")]
    assert sorted({t["gpus"] for t in report["targets"]}) == [1, 2]


def test_latency_quick_interleaved_rounds(tmp_path):
    """``--interleave --repeats 3``: the policies' answers alternate round by round; each record keeps its three
    per-round TPOTs (their median is its TPOT) and the medians of its paired ratios to Full's and to plain
    generate's same round (Full: 1, plain: 1); the target list has the paired TPOT check, the table both ratios."""
    out = run_script([os.path.join(ROOT, "benchmarks", "latency.py"), "--quick", "--save", "--interleave",
                      "--repeats", "3", "--models", "tiny", "--workloads", "image1024", "--caches", "static",
                      "--policies", "full,raincheck,hard,plain", "--chunk-sweep", "", "--results-dir", str(tmp_path)],
                     tmp_path)
    assert "3 rounds, paired TPOT / full" in out
    assert "| TTFT / plain | TPOT / plain | TPOT / plain, paired |" in out
    report = json.loads((tmp_path / "latency.json").read_text())
    records = {r["policy"]: r for r in report["records"]}
    assert set(records) == {"full", "raincheck", "hard", "plain"} and report["header"]["settings"]["interleave"] is True
    full, plain = records["full"], records["plain"]
    for r in records.values():
        assert r["rounds"] == 3 and len(r["tpot_ms_rounds"]) == 3
        assert abs(sorted(r["tpot_ms_rounds"])[1] - r["tpot_ms"]) < 1e-3
        for reference, key in ((full, "tpot_vs_full_paired"), (plain, "tpot_vs_plain_paired")):
            pairs = sorted(a / b for a, b in zip(r["tpot_ms_rounds"], reference["tpot_ms_rounds"]))
            assert abs(r[key] - pairs[1]) < 1e-3
    assert full["tpot_vs_full_paired"] == 1.0 and plain["tpot_vs_plain_paired"] == 1.0
    assert "TPOT <= 1.03 x full (median of paired rounds)" in {t["target"] for t in report["targets"]}


def test_latency_quick_ttft_phases(tmp_path):
    """``--ttft-phases 2``: two first-token calls per policy (the order rotating), each split by phase; the phases
    sit inside the call (the prefill forward is timed for every policy, selection only where something is pruned)
    and the functions it wrapped are restored afterwards."""
    out = run_script([os.path.join(ROOT, "benchmarks", "latency.py"), "--quick", "--save", "--ttft-phases", "2",
                      "--models", "tiny-qwen3.5", "--workloads", "image1024", "--caches", "static",
                      "--policies", "full,raincheck,hard", "--chunk-sweep", "", "--results-dir", str(tmp_path)],
                     tmp_path)
    assert "first-token calls by phase" in out
    rows = json.loads((tmp_path / "latency.json").read_text())["header"]["ttft_phases"]["tiny-qwen3.5"]
    # Qwen3.5's "auto" chunk: 63; the order rotates from call to call
    assert [(r["policy"], r["call"]) for r in rows] == [
        ("full", 0), ("raincheck c63", 0), ("hard", 0), ("raincheck c63", 1), ("hard", 1), ("full", 1)]
    for r in rows:
        assert 0 < r["prefill forward"] < r["ttft_ms"] and 0 < r["vision"] <= r["prepare_turn"] < r["ttft_ms"]
        assert ("selection" in r) == (r["policy"] != "full") and r["cuda_mallocs"] is None
    # the summary: medians per policy, Raincheck over Hard and Full call by call
    summary = json.loads((tmp_path / "latency.json").read_text())["header"]["ttft_phases_summary"]["tiny-qwen3.5"]
    assert [e["policy"] for e in summary] == ["full", "raincheck c63", "hard"] and "/ hard, call by call" in out
    ttft = {(r["policy"], r["call"]): r["ttft_ms"] for r in rows}
    rc = summary[1]
    ratios = sorted(ttft[("raincheck c63", k)] / ttft[("hard", k)] for k in range(2))
    assert rc["paired_vs_hard"] == pytest.approx(sum(ratios) / 2, abs=1e-4)  # (the median of two)
    assert rc["paired_vs_hard_range"] == pytest.approx(ratios, abs=1e-4) and "paired_vs_hard" not in summary[2]
    assert summary[0]["ttft_ms"] == pytest.approx((ttft[("full", 0)] + ttft[("full", 1)]) / 2, abs=0.01)


def test_ttft_phases_unwraps_what_it_timed():
    """`latency.ttft_phases` (in process): every function it wrapped is the original again afterwards (module
    functions, the cache's and the static step's methods, the adapter's bound method: no synced timers left)."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import latency
    from shapes import build_model

    from hf_raincheck.cache.deferred_cache import DeferredPrefillCache
    from hf_raincheck.generation import decode, enable, turn

    before = (enable.prepare_turn, enable.run_rows, turn.select_kept, DeferredPrefillCache.__dict__["reserve"],
              DeferredPrefillCache.__dict__["persist_gdn_states"], decode.StaticStep.__dict__["prepare"])
    args = latency.parse_args(["--quick", "--models", "tiny", "--workloads", "image1024", "--caches", "static",
                               "--policies", "full,raincheck,hard", "--chunk-sweep", ""])
    bench = latency.Bench(latency.enable_raincheck(build_model("tiny", "cpu", torch.float32)), "tiny", args, False)
    rows = latency.ttft_phases(bench, latency.QUICK_WORKLOADS["image1024"].inputs("cpu", torch.float32), "static", 1)
    assert len(rows) == 3 and all("prefill forward" in r for r in rows)
    after = (enable.prepare_turn, enable.run_rows, turn.select_kept, DeferredPrefillCache.__dict__["reserve"],
             DeferredPrefillCache.__dict__["persist_gdn_states"], decode.StaticStep.__dict__["prepare"])
    assert all(a is b for a, b in zip(after, before))
    assert "vision_features" not in vars(bench.model._raincheck_state.adapter)


def test_budget_counts_compiled_warm_ups(monkeypatch):
    """`--budget-s`: every policy on a static CUDA cache is a compiled kind (first guess 90 s, its warm-up kept whole
    for the next workload, which compiles again), an eager warm-up counts at most 10 s the next time."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import latency
    from hf_raincheck import RaincheckConfig

    raincheck = latency.Policy("raincheck", RaincheckConfig(chunk_size=31))
    plain = latency.Policy("plain", None)
    for policy in (raincheck, plain):
        assert latency.Budget.kind(policy, "static", cuda=True)[-1] == "compiled"
        assert latency.Budget.kind(policy, "static", cuda=False)[-1] == "eager"
        assert latency.Budget.kind(policy, "dynamic", cuda=True)[-1] == "eager"
    budget = latency.Budget(100.0)
    compiled = latency.Budget.kind(raincheck, "static", cuda=True)
    eager = latency.Budget.kind(raincheck, "dynamic", cuda=True)
    assert budget.fits(compiled) and budget.fits(eager)  # 90 s and 20 s guesses within 100 s
    budget.record(compiled, 60.0, 52.0)
    budget.record(eager, 40.0, 30.0)
    assert math.isclose(budget.estimates[compiled], 1.1 * 8 + 52 + 2)
    assert math.isclose(budget.estimates[eager], 1.1 * 10 + 10 + 2)
    budget.model_deadline = budget.deadline = time.perf_counter() + 50.0
    assert not budget.fits(compiled) and budget.fits(eager)


def test_policies_warmed_before_a_later_compile_warm_up_again():
    """`--interleave`: a policy warmed up before another policy's warm-up compiled a graph (a chunk sweep's second
    chunk recompiles the fused step, dynamic in the chunk) gets one more warm-up answer before the rounds; a failing
    one is marked failed and reported, the others still run."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import latency
    from hf_raincheck import RaincheckConfig

    class FakeBench:
        def __init__(self):
            self.calls = []

        def generate(self, inputs, policy, cache):
            self.calls.append((policy.name, cache))
            if policy.name == "hard":
                raise RuntimeError("out of memory")

    def entry(name, graphs):
        config = RaincheckConfig(chunk_size=31) if name == "raincheck" else None
        return dict(policy=latency.Policy(name, config), graphs=graphs, warmup_s=1.0, seconds=2.0, failed=False)

    bench, failures = FakeBench(), []
    ready = [entry("full", 1), entry("raincheck", 2), entry("hard", 2), entry("plain", 3)]
    latency.rewarm_after_later_graphs(bench, {}, "static", ready, lambda policy, error: failures.append(policy.name))
    assert bench.calls == [("full", "static"), ("raincheck", "static"), ("hard", "static")]
    assert [e["failed"] for e in ready] == [False, False, True, False] and failures == ["hard"]
    assert ready[0]["warmup_s"] > 1.0 and ready[0]["seconds"] > 2.0 and ready[3]["warmup_s"] == 1.0
    bench.calls.clear()
    latency.rewarm_after_later_graphs(bench, {}, "static", [entry("full", 2), entry("raincheck", 2)], None)
    assert bench.calls == []  # no graph compiled after any warm-up


def test_multi_gpu_quick_equals_the_one_device_model(tmp_path):
    """``multi_gpu.py --quick``: the hooked copy gives the same tokens, logits and restore stats per policy, and
    the placement check saw the deferred rows pending after turn 1 (the next_turn policy)."""
    out = run_script([os.path.join(ROOT, "benchmarks", "multi_gpu.py"), "--quick", "--save", "--out",
                      str(tmp_path / "multi_gpu.json")], tmp_path)
    verdict = [line for line in out.splitlines() if line.startswith("split as one GPU")]
    assert len(verdict) == 1 and "device): True;" in verdict[0]
    records = json.loads((tmp_path / "multi_gpu.json").read_text())["records"]
    assert {(r["model"], r["policy"]) for r in records} == {
        (m, p) for m in ("tiny", "tiny-qwen3.5") for p in ("plain", "full", "hard", "raincheck", "raincheck_next_turn")}
    for r in records:  # on the CPU every copy computes bit for bit the same
        assert set(r["controls"]) == {"rerun", "same_gpu_copy"}
        for c in [r, *r["controls"].values()]:
            assert c["same_tokens_turn1"] and c["same_tokens_turn2"] and c["next_turn_logit_diff"] == 0.0
        assert r["misplaced_tensors"] == 0
    pending = {r["model"]: r for r in records if r["policy"] == "raincheck_next_turn"}
    others = {r["model"]: r for r in records if r["policy"] == "raincheck"}
    for model in pending:  # deferred rows (and DeepStack rows) still held after turn 1 were checked too
        assert pending[model]["cache_tensors_checked"] > others[model]["cache_tensors_checked"]
        assert pending[model]["restore_stats"]["during_prefill"] > 0


def test_quality_quick_writes_the_issue_records(tmp_path):
    """`benchmarks/quality.py --quick` on the shipped GridQA Qwen3-VL: records with the issue's keys; on later turns
    (every deferred token restored by then) Raincheck answers like Full prefill, and Hard does worse."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out = tmp_path / "quality_quick.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "quality.py"), "--quick", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| selector | retention | chunk | visibility |" in done.stdout
    records = json.loads(out.read_text())["records"]
    keys = {"arch", "selector", "retention", "chunk_size", "policy", "turn", "accuracy", "n"}
    assert records and all(keys <= set(r) for r in records)
    later = {(r["policy"], r["selector"], r.get("visibility")): r for r in records
             if r["turn"] == "2+" and r["subset"] == "all"}
    full = later[("full", None, None)]["accuracy"]
    for selector in ("uniform", "mmtok"):
        hard = later[("hard", selector, None)]["accuracy"]
        rain = later[("raincheck", selector, "boundary")]
        assert rain["accuracy"] > hard and "recovered" in rain and len(rain["recovered_ci95"]) == 2
        assert abs(rain["accuracy"] - full) <= 0.1


@pytest.mark.parametrize("batch_size", [1, 3])
def test_step_ops_counts_operators_per_step_kind(tmp_path, batch_size):
    """benchmarks/step_ops.py on the CPU: every step kind of a Raincheck answer is counted, and the steps after
    restoration run exactly Full's operators (a restored cache is laid out as Full's, rule 6); the JSON has the rows.
    A batch (the shared engine's steps) too."""
    out_file = tmp_path / "step_ops.json"
    out = run_script(["benchmarks/step_ops.py", "--models", "tiny", "--image-tokens", "64", "--new-tokens", "24",
                      "--batch-size", str(batch_size), "--save", "--out", str(out_file)], tmp_path)
    rows = {r["step"]: r for r in json.loads(out_file.read_text())["rows"]}
    assert all(r["batch_size"] == batch_size for r in rows.values())
    assert set(rows) == {"plain", "full", "hard", "raincheck, pending", "raincheck, fused", "raincheck, restored"}, out
    assert rows["raincheck, restored"]["kernels"] == rows["full"]["kernels"] > 0
    assert rows["raincheck, fused"]["kernels"] > rows["full"]["kernels"]
    assert all(r["steps"] > 0 and r["calls"] >= r["kernels"] > 0 for r in rows.values())
    assert "| tiny | raincheck, fused |" in out



def test_step_ops_lists_a_fused_steps_operators_by_caller(tmp_path):
    """``--ops fused`` on tiny Qwen3.5: the fused step's operators by name and by the package function that called
    them, the GDN join among them."""
    out = run_script(["benchmarks/step_ops.py", "--models", "tiny-qwen3.5", "--image-tokens", "64", "--new-tokens",
                      "24", "--ops", "fused"], tmp_path)
    assert "tiny-qwen3.5 raincheck, fused: kernel operators of one step" in out, out
    assert "gdn_state/state.py" in out and "join" in out, out
    assert "| tiny-qwen3.5 | raincheck, fused |" in out

@pytest.mark.parametrize("path, batch_sizes", [("batch", [1, 3]), ("batch1", [1])])
def test_gdn_layer_steps_quick_times_both_step_kinds(tmp_path, path, batch_sizes):
    """benchmarks/gdn_layer_steps.py --quick: one tiny GDN layer's fused and decode-only steps, a batch's for B = 1
    and 3 (the fused window from the package's defaults) or one conversation's (`--path batch1`), every record's
    ratio and all-layer extra from its own times."""
    out_file = tmp_path / "gdn.json"
    out = run_script(["benchmarks/gdn_layer_steps.py", "--quick", "--path", path, "--out", str(out_file)], tmp_path)
    report = json.loads(out_file.read_text())
    assert report["meta"]["gdn_layers"] == 3 and report["meta"]["gdn_backend"] == "torch"
    records = report["records"]
    # the package's chunk for models with GDN layers (63; at B = 3 the 1024 budget leaves every row its whole chunk)
    assert [r["batch_size"] for r in records] == batch_sizes and all(r["window"] == 63 for r in records)
    assert all(r["path"] == path for r in records)
    for r in records:
        assert r["fused_us"] > 0 and r["decode_us"] > 0
        assert r["fused_over_decode"] == pytest.approx(r["fused_us"] / r["decode_us"], rel=1e-2)
        assert r["extra_ms_all_layers"] == pytest.approx((r["fused_us"] - r["decode_us"]) * 3 / 1e3, abs=2e-3)
    assert f"{path} B={batch_sizes[-1]}   window 63: fused" in out


def test_serve_memory_logs_every_batched_call(tmp_path):
    """benchmarks/serve_memory.py on a small shape: one JSON line per batched call of the real server (its rows, their
    cached and pending tokens, the pool's bytes equal to the live caches' own count), then the pool's snapshot."""
    out = run_script(["benchmarks/serve_memory.py", "--conversations", "2", "--turns", "2", "--image-tokens", "64",
                      "--layers", "1", "--stagger-s", "0", "--think-ms", "0", "--max-tokens", "4", "--threads", "1"],
                     tmp_path, timeout=180)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    calls, summary = lines[:-1], lines[-1]
    assert sum(len(c["rows"]) for c in calls) == summary["batches"]["rows"] >= 4, out
    assert all(c["pool_bytes"] == c["live_cache_bytes"] > 0 for c in calls), out
    assert any(r["cached"] > 0 for c in calls for r in c["rows"]), out  # turn 2 continued a pooled conversation
    assert summary["pool"]["conversations"] == 2 and summary["pool"]["pending"] == 0, out


def test_step_host_time_splits_wrapper_and_compiled_call(tmp_path):
    """benchmarks/step_host_time.py on the CPU: both kinds of step are timed, the wrapper's share is reported."""
    out = run_script(["benchmarks/step_host_time.py", "--new-tokens", "24"], tmp_path)
    lines = [line for line in out.splitlines() if line.startswith("| decode-only") or line.startswith("| fused")]
    assert len(lines) == 2, out
    for line in lines:
        count, wrapper, inside = (float(x) for x in line.strip("| ").split(" | ")[1:4])
        assert count > 0 and wrapper > 0 and inside > 0, line


def test_gdn_prefill_host_times_every_path_against_its_reference(tmp_path):
    """benchmarks/gdn_prefill_host.py on the CPU (torch kernels): the six paths timed, each path's outputs equal to
    its reference's (on the CPU the same kernels), the table saved; ``--profile`` prints each graphed path's host
    operators."""
    out = run_script(["benchmarks/gdn_prefill_host.py", "--rounds", "2", "--profile", "1", "--out",
                      str(tmp_path / "host.json")], tmp_path)
    assert "| path | host us | total us |" in out
    for name in ("hard", "raincheck", "raincheck_long"):
        profiled = out.split(f"## {name}: 1 calls, host operators by self CPU time")[1]
        assert "Self CPU" in profiled.split("## ")[0] and "aten::" in profiled.split("## ")[0]
    table = json.loads((tmp_path / "host.json").read_text())["table"]
    assert [r["path"] for r in table] == ["hard", "hard_direct", "raincheck", "raincheck_direct", "raincheck_long",
                                             "raincheck_long_direct"]
    assert all(r["host_us"] > 0 and r["total_us"] >= r["host_us"] and r["rel_diff"] < 1e-5 for r in table), table


def test_gridqa_probe_reads_position_and_breaks_counts_down(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gridqa_probe

    out = tmp_path / "probe.json"
    assert gridqa_probe.main(["--arch", "qwen3_vl", "--images", "20", "--counts", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    probe = result["probe"]
    assert [r["layer"] for r in probe] == list(range(5))  # the decoder's input and its 4 layers
    # the vision tower encodes where a cell is: the shipped checkpoint measures 1.000 on 300 images
    assert probe[0]["cell"] >= 0.9 and probe[0]["row"] >= 0.9
    counts = result["counts"]
    assert sum(v["n"] for k, v in counts.items() if k.startswith("counting")) == 8  # 4 dialogues x 2 count turns
    assert sum(v["n"] for k, v in counts.items() if k.startswith("total")) == 8


def test_ridge_probe_separates_what_is_there_from_what_is_not():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import numpy as np
    from gridqa_probe import ridge_probe

    rng = np.random.default_rng(0)
    y = rng.integers(0, 8, 2000)
    informative = np.eye(8)[y] + 0.1 * rng.standard_normal((2000, 8))
    noise = rng.standard_normal((2000, 8))
    assert ridge_probe(informative, y, 8) > 0.99
    assert ridge_probe(noise, y, 8) < 0.25


BATCH_RECORD_KEYS = {"model", "cache", "batch_size", "method", "rows", "rows_why", "image_tokens", "prompt_tokens",
                     "new_tokens", "ttft_ms", "ttft_ms_calls", "ttft_ms_rounds", "tpot_ms", "tpot_ms_rounds",
                     "tpot_from", "tokens_per_s", "tokens_per_s_rounds", "e2e_ms", "e2e_ms_rounds", "peak_mem_gib",
                     "rounds", "warmup_s", "answer_ttft_ms", "step_ms", "step_p50_ms", "restore_step_ms",
                     "decode_step_ms", "restored_at_token", "deferred_per_row", "restored_during_decode", "pending_at_answer_end",
                     "restored_after_answer", "replay_matches", "step_budget"}


def test_batch_quick_shared_engine(tmp_path):
    """``benchmarks/batch.py --quick`` (tiny Qwen3-VL, dynamic cache): the four methods at B = 1 and 3 (mixed image
    sizes, padded rows) in paired rounds; B = 3 runs in the shared engine, timed step by step; a binding step
    budget (20 deferred tokens per step over the rows) sets when restoration ends; ratios and targets per B."""
    out = run_script([os.path.join(ROOT, "benchmarks", "batch.py"), "--quick", "--save", "--models", "tiny",
                      "--batch-sizes", "1", "3", "--step-budget", "20", "--results-dir", str(tmp_path)], tmp_path)
    assert "| model | cache | B | method | rows |" in out and "| model | cache | B | ratio |" in out
    report = json.loads((tmp_path / "batch.json").read_text())
    meta, records = report["meta"], report["records"]
    assert {"command", "torch", "transformers", "hf_raincheck", "gpu"} <= set(meta)
    assert "batch.py" in meta["command"]
    assert meta["errors"] == [] and meta["skipped"] == [] and meta["configs"]["plain"] is None
    assert meta["configs"]["raincheck"]["completion"] == "blocking"
    assert meta["configs"]["raincheck"]["step_deferred_budget"] == 20
    assert all(set(r) == BATCH_RECORD_KEYS for r in records)
    assert sorted((r["batch_size"], r["method"]) for r in records) == [
        (b, m) for b in (1, 3) for m in ("full", "hard", "plain", "raincheck")]
    n = 24
    for r in records:
        b = r["batch_size"]
        assert r["rows"] == ("batched" if r["method"] == "plain" else "batch-1" if b == 1 else "shared")
        assert r["rows_why"] is None and r["image_tokens"] == [64, 36, 64][:b]
        assert r["rounds"] == 2 and len(r["ttft_ms_rounds"]) == 2 and len(r["ttft_ms_calls"]) == 3  # 1 + a round's
        assert r["tpot_from"] == "streamer" and len(r["step_ms"]) == n - 1
        if r["rounds"] == 1:  # the median step of the one answer
            assert abs(r["step_p50_ms"] - statistics.median(r["step_ms"])) < 1e-2
        assert r["step_p50_ms"] > 0
        assert abs(statistics.median(r["ttft_ms_calls"]) - r["ttft_ms"]) < 0.01
        for e2e, rate in zip(r["e2e_ms_rounds"], r["tokens_per_s_rounds"]):
            assert abs(b * n / (e2e / 1e3) - rate) < 0.01 * rate
        assert r["ttft_ms"] > 0 and r["tpot_ms"] > 0 and r["peak_mem_gib"] is None  # (no GPU)
        if r["method"] == "raincheck":
            deferred = r["deferred_per_row"]
            assert deferred == [44, 25, 44][:b] and r["replay_matches"] is True
            assert r["restored_during_decode"] == sum(deferred) and r["pending_at_answer_end"] == 0
            # guard steps, then the chunks: alone 31 per step (44 in 2 steps); over the batch's rows at most 20 a
            # step and ceil(20 / 3) = 7 a row: [7, 7, 6] x 3, [7, 4, 7], [7, 0, 7] x 2, [2, 0, 5] (7 steps)
            steps = math.ceil(44 / 31) if b == 1 else 7
            assert r["restored_at_token"] == 16 + steps + 1
            assert r["restore_step_ms"] > 0 and r["decode_step_ms"] > 0
            assert r["step_budget"] == (None if b == 1 else 20)  # (batch-1 calls have no step budget)
        else:
            assert r["restored_at_token"] is None and r["deferred_per_row"] is None and r["step_budget"] is None
    pairs = {(r["batch_size"], r["pair"]): r for r in report["ratios"]}
    assert set(pairs) == {(b, p) for b in (1, 3) for p in ("raincheck/full", "raincheck/hard", "full/plain")}
    by = {(r["batch_size"], r["method"]): r for r in records}
    for (b, pair), ratio in pairs.items():
        top, bottom = (by[(b, m)] for m in pair.split("/"))
        expected = statistics.median(x / y for x, y in zip(top["tpot_ms_rounds"], bottom["tpot_ms_rounds"]))
        assert abs(ratio["tpot"] - expected) < 1e-3
        assert abs(ratio["ttft"] - top["ttft_ms"] / bottom["ttft_ms"]) < 1e-3  # medians over every first-token call
    targets = {(t["batch_size"], t["target"]) for t in report["targets"]}
    assert targets == {(1, "TPOT <= 1.05 x full"), (1, "tokens/s >= 0.95 x full"), (3, "TPOT <= 1.05 x full"),
                       (3, "tokens/s >= 0.95 x full")}  # the TTFT target starts at B = 4


def test_batch_quick_qwen3_5_static_rows_shared(tmp_path):
    """Qwen3.5 on a static cache: Raincheck's rows share every forward (the shared engine on a static batch cache; its
    steps compiled where transformers compiles, eager on the CPU), timed step by step by a streamer, as plain
    generate."""
    out_file = tmp_path / "static.json"
    run_script([os.path.join(ROOT, "benchmarks", "batch.py"), "--quick", "--models", "tiny-qwen3.5", "--cache",
                "static", "--batch-sizes", "2", "--rounds", "1", "--methods", "raincheck,plain", "--out",
                str(out_file)], tmp_path)
    report = json.loads(out_file.read_text())
    records = {r["method"]: r for r in report["records"]}
    rain, plain = records["raincheck"], records["plain"]
    assert rain["rows"] == "shared" and rain["rows_why"] is None
    assert rain["tpot_from"] == "streamer" and len(rain["step_ms"]) == 23
    assert rain["replay_matches"] is True and rain["restored_during_decode"] == sum(rain["deferred_per_row"])
    assert plain["rows"] == "batched" and plain["tpot_from"] == "streamer" and plain["cache"] == "static"
    assert [r["pair"] for r in report["ratios"]] == []  # no Full or Hard in this run


def test_batch_step_budget_sweep_runs_raincheck_at_each_budget(tmp_path):
    """``--step-budget-sweep``: Raincheck again at each budget, in the same rounds, paired with Full and with the
    default Raincheck; a smaller budget carries fewer deferred rows per fused step, so restoration ends later."""
    out_file = tmp_path / "sweep.json"
    run_script([os.path.join(ROOT, "benchmarks", "batch.py"), "--quick", "--batch-sizes", "3", "--methods",
                "raincheck,full", "--rounds", "1", "--step-budget", "none", "--step-budget-sweep", "2", "--out",
                str(out_file)], tmp_path)
    report = json.loads(out_file.read_text())
    records = {r["method"]: r for r in report["records"]}
    assert set(records) == {"raincheck", "full", "raincheck-b2"}
    assert records["raincheck-b2"]["step_budget"] == 2 and records["raincheck"]["step_budget"] is None
    assert report["meta"]["configs"]["raincheck-b2"]["step_deferred_budget"] == 2
    small, whole = records["raincheck-b2"], records["raincheck"]
    assert whole["restored_at_token"] is not None and whole["pending_at_answer_end"] == 0
    assert small["restored_at_token"] is None or small["restored_at_token"] > whole["restored_at_token"]
    assert small["restored_during_decode"] < whole["restored_during_decode"]
    assert {r["pair"] for r in report["ratios"]} == {"raincheck/full", "raincheck-b2/full", "raincheck-b2/raincheck"}


def test_batch_quick_profiles_the_fused_and_late_steps(tmp_path):
    """``--profile-steps``: after the rounds, one more answer of Raincheck and of Full, with torch.profiler tables of
    decode step guard + 2 (Raincheck's first fused step) and of the step two after Raincheck's restoration ended
    (decode only), written next to the JSON; ``--profile-ttft``: one first-token call of each, in the same file."""
    out = run_script([os.path.join(ROOT, "benchmarks", "batch.py"), "--quick", "--batch-sizes", "3", "--methods",
                      "raincheck,full", "--rounds", "1", "--profile-steps", "--profile-ttft", "--profile-rows", "5",
                      "--out", str(tmp_path / "b.json")], tmp_path)
    report = json.loads((tmp_path / "b.json").read_text())
    restored = next(r["restored_at_token"] for r in report["records"] if r["method"] == "raincheck")
    text = (tmp_path / "b_profile.txt").read_text()
    for name in ("raincheck", "full"):
        for step, label in ((16 + 2, "fused"), (restored + 2, "decode-only after restoration")):
            header = f"## tiny, dynamic cache, B=3, {name}: decode step {step} ({label}): wall "
            assert header in text, (header, text[:2000])
            assert f"profiled B=3 {name} step {step} ({label})" in out
        assert f"## tiny, dynamic cache, B=3, {name}: first-token call: wall " in text
        assert f"profiled B=3 {name} first-token call: wall " in out
    assert text.count("aten::mm") >= 6  # a table of operators under each header
    assert f"and {tmp_path / 'b_profile.txt'}" in out


def test_batch_bad_arguments_name_the_option(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import batch
    import pytest

    for argv, option in [(["--image-tokens", "1000"], "--image-tokens"), (["--methods", "full,fast"], "--methods"),
                         (["--batch-sizes", "0"], "--batch-sizes"), (["--step-budget", "lots"], "--step-budget"),
                         (["--cache", "static", "--warmup-tokens", "8"], "--warmup-tokens"),
                         (["--rounds", "0"], "--rounds"), (["--profile-steps"], "--profile-steps"),
                         (["--profile-ttft"], "--profile-ttft"),
                         (["--save", "--profile-rows", "0"], "--profile-rows"),
                         (["--step-budget-sweep", "8", "8"], "--step-budget-sweep"),
                         (["--step-budget-sweep", "0"], "--step-budget-sweep")]:
        with pytest.raises(SystemExit):
            batch.parse_args(["--quick", *argv])
        assert f"error: {option}" in capsys.readouterr().err, argv


def test_gdn_join_quick_times_the_torch_join(tmp_path):
    """benchmarks/gdn_join.py --quick: the torch join on the CPU at B = 1 and 2, each record's error against the
    float64 reference at fp32 level (the Triton paths run only on CUDA)."""
    out_file = tmp_path / "join.json"
    out = run_script(["benchmarks/gdn_join.py", "--quick", "--out", str(out_file)], tmp_path)
    records = json.loads(out_file.read_text())["records"]
    assert [(r["batch_size"], r["path"]) for r in records] == [(1, "torch"), (2, "torch")]
    assert all(r["us"] > 0 and r["vs_torch"] == 1.0 and r["max_error"] < 1e-4 for r in records)
    assert f"wrote {out_file}" in out


def test_gdn_chunk_quick_runs_the_kernel_under_the_interpreter(tmp_path):
    """benchmarks/gdn_chunk.py --quick under Triton's interpreter: the torch chunked path and the one-chunk kernel
    at B = 1 and 2, each record's error against the float64 recurrence at fp32 level."""
    pytest.importorskip("triton")
    out_file = tmp_path / "chunk.json"
    out = run_script(["benchmarks/gdn_chunk.py", "--quick", "--out", str(out_file)], tmp_path, TRITON_INTERPRET="1")
    records = json.loads(out_file.read_text())["records"]
    assert [(r["batch_size"], r["path"]) for r in records] == [(1, "torch"), (1, "triton"), (2, "torch"),
                                                                (2, "triton")]
    assert all(r["us"] > 0 and r["max_error"] < 1e-5 for r in records)
    assert f"wrote {out_file}" in out


def test_gdn_chunk_tail_times_the_first_prefills_tail(tmp_path):
    """benchmarks/gdn_chunk.py --quick --tail under Triton's interpreter: the tail from ``[state | I]`` (the package's
    launch and one given), each record's outputs, state and transition product against the float64 recurrence."""
    pytest.importorskip("triton")
    out_file = tmp_path / "tail.json"
    run_script(["benchmarks/gdn_chunk.py", "--quick", "--tail", "--triton-configs", "16:4", "--batch-sizes", "1",
                "--out", str(out_file)], tmp_path, TRITON_INTERPRET="1")
    result = json.loads(out_file.read_text())
    assert result["meta"]["tail"] and [r["path"] for r in result["records"]] == ["tail", "tail 16:4"]
    assert all(r["us"] > 0 and r["max_error"] < 1e-5 for r in result["records"])


def test_cold_start_quick_times_a_fresh_process_with_empty_then_kept_caches(tmp_path):
    """`benchmarks/cold_start.py --quick`: Raincheck's first and second answers in a fresh process, with Inductor's
    and Triton's caches empty, then as that process left them (Inductor's C++ backend on the CPU, ~1 min); both
    processes compile the decode and the fused step (two graphs) and answer alike."""
    out = run_script([os.path.join(ROOT, "benchmarks", "cold_start.py"), "--quick", "--methods", "raincheck",
                      "--save", "--results-dir", str(tmp_path)], tmp_path, timeout=600)
    assert "| tiny-qwen3.5 | raincheck | warm |" in out
    report = json.loads((tmp_path / "cold_start.json").read_text())
    assert report["header"]["device"] == "cpu"
    records = report["records"]
    assert [(r["method"], r["caches"]) for r in records] == [("raincheck", "cold"), ("raincheck", "warm")]
    for r in records:
        assert r["compiled_graphs"] == 2 and r["first_s"] > 0 and r["second_s"] > 0 and r["new_tokens"] == 24


def test_cold_start_bad_arguments_name_the_option(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import cold_start

    with pytest.raises(SystemExit):
        cold_start.parse_args(["--quick", "--methods", "raincheck,hard"])
    assert "--methods: unknown ['hard']; allowed: plain, full, raincheck" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cold_start.parse_args(["--quick", "--models", "qwen9"])
    assert "--models: unknown ['qwen9']; allowed: " in capsys.readouterr().err


def test_gdn_chunk_bad_arguments_name_the_option(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gdn_chunk

    for argv, option in [(["--rows", "65"], "--rows"), (["--reps", "0"], "--reps"),
                         (["--batch-sizes", "0"], "--batch-sizes"), (["--triton-configs", "32"], "--triton-configs"),
                         (["--tail", "--triton-configs", "64:8"], "--triton-configs")]:
        with pytest.raises(SystemExit):
            gdn_chunk.main(["--device", "cpu", *argv])
        assert f"error: {option}" in capsys.readouterr().err, argv


def test_gdn_join_bad_arguments_name_the_option(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gdn_join

    for argv, option in [(["--configs", "64:32"], "--configs"), (["--reps", "0"], "--reps"),
                         (["--batch-sizes", "0"], "--batch-sizes")]:
        with pytest.raises(SystemExit):
            gdn_join.main(["--device", "cpu", *argv])
        assert f"error: {option}" in capsys.readouterr().err, argv


def test_gdn_layer_steps_bad_arguments_name_the_option(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gdn_layer_steps

    for argv, option in [(["--reps", "0"], "--reps"), (["--iters", "0"], "--iters"),
                         (["--chunk-size", "0"], "--chunk-size"), (["--batch-sizes", "4", "0"], "--batch-sizes"),
                         (["--step-budget", "-1"], "--step-budget"), (["--shape", "tiny"], "--shape"),
                         (["--path", "batch1", "--batch-sizes", "4"], "--batch-sizes"), (["--path", "b"], "--path")]:
        with pytest.raises(SystemExit):
            gdn_layer_steps.main(["--device", "cpu", *argv])
        err = capsys.readouterr().err
        assert f"error: {option}" in err or f"error: argument {option}" in err, (argv, err)


def test_batch_budget_scales_the_previous_batch_size():
    """`batch.Budget`: a batch size's warm-ups and first round are estimated from the previous one's, x B where the
    rows run one by one, x sqrt(B) where they share forwards; a batch size that does not fit is refused."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import batch

    class FakeBench:
        args = batch.parse_args(["--quick"])

        @staticmethod
        def rows(method, size):
            return "batched" if method.name == "plain" else "batch-1" if size == 1 else (
                "one by one" if method.name == "hard" else "shared")

    budget = batch.Budget(1000.0)
    full, hard, plain = (batch.Method(name, None) for name in ("full", "hard", "plain"))
    budget.record("m", 4, "full", "shared", 2.0, 10.0)
    budget.record("m", 4, "hard", "one by one", 2.0, 10.0)
    budget.record("m", 1, "plain", "batched", 1.0, 5.0)
    assert math.isclose(budget.estimate("m", 16, full, FakeBench), 2.0 * 2 + 10.0 * 2 * 1.1)
    assert math.isclose(budget.estimate("m", 16, hard, FakeBench), 2.0 * 4 + 10.0 * 4 * 1.1)
    assert math.isclose(budget.estimate("m", 4, plain, FakeBench), 1.0 * 2 + 5.0 * 2 * 1.1)
    assert budget.estimate("other", 4, full, FakeBench) is None
    assert budget.fits_group("m", 16, [full, hard, plain], FakeBench)
    budget.model_deadline = time.perf_counter() + 50.0  # 24 + 48 s do not fit in 50
    assert not budget.fits_group("m", 16, [full, hard], FakeBench) and budget.fits_group("m", 16, [full], FakeBench)
