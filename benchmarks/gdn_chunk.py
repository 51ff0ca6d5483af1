"""A fused step's Gated DeltaNet window, per call: the one-chunk Triton kernel (`hf_raincheck.gdn_state.chunk_triton`)
against fla-core's chunked function (`kernels.gated_delta` picks between them and the kernel's launch:
`kernels.one_chunk_block_columns`).

    python benchmarks/gdn_chunk.py --device cuda --save          # Qwen3.5-9B's GDN heads, B = 1, 2, 4, 8, 16, 63 rows
    python benchmarks/gdn_chunk.py --quick                       # tiny shapes on the CPU (smoke run)

For each batch size B, a window of `--rows` rows (the default chunk of models with GDN layers, 63) from a state
``[B, 32, 128, 128]`` fp32 (Qwen3.5-9B: 16 key / 32 value heads of 128; bf16 rows, fp32 gates):

* ``fla``: fla-core's ``chunk_gated_delta_rule`` (seven kernels), called as `kernels.gated_delta` calls it;
* ``package`` (CUDA): `kernels.gated_delta("fla", ...)`, what the package runs (``columns``: the kernel's V columns
  per program, 0 where fla's function runs);
* ``triton``: `chunk_triton.chunk_gated_delta`'s default launch (32 V columns per program);
  ``--triton-configs 16:4,64:8``: also with other launch configurations (V columns per program : warps);
* ``torch`` (``--quick`` only): transformers' torch chunked function, the CPU's path.

``--tail``: a Raincheck first prefill's tail after the boundary instead (``[state | I]``, the state and the
transition product in one launch): ``tail`` = `kernels.gated_delta_with_transition` (the package's launch:
`kernels.tail_block_columns` columns per program) and, with ``--triton-configs``, ``tail 32:4`` etc. (columns of
``[state | I]`` per program : warps; the warps other than 4 are not used by the package).

    python benchmarks/gdn_chunk.py --device cuda --tail --rows 30 --batch-sizes 1 2 --triton-configs 32:4,64:4

Each is captured `--reps` times in one CUDA graph (the 24 GDN layers of a step), replayed `--iters` times after a
warm-up; ``us`` = GPU time per call (CUDA events). ``max err``: the largest difference of the outputs and of the
final state from the float64 recurrence (`naive.naive_gated_delta`, on batch row 0). On the CPU (``--quick``): the
torch path, and the kernel too under Triton's interpreter (``TRITON_INTERPRET=1``), host clock (a smoke run, not a
measurement). Writes ``benchmarks/results/gdn_chunk.json`` with ``--save`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hf_raincheck  # noqa: E402
from graph_timing import graph_us_per_call  # noqa: E402
from hf_raincheck.gdn_state import kernels  # noqa: E402
from hf_raincheck.gdn_state.naive import naive_gated_delta, naive_transition  # noqa: E402
from hf_raincheck.triton_support import interpreted, triton_importable  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gdn_chunk.json")


def window(batch, rows, key_heads, value_heads, dim, device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, rows, key_heads, dim, generator=gen).to(device, dtype)
    k = torch.randn(batch, rows, key_heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(batch, rows, value_heads, dim, generator=gen).to(device, dtype)
    g = (-0.5 * torch.rand(batch, rows, value_heads, generator=gen)).to(device)
    beta = torch.rand(batch, rows, value_heads, generator=gen).to(device, dtype)
    state = (0.1 * torch.randn(batch, value_heads, dim, dim, generator=gen)).to(device)
    return q, k, v, g, beta, state


def path_fn(name: str):
    if name.startswith("tail"):
        from hf_raincheck.gdn_state.chunk_triton import chunk_gated_delta_with_transition

        if name == "tail":
            return kernels.gated_delta_with_transition
        return functools.partial(chunk_gated_delta_with_transition, block_v=int(name.split(" ")[1].split(":")[0]))
    if name == "package":
        return functools.partial(kernels.gated_delta, "fla")
    if name.startswith("triton"):
        from hf_raincheck.gdn_state.chunk_triton import chunk_gated_delta

        if name == "triton":
            return chunk_gated_delta
        block_v, warps = (int(x) for x in name.split(" ")[1].split(":"))
        return functools.partial(chunk_gated_delta, block_v=block_v, warps=warps)
    chunk = kernels.functions("fla" if name == "fla" else "torch")[0]

    def call(q, k, v, g, beta, state):
        out, final = chunk(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)
        return out, final.float()

    return call


def max_error(fn, inputs) -> float:
    """The largest difference from the float64 recurrence on batch row 0: outputs, final state, and (a tail's
    ``[state | P]``) the transition product."""
    out, final = fn(*inputs)
    one = [x[:1].cpu() for x in inputs]
    want_out, want_state = naive_gated_delta(*one)
    value_dim = want_state.shape[-1]
    errors = [(out[:1].cpu().double() - want_out).abs().max().item(),
              (final[:1, ..., :value_dim].cpu().double() - want_state).abs().max().item()]
    if final.shape[-1] > value_dim:
        want_p = naive_transition(one[1], one[3], one[4], one[2].shape[2])
        errors.append((final[:1, ..., value_dim:].cpu().double() - want_p).abs().max().item())
    return max(errors)


def time_gpu(fn, layers, iters) -> float:
    """GPU us per call: one call per layer's window in one CUDA graph, replayed `iters` times."""
    return graph_us_per_call([lambda inputs=inputs: fn(*inputs) for inputs in layers], iters)


def time_host(fn, inputs, iters) -> float:
    fn(*inputs)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(*inputs)
        times.append(1e6 * (time.perf_counter() - t0))
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 1 2 4 8 16 (--quick: 1 2)")
    parser.add_argument("--rows", type=int, default=hf_raincheck.RaincheckConfig.CHUNK_GDN,
                        help="rows of the window (default: the chunk of models with GDN layers)")
    parser.add_argument("--reps", type=int, default=24, help="calls per captured CUDA graph (a step's GDN layers)")
    parser.add_argument("--iters", type=int, default=50, help="graph replays timed")
    parser.add_argument("--triton-configs", default="",
                        help="more launch configurations of the kernel, BLOCK_V:warps comma-separated (e.g. 16:4,64:8)")
    parser.add_argument("--tail", action="store_true",
                        help="time a first prefill's tail from [state | I] (chunk_gated_delta_with_transition)")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from hf_raincheck.gdn_state.chunk_triton import CHUNK

    if not 1 <= args.rows <= CHUNK:
        parser.error(f"--rows must be 1 to {CHUNK} (one chunk), got {args.rows}")
    if args.reps < 1 or args.iters < 1:
        parser.error("--reps and --iters must be >= 1")
    configs = [c for c in args.triton_configs.split(",") if c]
    for c in configs:
        if not re.fullmatch(r"\d+:\d+", c):
            parser.error(f"--triton-configs: BLOCK_V:warps pairs comma-separated, got {c!r}")
        if args.tail and not c.endswith(":4"):
            parser.error(f"--triton-configs: the tail's launch runs 4 warps (--tail: BLOCK_V:4), got {c!r}")
    sizes = args.batch_sizes or ([1, 2] if args.quick else [1, 2, 4, 8, 16])
    if min(sizes) < 1:
        parser.error(f"--batch-sizes must be >= 1, got {sizes}")
    device = torch.device("cpu" if args.quick else args.device)
    cuda = device.type == "cuda"
    if args.tail and not (cuda or (interpreted() and triton_importable())):
        parser.error("--tail runs the Triton kernel: --device cuda, or TRITON_INTERPRET=1 on the CPU")
    if args.tail:
        paths = ["tail"] + [f"tail {c}" for c in configs]
    elif cuda:
        paths = (["fla", "package"] if kernels.fla_available() else []) + ["triton"] + [f"triton {c}" for c in configs]
    else:
        paths = ["torch"] + (["triton"] if interpreted() and triton_importable() else [])
    shape, dtype = ((16, 32, 128), torch.bfloat16) if cuda else ((1, 2, 16), torch.float32)
    key_heads, value_heads, dim = shape
    rows = min(args.rows, 8) if args.quick else args.rows

    records = []
    for batch in sizes:
        layers = [window(batch, rows, key_heads, value_heads, dim, device, dtype, seed=i)
                  for i in range(args.reps if cuda else 1)]
        base = None
        for name in paths:
            fn = path_fn(name)
            us = time_gpu(fn, layers, args.iters) if cuda else time_host(fn, layers[0], min(args.iters, 5))
            base = base or us
            error = max_error(fn, window(batch, rows, key_heads, value_heads, dim, device, dtype, seed=99))
            records.append(dict(batch_size=batch, rows=rows, path=name, us=us, vs_first=us / base, max_error=error))
            if name == "package":
                records[-1]["columns"] = kernels.one_chunk_block_columns(
                    rows, batch, value_heads, dim, torch.cuda.get_device_properties(device).multi_processor_count)
                name = f"package ({records[-1]['columns']} columns)"
            if name == "tail" and cuda:
                records[-1]["columns"] = kernels.tail_block_columns(
                    batch, value_heads, dim, dim, torch.cuda.get_device_properties(device).multi_processor_count)
                name = f"tail ({records[-1]['columns']} columns)"
            print(f"B={batch:<3} {rows} rows  {name:13s} {us:9.1f} us  x{us / base:.3f} of {paths[0]}  "
                  f"max err {error:.2e}", flush=True)
    print("\n| B | rows | path | us per call | / " + paths[0] + " | max err |\n| --- | --- | --- | --- | --- | --- |")
    for r in records:
        print(f"| {r['batch_size']} | {r['rows']} | {r['path']} | {r['us']:.1f} | {r['vs_first']:.3f} | "
              f"{r['max_error']:.2e} |")
    out = args.out or (RESULTS if args.save else None)
    if out:
        meta = dict(date=datetime.date.today().isoformat(),
                    device=torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
                    torch=torch.__version__, heads=shape, dtype=str(dtype), reps=args.reps, iters=args.iters,
                    quick=args.quick, tail=args.tail)
        with open(out, "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
