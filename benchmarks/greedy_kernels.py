"""The Triton greedy kernels alone (`hf_raincheck.pruning.greedy_triton`), at Qwen3-VL-8B selection shapes.

    python benchmarks/greedy_kernels.py --device cuda                 # the GPU run
    TRITON_INTERPRET=1 python benchmarks/greedy_kernels.py --small    # CPU smoke run under Triton's interpreter

`selector_speed.py` times whole selectors; this times the greedy loop only, to see where a step's time goes:

- MMTok (`coverage_order_triton`) for every split count (programs per span meeting at a per-step barrier; 1 = no
  barrier) on covers built like `mmtok.coverage_matrix` from random features (hidden 4096, ViT 1152, a 24-token
  question), retention 0.3: ms per call (the kernel's one-pass preparation of the matrix included) and us per
  greedy step, and how many cover rows changed over the loop
  (the incremental update's work);
- MMTok in two launches (``--late step:splits,...``: the early steps with `coverage_plan`'s split count, the rest
  from that step with that many programs in the late kernel; ``default``: `coverage_stages`' own choice,
  ``none``: one launch); ``--smooth K`` takes spatially smooth features instead of independent random ones;
- DivPrune (`divprune_steps_triton`) on the same spans' features.

Median of ``--repeats`` CUDA-synchronised calls after a warm-up (the warm-up compiles). Writes ``--out`` (JSON)
and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_raincheck.pruning import divprune  # noqa: E402
from hf_raincheck.triton_support import sm_count  # noqa: E402
from hf_raincheck.pruning.mmtok import coverage_matrix, fixed_point, fixed_point_scales  # noqa: E402

CASES = {"image1024": (1, 1024), "image4096": (1, 4096), "video16": (16, 256)}
SMALL_CASES = {"image64": (1, 64), "video4": (4, 16)}


def timed(fn, device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_mmtok(run, fields: dict, budget: int, device, repeats: int, reference):
    """One MMTok kernel variant ``run()``: ``(row, reference)``, the row `fields` plus ms per call, us per step and
    whether the picks equal `reference` (the first picks measured, returned), or a "barrier gave up" row."""
    order = run()
    if order is None:
        return dict(fields, ms=None, note="barrier gave up"), reference
    reference = order if reference is None else reference
    ms = timed(run, device, repeats)
    return dict(fields, ms=round(ms, 3), us_per_step=round(1e3 * ms / budget, 2),
                same_picks=bool(torch.equal(order, reference))), reference


def changed_rows(cover: torch.Tensor, order: torch.Tensor) -> int:
    """Rows whose best value rose over the greedy loop, summed over steps (span 0)."""
    best = torch.zeros(cover.shape[1], device=cover.device)
    total = 0
    for j in order[0].tolist():
        col = cover[0, :, j]
        total += int((col > best).sum())
        best = torch.maximum(best, col)
    return total


PHASE_NAMES = ("proposal", "barrier", "take column", "update gains", "to next step")


def step_phases(run, batch: int, budget: int, splits: int, call_ms: float) -> dict:
    """One call with the kernel's clock readings (``phases=``): median us per step of each phase, over steps 1 ..
    (step 0 updates every row) and all programs. Cycles become us at the rate that makes program 0's steps span
    the call's measured time."""
    device = torch.device("cuda")
    clocks = torch.zeros(batch, budget, splits, 5, dtype=torch.long, device=device)
    run(phases=clocks)
    torch.cuda.synchronize()
    c = clocks[0].double().cpu()  # [budget, splits, 5]: start, proposal, barrier, column taken, gains updated
    per_ns = float(c[-1, 0, 4] - c[0, 0, 0]) / (call_ms * 1e6)  # cycles per ns (the SM clock, GHz)
    spans = torch.stack([c[:, :, 1] - c[:, :, 0], c[:, :, 2] - c[:, :, 1], c[:, :, 3] - c[:, :, 2],
                         c[:, :, 4] - c[:, :, 3]], dim=-1)[1:]  # [budget - 1, splits, 4]
    gap = c[1:, :, 0] - c[:-1, :, 4]  # the end of one step to the start of the next
    out = {name: round(float(spans[..., i].median()) / per_ns / 1e3, 3) for i, name in enumerate(PHASE_NAMES[:4])}
    out["to next step"] = round(float(gap.median()) / per_ns / 1e3, 3)
    out["step"] = round(float((c[1:, :, 0] - c[:-1, :, 0]).median()) / per_ns / 1e3, 3)
    out["barrier_p90"] = round(float(spans[..., 1].quantile(0.9)) / per_ns / 1e3, 3)
    out["clock_ghz"] = round(per_ns, 3)
    return out


def save(args, device, rows: list[dict]) -> None:
    """Writes ``--out`` (rewritten after every measurement: a run cut short keeps what it measured)."""
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                command=" ".join(sys.argv), retention=args.retention, repeats=args.repeats)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=2)


def features(batch: int, n: int, dim: int, smooth: int, gen) -> torch.Tensor:
    """``[batch, n, dim]`` token features on a square grid of n tokens: independent normal (``smooth`` 0), or a
    normal field on a grid `smooth` times coarser, bilinearly interpolated, plus noise of half its scale (nearby
    tokens alike, as in images)."""
    if smooth <= 0:
        return torch.randn(batch, n, dim, generator=gen)
    side = int(round(n ** 0.5))
    coarse = torch.randn(batch, dim, max(1, side // smooth), max(1, side // smooth), generator=gen)
    field = torch.nn.functional.interpolate(coarse, size=(side, side), mode="bilinear", align_corners=False)
    return field.flatten(2).transpose(1, 2) + 0.5 * torch.randn(batch, n, dim, generator=gen)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="small sizes (CPU, Triton's interpreter)")
    parser.add_argument("--splits", default="1,2,4,8,16,32,64", help="comma list of MMTok split counts to try")
    parser.add_argument("--warps", default="",
                        help="comma list of warps per MMTok program to try (default: the kernel's)")
    parser.add_argument("--phases", action="store_true",
                        help="also record where an MMTok step's time goes (the kernel's clock readings, CUDA only)")
    parser.add_argument("--tiles", default="",
                        help="comma list of MMTok changed-row tiles to try (default: the kernel's)")
    parser.add_argument("--late", default="",
                        help="comma list of MMTok late stages to try, step:splits (e.g. 192:8) or "
                             "step:splits:warps:list_len (e.g. 192:8:4:32), 'default' (coverage_stages' choice) or "
                             "'none' (one launch of coverage_plan's split count)")
    parser.add_argument("--smooth", type=int, default=0,
                        help="features varying smoothly over each span's grid (a random field on a grid this many "
                             "times coarser, interpolated, plus noise) instead of independent random ones (0)")
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="greedy_kernels.json")
    args = parser.parse_args(argv)

    from hf_raincheck.pruning import greedy_triton

    device = torch.device(args.device)
    hidden, vit, query = (64, 32, 6) if args.small else (4096, 1152, 24)
    cases = SMALL_CASES if args.small else CASES
    gen = torch.Generator().manual_seed(0)
    rows = []
    for case, (batch, n) in cases.items():
        x = features(batch, n, hidden, args.smooth, gen).to(device)
        x_c = features(batch, n, vit, args.smooth, gen).to(device)
        z = torch.randn(query, hidden, generator=gen).to(device)
        cover = coverage_matrix(x, x_c, z, 0.5, 0.01, 0.2)
        budget = max(1, round(args.retention * n))
        width = max(n, 64)
        scales = fixed_point_scales(cover, width)
        scaled = fixed_point(cover, width, scales)
        reference = None
        base = dict(case=case, kernel="mmtok", spans=batch, tokens=n, budget=budget)
        warps_tried = [int(w) for w in args.warps.split(",") if w.strip()] or [None]
        tiles_tried = [int(t) for t in args.tiles.split(",") if t.strip()] or [None]
        for splits in [int(s) for s in args.splits.split(",") if s.strip()]:
            if splits > 1 and (n // splits < 16 or (device.type != "cuda")):
                continue  # at least 16 columns a program; barriers need a GPU (the interpreter runs programs in turn)
            if splits * batch > sm_count(device) and splits > 1:
                continue  # the grid must be resident at once
            for warps, tile in [(w, t) for w in warps_tried for t in tiles_tried]:
                def run(splits=splits, warps=warps, tile=tile, phases=None):
                    return greedy_triton.coverage_order_triton(cover, scales, budget, width + 1, splits=splits,
                                                               num_warps=warps, tile_r=tile, phases=phases)

                row, reference = measure_mmtok(run, dict(base, splits=splits, warps=warps, tile_r=tile), budget,
                                               device, args.repeats, reference)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.phases and device.type == "cuda" and row["ms"] is not None:
                    row["phases"] = step_phases(run, batch, budget, splits, row["ms"])
                    print(json.dumps(row["phases"]), flush=True)
                save(args, device, rows)
        for option in [o.strip() for o in args.late.split(",") if o.strip()]:
            if option == "default":
                late = None
            elif option == "none":
                late = (budget, 1)
            else:  # step:splits, or step:splits:warps:list_len
                late = tuple(int(part) for part in option.split(":"))
            try:
                stages = greedy_triton.coverage_stages(n, batch, budget, device, late=late)
            except ValueError as err:
                rows.append(dict(base, late=option, ms=None, note=str(err)))
                continue

            def run_late(late=late):
                return greedy_triton.coverage_order_triton(cover, scales, budget, width + 1, late=late)

            fields = dict(base, late=option, stages=[list(st[:2]) for st in stages],
                          splits="+".join(str(st[1]) for st in stages))
            row, reference = measure_mmtok(run_late, fields, budget, device, args.repeats, reference)
            rows.append(row)
            print(json.dumps(row), flush=True)
            save(args, device, rows)
        plan = greedy_triton.coverage_plan(n, batch, device)
        rows.append(dict(case=case, kernel="mmtok", plan_splits=plan[0], plan_block=plan[1]))
        if reference is not None:
            rows.append(dict(case=case, kernel="mmtok", changed_rows=changed_rows(scaled, reference), budget=budget))
        feats = divprune.l2_normalize(x)
        sim = torch.matmul(feats, feats.transpose(1, 2))
        eye = torch.eye(n, dtype=torch.bool, device=device)
        first = sim.masked_fill(eye, float("-inf")).amax(dim=-1).argmin(dim=-1)
        order = torch.empty(batch, budget, dtype=torch.long, device=device)
        order[:, 0] = first

        def run_divprune():
            nearest = sim[torch.arange(batch, device=device), first].clone()
            nearest[torch.arange(batch, device=device), first] = float("inf")
            greedy_triton.divprune_steps_triton(sim, nearest, order, 1, budget)

        ms = timed(run_divprune, device, args.repeats)
        rows.append(dict(case=case, kernel="divprune", spans=batch, tokens=n, budget=budget, ms=round(ms, 3),
                         us_per_step=round(1e3 * ms / budget, 2)))
        print(json.dumps(rows[-1]), flush=True)
        save(args, device, rows)

    save(args, device, rows)
    print("\n| case | kernel | splits | late | warps | tile | ms | us / step | same picks |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "ms" in r:
            print(f"| {r['case']} | {r['kernel']} | {r.get('splits', '-')} | {r.get('late', '-')} | "
                  f"{r.get('warps') or '-'} | {r.get('tile_r') or '-'} | {r['ms']} | {r.get('us_per_step', '-')} | "
                  f"{r.get('same_picks', '-')} |")
    phased = [r for r in rows if "phases" in r]
    if phased:
        print("\nWhere an MMTok step's time goes (us per step, median over steps 1.. and programs; the clock rate is "
              "the one that makes the steps add up to the measured call)\n")
        print("| case | splits | " + " | ".join(PHASE_NAMES) + " | step |\n|" + " --- |" * (len(PHASE_NAMES) + 3))
        for r in phased:
            ph = r["phases"]
            print(f"| {r['case']} | {r['splits']} | " + " | ".join(str(ph[k]) for k in PHASE_NAMES)
                  + f" | {ph['step']} |")
    for r in rows:
        if "plan_splits" in r:
            print(f"{r['case']}: coverage_plan picks {r['plan_splits']} programs of {r['plan_block']} columns")
    for r in rows:
        if "changed_rows" in r:
            print(f"{r['case']}: {r['changed_rows']} cover rows changed over {r['budget']} steps")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
