"""A compiled fused step's GDN join, per call: the Triton kernel (`hf_raincheck.gdn_state.join_triton`) against the
torch path it replaced, and the kernel's tilings.

    python benchmarks/gdn_join.py --device cuda --save          # Qwen3.5-9B's GDN heads, B = 1, 8, 16
    python benchmarks/gdn_join.py --device cuda --configs 64:32:8:1,32:32:8:2
    python benchmarks/gdn_join.py --quick                       # tiny shapes on the CPU (smoke run, torch only)

For each batch size B, the ``[S | P_tail]`` buffer ``[B, 32, 128, 256]`` and the prefix checkpoints ``[B, 32,
128, 128]`` of a Qwen3.5-9B GDN layer (fp32; `--heads`, `--key-dim`, `--value-dim` for other shapes):

* ``torch``: ``ops.join_(state, new - old)`` (a ``baddbmm_`` into the S columns: cuBLAS's fp32 GEMM) and
  ``old.copy_(new)``, what compiled fused steps ran before the kernel (and still run with ``HF_RAINCHECK_TRITON=0``);
* ``triton``: `join_triton.join_prefix_` with the package's tiling;
* ``triton:<block_v>:<block_k>:<warps>:<stages>`` (``--configs``): the kernel with that tiling
  (`launch_join_prefix`; 0 = the default of that field).

Each is captured `--reps` times in one CUDA graph (the 24 GDN layers of a step: the calls run back to back as in a
compiled step), replayed `--iters` times after a warm-up; ``us`` = GPU time per call (CUDA events). ``max err``: the
largest difference of the joined S from the float64 reference (`naive.naive_join`). On the CPU (``--quick``): the
torch path, eager, host clock (a smoke run, not a measurement).

Writes ``benchmarks/results/gdn_join.json`` with ``--save`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hf_raincheck  # noqa: E402
from graph_timing import graph_us_per_call  # noqa: E402
from hf_raincheck.gdn_state import ops  # noqa: E402
from hf_raincheck.gdn_state.naive import naive_join  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gdn_join.json")


def torch_join(state, old, new):
    ops.join_(state, new - old)
    old.copy_(new)


def triton_join(tiling: tuple[int, int, int, int] | None):
    from hf_raincheck.gdn_state import join_triton

    if tiling is None:
        return join_triton.join_prefix_
    block_v, block_k, warps, stages = tiling
    return lambda state, old, new: join_triton.launch_join_prefix(state, old, new, block_v=block_v,
                                                                  block_k=block_k, warps=warps, stages=stages)


def buffers(batch, heads, key_dim, value_dim, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(batch, heads, key_dim, value_dim + key_dim, generator=gen).div_(key_dim ** 0.5)
    old = torch.randn(batch, heads, key_dim, value_dim, generator=gen)
    new = old + torch.randn(batch, heads, key_dim, value_dim, generator=gen)
    return state.to(device), old.to(device), new.to(device)


def max_error(fn, batch, heads, key_dim, value_dim, device) -> float:
    state, old, new = buffers(batch, heads, key_dim, value_dim, device, seed=1)
    want = naive_join(state[..., :value_dim].double(), state[..., value_dim:].double(), old.double(), new.double())
    fn(state, old, new)
    return (state[..., :value_dim].double() - want).abs().max().item()


def time_gpu(fn, batch, heads, key_dim, value_dim, device, reps, iters) -> float:
    """GPU us per call: `reps` calls on `reps` layers' buffers in one CUDA graph, replayed `iters` times."""
    layers = [buffers(batch, heads, key_dim, value_dim, device, seed=i) for i in range(reps)]
    return graph_us_per_call([lambda layer=layer: fn(*layer) for layer in layers], iters)


def time_host(fn, batch, heads, key_dim, value_dim, device, reps, iters) -> float:
    state, old, new = buffers(batch, heads, key_dim, value_dim, device)
    fn(state, old, new)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(state, old, new)
        times.append(1e6 * (time.perf_counter() - t0) / reps)
    return statistics.median(times)


def parse_configs(text: str) -> list[tuple[int, int, int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--configs: block_v:block_k:warps:stages items (0 = default), got {item!r}")
        out.append(tuple(int(p) for p in parts))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU, torch path (smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 1 8 16 (--quick: 1 2)")
    parser.add_argument("--heads", type=int, default=32, help="value heads (Qwen3.5-9B: 32)")
    parser.add_argument("--key-dim", type=int, default=128)
    parser.add_argument("--value-dim", type=int, default=128)
    parser.add_argument("--configs", default="", help="kernel tilings block_v:block_k:warps:stages, comma list")
    parser.add_argument("--reps", type=int, default=24, help="calls per captured CUDA graph (a step's GDN layers)")
    parser.add_argument("--iters", type=int, default=50, help="graph replays timed")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    try:
        configs = parse_configs(args.configs)
    except ValueError as error:
        parser.error(str(error))
    for name in ("reps", "iters", "heads", "key_dim", "value_dim"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: at least 1, got {getattr(args, name)}")
    if args.quick:
        args.device, args.heads, args.key_dim, args.value_dim, args.reps, args.iters = "cpu", 2, 16, 16, 2, 3
    sizes = args.batch_sizes or ([1, 2] if args.quick else [1, 8, 16])
    if any(b < 1 for b in sizes):
        parser.error(f"--batch-sizes: sizes >= 1, got {sizes}")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    paths = {"torch": torch_join}
    if cuda:
        paths["triton"] = triton_join(None)
        paths.update({"triton:" + ":".join(map(str, c)): triton_join(c) for c in configs})
    timer = time_gpu if cuda else time_host
    shape = (args.heads, args.key_dim, args.value_dim)
    records = []
    print(f"GDN join, {args.heads} heads, K {args.key_dim}, V {args.value_dim}, fp32, {device}"
          f"{' (GPU us per call, CUDA graphs)' if cuda else ' (host us per call: smoke run)'}")
    print(f"{'B':>3} {'path':26s} {'us':>9} {'/ torch':>8} {'max err':>10}")
    for batch in sizes:
        base = None
        for name, fn in paths.items():
            us = timer(fn, batch, *shape, device, args.reps, args.iters)
            err = max_error(fn, batch, *shape, device)
            base = us if name == "torch" else base
            records.append(dict(batch_size=batch, path=name, us=round(us, 2), vs_torch=round(us / base, 3),
                                max_error=err))
            print(f"{batch:3d} {name:26s} {us:9.2f} {us / base:8.3f} {err:10.2e}", flush=True)
    if args.save or args.out:
        out = args.out or RESULTS
        meta = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv), torch=torch.__version__,
                    hf_raincheck=hf_raincheck.__version__, device=str(device),
                    gpu=torch.cuda.get_device_name(device) if cuda else None,
                    cpu=platform.processor() or platform.machine(),
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    settings=dict(heads=args.heads, key_dim=args.key_dim, value_dim=args.value_dim, reps=args.reps,
                                  iters=args.iters, batch_sizes=sizes, configs=args.configs))
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
