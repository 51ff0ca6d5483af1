"""Host time of one GDN layer's prefill kernel call: Hard's (`ops.advance`) and Raincheck's with a boundary inside
the rows (`ops.advance_split`), each by the paths the package can take.

    python benchmarks/gdn_prefill_host.py                    # tiny heads on the CPU (torch kernels), seconds
    python benchmarks/gdn_prefill_host.py --device cuda      # Qwen3.5-9B's heads, fla-core: 1,250 rows, boundary at 1,220

An eager prefill of a pruned prompt waits on the host (fla-core's chunked function: seven Triton launches per call
for ~0.12 ms of GPU work at 1,250 rows), so what a call costs the host is what the prefill pays. Paths:

* ``hard``: `ops.advance` (on CUDA with fla-core: through `gdn_state.graphed`'s CUDA graph of the rows' bucket);
  ``hard_direct``: `kernels.gated_delta` without the graph;
* ``raincheck``: `ops.advance_split` with a short tail (the rows before the boundary and the 30 rows after it in
  the one-chunk Triton kernel, both in one CUDA graph: `graphed.graphed_split`); ``raincheck_long``: a tail of 200 rows (longer than one chunk: from ``[S_b |
  I]`` through its own bucket's graph); ``raincheck_direct`` / ``raincheck_long_direct``: the same two calls of
  fla's functions without graphs or the Triton kernel (`kernels.gated_delta` directly; the references).

Per path, interleaved rounds (after warm-ups that capture the graphs): host time (the call returning, no sync) and
total (to a sync after it), medians in us; and the largest relative difference of each path's outputs from its
reference (the ``_direct`` paths). ``--out`` saves the table as JSON; ``--profile N`` prints where N calls of each
graphed path spend their host time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from hf_raincheck.gdn_state import graphed, kernels, ops  # noqa: E402


def _rows(rows: int, heads: tuple[int, int, int, int], device, dtype):
    key_heads, value_heads, key_dim, value_dim = heads
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, rows, key_heads, key_dim, generator=gen)
    k = torch.randn(1, rows, key_heads, key_dim, generator=gen)
    v = torch.randn(1, rows, value_heads, value_dim, generator=gen)
    g = -0.1 * torch.rand(1, rows, value_heads, generator=gen)
    beta = torch.rand(1, rows, value_heads, generator=gen)
    return [x.to(device, dtype if x is not g else torch.float32) for x in (q, k, v, g, beta)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=0, help="rows of the call (0: 1250 on CUDA, 200 on the CPU)")
    parser.add_argument("--cut", type=int, default=0, help="Raincheck's boundary, short tail (0: rows - 30)")
    parser.add_argument("--long-cut", type=int, default=0, help="the boundary of the long tail (0: rows - 200; rows / 4 up to 400 rows)")
    parser.add_argument("--heads", default="", help="H_k,H_v,K,V (default: 16,32,128,128 on CUDA, 2,4,16,16 on CPU)")
    parser.add_argument("--rounds", type=int, default=0, help="interleaved rounds (0: 60 on CUDA, 3 on the CPU)")
    parser.add_argument("--out", default="", help="write the table as JSON here")
    parser.add_argument("--profile", type=int, default=0, metavar="CALLS",
                        help="also profile CALLS calls of each graphed path (hard, raincheck, raincheck_long) and "
                             "print their host operators (torch.profiler, by self CPU time)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    rows = args.rows or (1250 if cuda else 200)
    cut = args.cut or rows - 30
    long_cut = args.long_cut or (rows - 200 if rows > 400 else rows // 4)
    heads = tuple(int(x) for x in (args.heads or ("16,32,128,128" if cuda else "2,4,16,16")).split(","))
    rounds = args.rounds or (60 if cuda else 3)
    if len(heads) != 4 or not 0 < cut < rows or not 0 < long_cut < rows:
        parser.error("--heads needs four numbers and 0 < --cut, --long-cut < --rows")
    backend = kernels.resolve("auto", device)
    dtype = torch.bfloat16 if cuda else torch.float32
    q, k, v, g, beta = _rows(rows, heads, device, dtype)
    most = kernels.FLA_EAGER_RECURRENT_MAX_ROWS
    eye = torch.eye(heads[2], dtype=torch.float32, device=device).expand(1, heads[1], heads[2], heads[2])

    def direct(at):  # the rows before the boundary, then the tail from [S_b | I] with values [v | 0]
        head, boundary = kernels.gated_delta(backend, *(x[:, :at] for x in (q, k, v, g, beta)), None, most)
        tail_v = torch.cat([v[:, at:], v.new_zeros(*v[:, at:].shape[:-1], heads[2])], dim=-1)
        tail, live = kernels.gated_delta(backend, q[:, at:], k[:, at:], tail_v, g[:, at:], beta[:, at:],
                                         torch.cat([boundary, eye], dim=-1), most)
        return torch.cat([head, tail[..., : heads[3]]], dim=1), boundary, live

    paths = {
        "hard": lambda: ops.advance(backend, q, k, v, g, beta, None),
        "hard_direct": lambda: kernels.gated_delta(backend, q, k, v, g, beta, None,
                                                   kernels.FLA_EAGER_RECURRENT_MAX_ROWS),
        "raincheck": lambda: ops.advance_split(backend, q, k, v, g, beta, None, cut),
        "raincheck_direct": lambda: direct(cut),
        "raincheck_long": lambda: ops.advance_split(backend, q, k, v, g, beta, None, long_cut),
        "raincheck_long_direct": lambda: direct(long_cut),
    }
    graphed.MAX_GRAPHS = max(graphed.MAX_GRAPHS, 4)  # every path's graphs kept (a forward needs one or two)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = {name: ([], []) for name in paths}
    with torch.no_grad():
        for fn in paths.values():
            for _ in range(3):
                fn()
        for _ in range(rounds):
            for name, fn in paths.items():
                sync()
                start = time.perf_counter()
                fn()
                host = time.perf_counter() - start
                sync()
                times[name][0].append(host * 1e6)
                times[name][1].append((time.perf_counter() - start) * 1e6)
        outs = {name: fn() for name, fn in paths.items()}
    reference = {"hard": "hard_direct", "raincheck": "raincheck_direct", "raincheck_long": "raincheck_long_direct"}
    table = []
    for name in paths:
        ref = reference.get(name)
        diff = max(_rel(a, b) for a, b in zip(outs[name], outs[ref])) if ref else 0.0
        table.append(dict(path=name, host_us=statistics.median(times[name][0]),
                          total_us=statistics.median(times[name][1]), rel_diff=diff, reference=ref or ""))
    print(f"{backend} kernels on {device}: {rows} rows, boundary at {cut} (long tail: {long_cut}), heads {heads}, {dtype}, "
          f"{rounds} rounds, graphs kept {len(graphed._GRAPHS)}")
    print("| path | host us | total us | relative difference | against |")
    print("| --- | --- | --- | --- | --- |")
    for r in table:
        print(f"| {r['path']} | {r['host_us']:.1f} | {r['total_us']:.1f} | {r['rel_diff']:.2e} | {r['reference']} |")
    if args.profile:
        profile(paths, args.profile, cuda)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=str(device), backend=backend, rows=rows, cut=cut, long_cut=long_cut, heads=heads, rounds=rounds,
                           dtype=str(dtype), table=table), f, indent=1)
    return 0


def profile(paths: dict, calls: int, cuda: bool) -> None:
    """`calls` calls of each graphed path under torch.profiler: where a call's host time goes (the rows' copies
    into the graph's static buffers, the replay, the outputs' copies), by self CPU time."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad():
        for name in ("hard", "raincheck", "raincheck_long"):
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(calls):
                    paths[name]()
                if cuda:
                    torch.cuda.synchronize()
            print(f"\n## {name}: {calls} calls, host operators by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    sys.exit(main())
