"""Selection time of each pruning selector at Qwen3-VL-8B shapes (random inputs), optionally next to Full TTFT.

    python benchmarks/selector_speed.py --device cuda                    # 1024- and 4096-token images, 16-frame video
    python benchmarks/selector_speed.py --device cuda --ttft             # + Full TTFT of a random-weight Qwen3-VL-8B
    python benchmarks/selector_speed.py --small --device cpu             # CPU smoke run with small sizes (seconds)
    python benchmarks/selector_speed.py --device cuda --paths triton,torch   # the Triton kernels next to the torch loops
    python benchmarks/selector_speed.py --device cuda --selectors mmtok --options '{"mmtok": {"late_stage": "off"}}'

What is timed, per case and selector (median of ``--repeats`` after one warm-up, CUDA-synchronised):

- ``first_call_ms``: the first ``select_kept`` of a shape (on CUDA it captures the greedy loop's CUDA graph, see
  `hf_raincheck.pruning.greedy`; mmtok's ``cuda_graphs: false`` option times the eager loop instead);
- ``select_ms``: ``select_kept(name, ctx)`` on a context like the one `generate` builds: placeholder embeddings
  ``[N, hidden]`` (bf16 on CUDA), a question of ``--query-tokens`` tokens, and the vision extras the selector
  declares (random; selection time does not depend on values: the greedy selectors always run ``b`` steps);
- ``extras_ms``: computing those extras inside the vision pass, per requested block (hiprune: 2 blocks,
  visionzip: 1) the attention its keys receive, pooling of the last block's output (mmtok). With Triton on CUDA
  (``vision_attention: "lse"``) the block's own per-segment SDPA calls return their log-sum-exp
  (`hf_raincheck.pruning.vision.FlashLSECapture`) and only the second Triton pass runs: timed as those calls plus
  the pass, minus the same calls made plainly. Otherwise (``"recompute"``) `received_attention` from q/k
  ``[4N, heads, head_dim]`` (both passes);
- ``total_ms`` = select + extras, and its share of Full TTFT when ``--ttft`` is given (one plain ``generate``
  step of the same media on a random-weight model of the shape).

Cases (``--cases``): ``image1024`` (32x32 merged tokens), ``image4096`` (64x64), ``video16`` (16 frames, i.e.
temporal grid steps, of 16x16 tokens: each frame a span with its own budget). Retention ``--retention`` (0.3).
Writes a JSON table (``--out``) and prints a Markdown table.
"""

from __future__ import annotations

import os
import sys

# this file's name shadows the standard library's `selectors` (imported by subprocess, asyncio, ...) when run as
# a script: take its folder off the import path first, and put the repository root on it
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from hf_raincheck import RaincheckConfig  # noqa: E402
from hf_raincheck.pruning import SelectionContext, select_kept, selector_requirements  # noqa: E402
from hf_raincheck.pruning.base import VISION_ATTENTION, VISION_DEPTH, VISION_HIDDEN  # noqa: E402
from hf_raincheck.triton_support import triton_enabled  # noqa: E402
from hf_raincheck.pruning.vision import pool_merged, received_attention  # noqa: E402

SELECTORS = ["mmtok", "hiprune", "divprune", "visionzip", "uniform", "random"]

# Qwen3-VL-8B: LLM hidden 4096; ViT depth 27, hidden 1152, 16 heads (head_dim 72), merge 2
SHAPES = {
    "qwen3-vl-8b": dict(hidden=4096, vit_hidden=1152, vit_heads=16, vit_depth=27),
    "small": dict(hidden=256, vit_hidden=64, vit_heads=4, vit_depth=4),
}
CASES = {
    "image1024": [(32, 32)],
    "image4096": [(64, 64)],
    "video16": [(16, 16)] * 16,
}
SMALL_CASES = {
    "image64": [(8, 8)],
    "image256": [(16, 16)],
    "video4": [(8, 8)] * 4,
}
IMAGE, VIDEO, VSTART, VEND = 1001, 1002, 1003, 1004


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> float:
    """Median wall time of `fn()` in ms over `repeats` runs after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build_context(grids, shape: dict, retention: float, query_tokens: int, device: str, dtype) -> SelectionContext:
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids, spans = [VSTART], []
    for h, w in grids:
        start = len(ids)
        ids += [IMAGE] * (h * w)
        spans.append((start, len(ids)))
        ids += [VEND, VSTART]
    ids += list(range(10, 10 + query_tokens))
    n = sum(h * w for h, w in grids)
    config = RaincheckConfig(retention=retention)
    depth = shape["vit_depth"]
    extras = {
        VISION_HIDDEN: torch.randn(n, shape["vit_hidden"], generator=gen).to(device),
        VISION_ATTENTION: {b: torch.rand(n, generator=gen).to(device) for b in range(depth)},
        VISION_DEPTH: depth,
    }
    return SelectionContext(
        input_ids=torch.tensor(ids),
        spans=spans,
        budgets=[config.kept_budget(h * w) for h, w in grids],
        modalities=["image" if len(grids) == 1 else "video"] * len(grids),
        grids=[(1, h, w) for h, w in grids],
        embeddings=torch.randn(n, shape["hidden"], generator=gen).to(device, dtype),
        query_ids=torch.arange(query_tokens),
        query_embeds=torch.randn(query_tokens, shape["hidden"], generator=gen).to(device, dtype),
        extras=extras,
    )


def extras_time(name: str, grids, shape: dict, device: str, dtype, repeats: int) -> tuple[float, str | None]:
    """Time to compute the selector's vision extras during the vision pass (attention of its blocks, pooling), and
    how the attention was computed: ``"lse"`` (the package's path where SDPA runs the block with its flash / cuDNN
    backend: the block's own calls return the log-sum-exp, and the extra time is theirs minus plain SDPA's, plus
    pass 2), ``"recompute"`` (both passes from q, k: `received_attention`), or None (no attention needed)."""
    import torch.nn.functional as F

    from hf_raincheck.pruning.vision import FlashLSECapture

    want = selector_requirements(name, {}, shape["vit_depth"])
    if not want:
        return 0.0, None
    patches = 4 * sum(h * w for h, w in grids)
    heads = shape["vit_heads"]
    head_dim = shape["vit_hidden"] // heads
    gen = torch.Generator(device="cpu").manual_seed(1)
    q, k, v = (torch.randn(patches, heads, head_dim, generator=gen).to(device, dtype) for _ in range(3))
    hidden = torch.randn(patches, shape["vit_hidden"], generator=gen).to(device, dtype)
    bounds = [0]
    for h, w in grids:
        bounds.append(bounds[-1] + 4 * h * w)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    # the ViT's own calls, as transformers' Qwen-VL vision attention makes them: one SDPA call per segment
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    segments = list(zip(bounds[:-1], bounds[1:]))

    def vit_attention():
        for a, b in segments:
            F.scaled_dot_product_attention(q4[:, :, a:b], k4[:, :, a:b], v4[:, :, a:b], scale=scale)

    def vit_attention_with_lse():
        with FlashLSECapture() as capture:
            vit_attention()
        return capture.received_attention(patches)

    lse = triton_enabled(torch.device(device)) and want[VISION_ATTENTION] and vit_attention_with_lse() is not None
    blocks = len(want[VISION_ATTENTION])

    def run():
        for _ in want[VISION_ATTENTION]:
            if lse:
                pool_merged(vit_attention_with_lse(), 4)
            else:
                pool_merged(received_attention(q, k, cu, scale), 4)
        if want[VISION_HIDDEN]:
            pool_merged(hidden, 4)

    ms = timed(run, device, repeats)
    if lse:  # the blocks' own attention is part of the tower's time, not the selector's
        ms -= blocks * timed(vit_attention, device, repeats)
    return ms, ("lse" if lse else "recompute") if blocks else None


def full_ttft(model, grids, query_tokens: int, device: str, dtype, repeats: int) -> float:
    """Median time of one plain `generate` step (vision + full prefill + first token) on these media."""
    gen = torch.Generator().manual_seed(0)
    video = len(grids) > 1
    token = VIDEO if video else IMAGE
    h, w = grids[0]
    n = sum(a * b for a, b in grids)
    ids = []
    for a, b in grids:  # Qwen3-VL: each video frame (temporal grid step) is its own <vs> ... <ve> run
        ids += [VSTART] + [token] * (a * b) + [VEND]
    ids += torch.randint(0, 1000, (query_tokens,), generator=gen).tolist()
    input_ids = torch.tensor([ids], device=device)
    patch_dim = 3 * 2 * 16 * 16
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    grid = torch.tensor([[len(grids), 2 * h, 2 * w]], device=device)
    pixels = torch.randn(4 * n, patch_dim, generator=gen).to(device, dtype)
    if video:
        inputs.update(pixel_values_videos=pixels, video_grid_thw=grid, mm_token_type_ids=(input_ids == VIDEO).int() * 2)
    else:
        inputs.update(pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(input_ids == IMAGE).int())

    def run():
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=1, do_sample=False)

    return timed(run, device, repeats)


def profile_selection(name: str, ctx, case: str, device: str) -> None:
    """Prints one ``select_kept`` call under torch.profiler: its wall time and the operators sorted by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        select_kept(name, ctx)
        sync(device)
        wall = (time.perf_counter() - t0) * 1e3
    sort = "cuda_time_total" if device.startswith("cuda") else "cpu_time_total"
    print(f"\n## profile: {case} {name} (wall {wall:.2f} ms under the profiler)\n"
          + prof.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=60), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="small sizes (CPU smoke run)")
    parser.add_argument("--cases", nargs="*", default=None, help=f"cases (default: all of {sorted(CASES)})")
    parser.add_argument("--selectors", nargs="*", default=SELECTORS)
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--query-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ttft", action="store_true", help="also time Full TTFT on a random-weight model")
    parser.add_argument("--paths", default="auto",
                        help="comma list of kernel paths to time side by side: triton, torch (HF_RAINCHECK_TRITON=1/0), "
                             "or auto (this environment's)")
    parser.add_argument("--options", default="{}",
                        help="JSON object of pruning_options per selector, e.g. '{\"mmtok\": {\"late_stage\": [128, 8], "
                             "\"cuda_graphs\": false}}' (each selector's module docstring lists its options)")
    parser.add_argument("--profile", action="store_true",
                        help="also print a torch.profiler table (GPU time by kernel) of one select_kept call per case "
                             "and selector, to see where selection time goes")
    parser.add_argument("--out", default="selectors.json")
    args = parser.parse_args(argv)

    device = args.device
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in ("auto", "triton", "torch")]
    if bad or not paths:
        parser.error(f"--paths: comma list of auto, triton, torch; got {args.paths!r}")
    try:
        options = json.loads(args.options)
    except json.JSONDecodeError as err:
        parser.error(f"--options: not JSON ({err}): {args.options!r}")
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        parser.error(f"--options: a JSON object of {{selector: {{option: value}}}}, got {args.options!r}")
    for name, given in options.items():
        RaincheckConfig(pruning=name, pruning_options=given)  # unknown selectors, options or values: ValueError
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    shape = SHAPES["small" if args.small else "qwen3-vl-8b"]
    cases = SMALL_CASES if args.small else CASES
    names = args.cases or list(cases)
    model = None
    if args.ttft:
        # the random-weight model of benchmarks/latency.py
        spec = importlib.util.spec_from_file_location("raincheck_latency_bench", os.path.join(_HERE, "latency.py"))
        latency = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = latency  # its dataclasses look their module up while being built
        spec.loader.exec_module(latency)
        model = latency.build_model("tiny" if args.small else "qwen3-vl-8b", device, dtype)

    if device.startswith("cuda"):  # CUDA context, cuBLAS handles: not part of any selector's time
        torch.ones(64, 64, device=device) @ torch.ones(64, 64, device=device)
        sync(device)
    rows = []
    for case in names:
        grids = cases[case]
        ctx = build_context(grids, shape, args.retention, args.query_tokens, device, dtype)
        ttft = full_ttft(model, grids, args.query_tokens, device, dtype, args.repeats) if model is not None else None
        for name, path in [(name, path) for name in args.selectors for path in paths]:
            if path != "auto":
                os.environ["HF_RAINCHECK_TRITON"] = "1" if path == "triton" else "0"
            ctx.options = dict(options.get(name, {}))
            sync(device)
            t0 = time.perf_counter()
            select_kept(name, ctx)  # first call of this shape: includes capturing the greedy loop's CUDA graph
            sync(device)
            cold_ms = (time.perf_counter() - t0) * 1e3
            select_ms = timed(lambda: select_kept(name, ctx), device, args.repeats)
            extra_ms, attention = extras_time(name, grids, shape, device, dtype, args.repeats)
            if args.profile:
                profile_selection(name, ctx, case, device)
            row = dict(
                case=case,
                selector=name,
                path="triton" if triton_enabled(device) else "torch",  # what ran (no Triton: torch either way)
                options=ctx.options,
                tokens=sum(h * w for h, w in grids),
                spans=len(grids),
                kept=sum(ctx.budgets),
                select_ms=round(select_ms, 3),
                first_call_ms=round(cold_ms, 3),
                extras_ms=round(extra_ms, 3),
                vision_attention=attention,
                total_ms=round(select_ms + extra_ms, 3),
                full_ttft_ms=None if ttft is None else round(ttft, 3),
                share_of_ttft=None if ttft is None else round((select_ms + extra_ms) / ttft, 4),
            )
            rows.append(row)
            print(json.dumps(row), flush=True)

    meta = dict(
        device=torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        torch=torch.__version__,
        shape=shape,
        retention=args.retention,
        query_tokens=args.query_tokens,
        repeats=args.repeats,
        options=options,
        command=" ".join(sys.argv),
    )
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=2)
    print()
    print("| case | selector | path | tokens | spans | kept | first call ms | select ms | extras ms | total ms | Full TTFT ms | share |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ttft = "-" if r["full_ttft_ms"] is None else f"{r['full_ttft_ms']:.1f}"
        share = "-" if r["share_of_ttft"] is None else f"{100 * r['share_of_ttft']:.1f}%"
        print(
            f"| {r['case']} | {r['selector']} | {r['path']} | {r['tokens']} | {r['spans']} | {r['kept']} | {r['first_call_ms']:.2f} | "
            f"{r['select_ms']:.2f} | "
            f"{r['extras_ms']:.2f} | {r['total_ms']:.2f} | {ttft} | {share} |"
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
