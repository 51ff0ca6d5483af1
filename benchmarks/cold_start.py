"""A process's first answer on a static cache: what compiling the steps costs a user, and what a warm cache saves.

    python benchmarks/cold_start.py --quick --save                           # tiny Qwen3.5 on the CPU, ~3 min
    python benchmarks/cold_start.py --device cuda --models qwen3.5-9b --save  # the GPU run, ~10 min per model

Per model and method, one fresh Python process builds the model (random weights, `shapes.py`), then times two
forced answers on the workload: the first generate call of the process (compilation, autotuning and CUDA-graph
recording included) and the second (the steps as every later call runs them). Each method runs twice: with
Inductor's and Triton's on-disk caches empty (``cold``: a new machine or container) and again with the caches
that run left (``warm``: a later process on the same machine, or a container whose ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR`` are kept on persistent storage). Methods (`--methods`), as `latency.py` runs them:

* ``plain``: transformers' own generate on a `StaticCache` (transformers compiles its decode step);
* ``full``: ``RaincheckConfig(policy="full")`` with ``cache_implementation="static"`` (the package's decode step);
* ``raincheck``: the package defaults (`latency.py`'s settings) with ``cache_implementation="static"``: the decode
  step and the fused step, two graphs.

transformers' default ``CompileConfig`` compiles on CUDA only; on the CPU (``--quick``) every method gets it with
``_compile_all_devices`` (Inductor's C++ backend, no CUDA graphs), which shows the cache's effect, not a GPU's
seconds. Results: a table (first call, second call, warm over cold) and, with ``--save``, ``cold_start.json`` in
``--results-dir``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

METHODS = ("plain", "full", "raincheck")


def child(args) -> dict:
    """One process's run: build the model, two forced answers; the seconds of each."""
    import torch
    from transformers.generation.configuration_utils import CompileConfig

    import latency
    from hf_raincheck import enable_raincheck

    latency_args = latency.parse_args(
        (["--quick"] if args.quick else []) + [
            "--device", args.device, "--models", args.model, "--workloads", args.workload, "--caches", "static",
            "--policies", args.method, "--new-tokens", str(args.new_tokens), "--chunk-sweep", ""])
    cuda = latency_args.device.startswith("cuda")
    workload = (latency.QUICK_WORKLOADS if args.quick else latency.WORKLOADS)[args.workload]
    latency_args.max_cache_len = workload.prompt_tokens + latency_args.new_tokens
    latency_args.chunk_size = latency.default_chunk_size(args.model, latency_args.chunk_size)
    (policy,) = latency.main_policies(latency_args)
    if args.quick:
        torch.set_num_threads(1)

    class Bench(latency.Bench):
        def generate_kwargs(self, policy, inputs, cache, stop_after):
            kwargs = super().generate_kwargs(policy, inputs, cache, stop_after)
            if not cuda:  # transformers compiles on CUDA only, unless asked
                config = CompileConfig()
                config._compile_all_devices = True
                kwargs["compile_config"] = config
            return kwargs

    started = time.perf_counter()
    dtype = torch.bfloat16 if cuda else torch.float32
    model = latency.build_model(args.model, latency_args.device, dtype)
    bench = Bench(enable_raincheck(model), args.model, latency_args, cuda)
    inputs = workload.inputs(latency_args.device, dtype)
    built_s = time.perf_counter() - started
    seconds = []
    for _ in range(2):
        _, _, start, end = bench.generate(inputs, policy, "static")
        seconds.append(end - start)
    return dict(built_s=round(built_s, 2), first_s=round(seconds[0], 2), second_s=round(seconds[1], 3),
                compiled_graphs=int(torch._dynamo.utils.counters["stats"]["unique_graphs"]))


def run_child(args, model: str, method: str, cache_dir: str) -> dict:
    """`child` in a fresh process whose Inductor and Triton caches live under `cache_dir`."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(_HERE), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--method", method,
           "--workload", args.workload, "--new-tokens", str(args.new_tokens), "--device", args.device]
    if args.quick:
        cmd.append("--quick")
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{model} {method}: the child process failed ({done.returncode}):\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1]
    return dict(json.loads(line), process_s=round(time.perf_counter() - started, 1))


def table(records: list[dict]) -> str:
    lines = ["| model | method | caches | first call s | second call s | first / plain's first (same caches) | "
             "warm first / cold first |", "| --- | --- | --- | --- | --- | --- | --- |"]
    by = {(r["model"], r["method"], r["caches"]): r for r in records}
    for r in records:
        plain = by.get((r["model"], "plain", r["caches"]))
        cold = by.get((r["model"], r["method"], "cold"))
        vs_plain = f"{r['first_s'] / plain['first_s']:.2f}" if plain else ""
        warm = f"{r['first_s'] / cold['first_s']:.2f}" if r["caches"] == "warm" and cold else ""
        lines.append(f"| {r['model']} | {r['method']} | {r['caches']} | {r['first_s']:.1f} | {r['second_s']:.2f} | "
                     f"{vs_plain} | {warm} |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny Qwen3.5 on the CPU (Inductor's C++ backend)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--models", default=None, help="comma list of shapes.py's shapes (default: qwen3.5-9b; "
                                                        "--quick: tiny-qwen3.5)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    parser.add_argument("--workload", default="image4096", help="latency.py's workload (image1024, image4096, video16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="forced answer length (64; --quick 24)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="one child process's limit (s)")
    parser.add_argument("--save", action="store_true", help="write cold_start.json to --results-dir")
    parser.add_argument("--results-dir", default=os.path.join(_HERE, "results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device is None:
        import torch
        args.device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    args.new_tokens = args.new_tokens or (24 if args.quick else 64)
    args.models = (args.models or ("tiny-qwen3.5" if args.quick else "qwen3.5-9b")).split(",")
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; allowed: {', '.join(METHODS)}")
    from shapes import SHAPES

    unknown = sorted(set(args.models) - set(SHAPES))
    if unknown:
        parser.error(f"--models: unknown {unknown}; allowed: {', '.join(sorted(SHAPES))}")
    if args.new_tokens < 1:
        parser.error(f"--new-tokens: at least 1, got {args.new_tokens}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    records = []
    for model in args.models:
        for method in args.methods:
            with tempfile.TemporaryDirectory(prefix="cold_start_") as cache_dir:  # empty: a new machine
                for caches in ("cold", "warm"):
                    record = dict(model=model, method=method, caches=caches, workload=args.workload,
                                  new_tokens=args.new_tokens, **run_child(args, model, method, cache_dir))
                    records.append(record)
                    print(f"  {model} {method:9s} {caches}: first call {record['first_s']:7.1f} s, second "
                          f"{record['second_s']:6.2f} s, {record['compiled_graphs']} graphs (process "
                          f"{record['process_s']:.0f} s)", flush=True)
    print("\n" + table(records))
    if args.save:
        import torch
        os.makedirs(args.results_dir, exist_ok=True)
        path = os.path.join(args.results_dir, "cold_start.json")
        head = dict(command=" ".join(["benchmarks/cold_start.py", *(sys.argv[1:] if argv is None else argv)]),
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    torch=torch.__version__, python=platform.python_version(), device=args.device,
                    gpu=torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None)
        with open(path, "w") as f:
            json.dump(dict(header=head, records=records), f, indent=1)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
