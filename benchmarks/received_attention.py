"""Tuning sweep of the received-attention Triton kernels (`hf_raincheck.pruning.attention_triton`): each pass timed
alone for every launch config of a grid, at Qwen3-VL-8B's ViT shape.

    python benchmarks/received_attention.py --device cuda --out benchmarks/results/received_attention_sweep.json
    PYTHONPATH=/work/triton36 TRITON_INTERPRET=1 python benchmarks/received_attention.py --small --device cpu

Cases (``--cases``): ``image`` (16384 patches, one segment: a 4096-token image) and ``video16`` (16 segments of
1024 patches: 16 frames of 256 tokens); 16 heads of 72, bf16 (``--small``: 96 patches, 2 heads, for a smoke run
under Triton's interpreter).

Per pass and config ``(BLOCK_M queries, BLOCK_N keys, num_warps, num_stages)`` (the tuple of
`attention_triton.CONFIGS`): the median time of ``--repeats`` launches after ``--warmup`` (CUDA events; on the CPU
wall time), and the max relative error ``max |a - b| / max |b|`` of its result against the default config's (pass
1: the LSE; pass 2: the per-head sums, both passes given the default config's LSE). Pass 1 (``lse``) keeps
``BLOCK_M`` queries in registers and loops over key blocks of ``BLOCK_N``; pass 2 (``received``) the other way
round. The grid (``--resident`` tile x ``--loop`` tile x ``--warps`` x ``--stages``, only tiles ``resident *
loop`` of at most ``--max-tile`` elements and at least ``--min-per-warp`` per warp: 36 configs per pass by default)
is the same for both passes, read in their roles; the default config is always timed. Configs that fail (compile:
shared memory, registers; launch) are recorded with their error. Each config costs a compile: ``--budget-s`` stops starting new ones after that many seconds (the rest are recorded as skipped); the
passes' configs are interleaved so both get covered.

Then whole calls, default configs and the best found: `received_attention_triton` (both passes: the path that
recomputes q, k) and `received_attention_from_lse` (pass 2 only: the path that takes the LSE from the ViT's own
flash attention, `hf_raincheck.pruning.vision.FlashLSECapture`).

Prints the fastest 10 per pass (by the sum over the cases) as Markdown tables and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_raincheck.pruning import attention_triton as at  # noqa: E402

#: (segments, patches per segment, heads, head_dim) per case
CASES = {"image": (1, 16384, 16, 72), "video16": (16, 1024, 16, 72)}
SMALL_CASES = {"image": (1, 96, 2, 72), "video3": (3, 32, 2, 72)}
PASSES = ("lse", "received")
#: a config's result this far from the default config's (max relative error) is marked wrong
MAX_REL_ERR = 1e-3


def make_case(segments: int, patches: int, heads: int, head_dim: int, dtype, device, seed: int = 0):
    """``(q, k, start, stop, scale)``: q, k ``[P, heads, head_dim]`` as strided slices of one qkv tensor (as the ViT
    computes them), the per-row segment bounds of `segments` equal segments, the softmax scale."""
    total = segments * patches
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(total, 3, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    q, k, _ = at.prepare_qk(qkv[:, 0], qkv[:, 1])
    start, stop = at.segment_bounds([i * patches for i in range(segments + 1)], total, device)
    return q, k, start, stop, head_dim**-0.5


def config_grid(pass_name: str, resident, loop, warps, stages, max_tile: int, min_per_warp: int) -> list[tuple]:
    """Configs ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of one pass: its resident tile (pass 1: BLOCK_M, pass 2:
    BLOCK_N) x loop tile x warps x stages, with ``min_per_warp * warps <= resident * loop <= max_tile``."""
    out = []
    for r, l, w, s in itertools.product(resident, loop, warps, stages):
        if min_per_warp * w <= r * l <= max_tile:
            out.append((r, l, w, s) if pass_name == "lse" else (l, r, w, s))
    return out


def timed(fn, device: str, warmup: int, repeats: int) -> float:
    """Median time of `fn()` in ms (CUDA events on CUDA)."""
    for _ in range(warmup):
        fn()
    cuda = device.startswith("cuda")
    times = []
    for _ in range(repeats):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` (inf where `got` is not finite where `want` is)."""
    if not torch.isfinite(got[torch.isfinite(want)]).all():
        return float("inf")
    ok = torch.isfinite(want)
    return float((got[ok] - want[ok]).abs().max() / want[ok].abs().max().clamp_min(1e-30))


def run_pass(pass_name: str, config, case) -> torch.Tensor:
    """One launch of `pass_name` with `config` on `case` (pass 2 given the default config's LSE)."""
    q, k, start, stop, scale, lse_default = case
    if pass_name == "lse":
        return at.lse_pass(q, k, start, stop, scale, config)
    return at.received_pass(q, k, start, stop, lse_default, scale, config)


def measure(pass_name: str, config, cases: dict, references: dict, device: str, warmup: int, repeats: int) -> dict:
    """One config's record: per case its median ms and max relative error, or the error that stopped it."""
    record = {"pass": pass_name, "config": list(config), "ms": {}, "max_rel_err": {}, "error": None}
    try:
        for name, case in cases.items():
            got = run_pass(pass_name, config, case)  # compiles (first case) and checks
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            record["max_rel_err"][name] = rel_err(got, references[pass_name][name])
            record["ms"][name] = timed(lambda: run_pass(pass_name, config, case), device, warmup, repeats)
    except Exception as exc:  # out of shared memory / registers, launch errors: the config is out
        lines = str(exc).strip().splitlines()
        record["error"] = f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"
        return record
    record["total_ms"] = sum(record["ms"].values())
    record["ok"] = all(err <= MAX_REL_ERR for err in record["max_rel_err"].values())
    return record


def markdown(records: list[dict], pass_name: str, case_names, default, top: int = 10) -> str:
    done = sorted((r for r in records if r["pass"] == pass_name and r.get("total_ms") is not None),
                  key=lambda r: r["total_ms"])
    head = ["#", "BLOCK_M", "BLOCK_N", "warps", "stages", *[f"{c} ms" for c in case_names], "total ms",
            "max rel err", "ok", ""]
    lines = [f"pass {pass_name}: fastest {min(top, len(done))} of {len(done)} timed",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(done[:top]):
        err = max(r["max_rel_err"].values())
        mark = "default" if tuple(r["config"]) == tuple(default) else ""
        cells = [str(i + 1), *[str(x) for x in r["config"]], *[f"{r['ms'][c]:.3f}" for c in case_names],
                 f"{r['total_ms']:.3f}", f"{err:.1e}", "yes" if r["ok"] else "NO", mark]
        lines.append("| " + " | ".join(cells) + " |")
    base = next((r for r in done if tuple(r["config"]) == tuple(default)), None)
    if base is not None and done:
        lines.append(f"default {tuple(default)}: {base['total_ms']:.3f} ms; best {tuple(done[0]['config'])}: "
                     f"{done[0]['total_ms']:.3f} ms ({base['total_ms'] / done[0]['total_ms']:.2f}x)")
    return "\n".join(lines)


def entry_points(cases: dict, best: dict, device: str, warmup: int, repeats: int) -> dict:
    """Per case the ms of a whole call (segment bounds, launches, head mean) of `received_attention_triton` (both
    passes: the recomputing path) and `received_attention_from_lse` (pass 2 from a natural-log LSE: the path that
    takes the LSE from the ViT's flash attention), with the default configs and with the `best` of the sweep."""
    out = {}
    for name, (q, k, start, stop, scale, lse2) in cases.items():
        cu = torch.unique(torch.cat([start, stop]))  # the segment boundaries (all rows lie in segments)
        lse = lse2 / at.LOG2E
        row = {}
        for label, configs in (("default", {}), ("best", best)):
            if label == "best" and not configs:
                continue
            row[f"both passes, {label}"] = timed(
                lambda: at.received_attention_triton(q, k, cu, scale, configs=configs), device, warmup, repeats
            )
            row[f"from LSE, {label}"] = timed(
                lambda: at.received_attention_from_lse(q, k, lse, cu, scale, config=configs.get("received")),
                device, warmup, repeats,
            )
        out[name] = row
    return out


def entry_markdown(entry: dict) -> str:
    columns = list(next(iter(entry.values())))
    lines = ["whole calls (ms): both passes = q, k recomputed; from LSE = pass 2 after the ViT's flash attention",
             "| case | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for name, row in entry.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:.3f}" for c in columns) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="tiny sizes and two configs per pass (smoke run)")
    parser.add_argument("--cases", nargs="*", default=None, help="cases to time (default: all)")
    parser.add_argument("--passes", nargs="*", default=list(PASSES), choices=PASSES)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--resident", default="64,128,256", help="resident tiles (pass 1: BLOCK_M, pass 2: BLOCK_N)")
    parser.add_argument("--loop", default="32,64,128", help="loop tiles (pass 1: BLOCK_N, pass 2: BLOCK_M)")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--max-tile", type=int, default=16384, help="largest resident x loop tile (elements)")
    parser.add_argument("--min-per-warp", type=int, default=1024, help="smallest resident x loop tile per warp")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=75.0, help="start no new config after this many seconds")
    parser.add_argument("--out", default="received_attention_sweep.json")
    args = parser.parse_args(argv)

    def ints(text):
        return [int(x) for x in text.split(",") if x.strip()]

    device = args.device
    dtype = getattr(torch, args.dtype)
    kind = "16bit" if dtype in (torch.bfloat16, torch.float16) else "fp32"
    defaults = {p: at.CONFIGS[(p, kind)] for p in PASSES}
    shapes = SMALL_CASES if args.small else CASES
    names = args.cases or list(shapes)
    unknown = [n for n in names if n not in shapes]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {sorted(shapes)}")
    grids = {}
    for p in args.passes:
        if args.small:  # the default and one more
            grid = [(64, 32, 4, 2) if p == "lse" else (32, 64, 4, 2)]
        else:
            grid = config_grid(p, ints(args.resident), ints(args.loop), ints(args.warps), ints(args.stages),
                               args.max_tile, args.min_per_warp)
        grids[p] = [tuple(defaults[p])] + [c for c in grid if tuple(c) != tuple(defaults[p])]

    if at.interpreted():  # the interpreter evaluates masked-off lanes too (log2(0), exp2 overflow)
        warnings.filterwarnings("ignore", category=RuntimeWarning)
    print(f"{sum(len(g) for g in grids.values())} configs ({', '.join(f'{p}: {len(grids[p])}' for p in grids)}) on "
          f"{device}, cases {names}", flush=True)
    t_start = time.perf_counter()
    cases, references = {}, {"lse": {}, "received": {}}
    for name in names:
        q, k, start, stop, scale = make_case(*shapes[name], dtype=dtype, device=device)
        lse = at.lse_pass(q, k, start, stop, scale, defaults["lse"])
        cases[name] = (q, k, start, stop, scale, lse)
        references["lse"][name] = lse
        references["received"][name] = at.received_pass(q, k, start, stop, lse, scale, defaults["received"])
    if device.startswith("cuda"):
        torch.cuda.synchronize()

    # interleave the passes' configs: a budget cut leaves both passes covered
    order = [c for pair in itertools.zip_longest(*[[(p, c) for c in grids[p]] for p in args.passes]) for c in pair if c]
    records = []
    for i, (p, config) in enumerate(order):
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            records.append({"pass": p, "config": list(config), "error": "skipped: --budget-s spent"})
            continue
        record = measure(p, config, cases, references, device, args.warmup, args.repeats)
        records.append(record)
        status = record["error"] or f"{record['total_ms']:.3f} ms, err {max(record['max_rel_err'].values()):.1e}"
        print(f"[{i + 1}/{len(order)} {elapsed:5.1f}s] {p} {config}: {status}", flush=True)
    elapsed = time.perf_counter() - t_start

    best = {}
    for p in args.passes:
        ok = [r for r in records if r["pass"] == p and r.get("ok")]
        if ok:
            best[p] = min(ok, key=lambda r: r["total_ms"])["config"]
        print()
        print(markdown(records, p, names, defaults[p]))
    skipped = sum(1 for r in records if (r.get("error") or "").startswith("skipped"))
    failed = sum(1 for r in records if r.get("error") and not r["error"].startswith("skipped"))
    print(f"\n{len(records)} configs in {elapsed:.1f} s: {failed} failed, {skipped} skipped (budget); best {best}")
    entry = entry_points(cases, best, device, args.warmup, args.repeats)
    print()
    print(entry_markdown(entry))

    import triton

    header = {
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "interpreted": os.environ.get("TRITON_INTERPRET", "0") == "1",
        "dtype": args.dtype,
        "cases": {n: dict(zip(("segments", "patches", "heads", "head_dim"), shapes[n])) for n in names},
        "defaults": {p: list(defaults[p]) for p in args.passes},
        "grid": {p: [list(c) for c in grids[p]] for p in args.passes},
        "warmup": args.warmup,
        "repeats": args.repeats,
        "budget_s": args.budget_s,
        "elapsed_s": elapsed,
        "max_rel_err_ok": MAX_REL_ERR,
    }
    with open(args.out, "w") as f:
        json.dump({"header": header, "best": best, "entry_points": entry, "records": records}, f, indent=1)
    print(f"wrote {args.out}")
    return records


if __name__ == "__main__":
    main()
