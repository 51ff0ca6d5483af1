"""One Gated DeltaNet layer of a compiled static batch step, alone: what a fused step costs over a decode-only step.

    python benchmarks/gdn_layer_steps.py --device cuda --save            # Qwen3.5-9B's GDN layer, B = 1 4 8 16
    python benchmarks/gdn_layer_steps.py --device cuda --batch-sizes 16 --profile --out gdn_b16.json
    python benchmarks/gdn_layer_steps.py --device cuda --path batch1     # one conversation's compiled step
    python benchmarks/gdn_layer_steps.py --quick                         # tiny layer on the CPU (smoke run)

A compiled Qwen3.5 batch step (`generation/shared_static.py`) runs `gdn_state.graph_layer.gdn_batch_forward_graph`
in each of its GDN layers (24 in the 9B). A fused step (every row restores its window of deferred rows, then decodes) costs
a fixed amount of GPU work over a decode-only step whatever the rows carry (benchmarks page, "Batches"); this script
measures that function alone, so that a change to it is measured in seconds of compile instead of a whole model's
minutes: a layer of the shape (`shapes.py`, random weights, bf16 on CUDA), its states as a batch's buffers
(``[S | P_tail]`` fp32, conv windows, prefix checkpoints), and per batch size B

* ``fused``: ``[B, window + 1]`` rows, window = `fused_window(chunk_size, step_deferred_budget, B)` (the package
  defaults for a model with GDN layers: 63, 1024), every row carrying its whole window and decoding (the common
  fused step), its joins left pending as compiled fused steps leave them (``lazy``; the fold when the steps end is
  not in it);
* ``decode``: ``[B, 1]``, every row decoding (a decode-only step, Full's and Raincheck's alike).

``--path batch1``: one conversation's compiled step instead (`gdn_rows_forward_graph`, `generation/decode.py`: a
window of ``chunk_size`` rows), B = 1.

Each is compiled once (torch.compile, ``fullgraph=True``, no CUDA graphs of its own), then `--reps` calls are
captured in one CUDA graph and replayed `--iters` times: ``us`` = GPU time per call (CUDA events over the
replays), ``fused / decode`` and ``x layers`` (the model's GDN layers: the step's GDN part). ``--profile``: the
kernels of one replay per step kind (`X_profile.txt` next to the JSON). On the CPU (``--quick``): eager calls timed
with the host clock (the torch kernels; a smoke run, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.dirname(os.path.abspath(__file__))]

from shapes import SHAPES  # noqa: E402

from hf_raincheck.gdn_state import (  # noqa: E402
    GDNBatchGraphStep,
    GDNGraphStep,
    GDNLayerState,
    PrefixCheckpoint,
    gdn_batch_forward_graph,
    gdn_rows_forward_graph,
)
from hf_raincheck import RaincheckConfig  # noqa: E402
from hf_raincheck.gdn_state import kernels as gdn_kernels  # noqa: E402
from hf_raincheck.generation.shared_batch import fused_window  # noqa: E402
from hf_raincheck.models.qwen3_5 import Qwen3_5GDNGlue  # noqa: E402


def build_layer(shape: str, device: str, dtype: torch.dtype):
    """A random-weight GDN layer of `shape`'s text model -> (module, the model's GDN layer count)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    text = {k: v for k, v in SHAPES[shape]["text"].items() if k not in ("rope_theta", "mrope_section",
                                                                          "partial_rotary_factor")}
    config = Qwen3_5TextConfig(**text)
    torch.manual_seed(0)
    module = Qwen3_5GatedDeltaNet(config, layer_idx=0).to(device, dtype).eval()
    return module, sum(kind == "linear_attention" for kind in config.layer_types)


def batch_buffers(glue, module, batch: int, device: str, dtype: torch.dtype) -> dict:
    """A batch's states of one layer, as `BatchedDeferredPrefillCache.sync_gdn_states` holds them: bounded values
    (P_tail near the identity), like a conversation's."""
    heads, key_dim, value_dim, channels, kernel = glue.dims(module)
    gen = torch.Generator().manual_seed(batch)
    eye = torch.eye(key_dim).expand(batch, heads, key_dim, key_dim)
    return dict(
        state=torch.cat([0.1 * torch.randn(batch, heads, key_dim, value_dim, generator=gen),
                         0.9 * eye + 0.01 * torch.randn(batch, heads, key_dim, key_dim, generator=gen)], -1).to(device),
        conv=torch.randn(batch, channels, kernel, generator=gen).to(device, dtype),
        prefix=(0.1 * torch.randn(batch, heads, key_dim, value_dim, generator=gen)).to(device),
        prefix_conv=torch.randn(batch, channels, kernel, generator=gen).to(device, dtype),
    )


def step_function(glue, module, buffers: dict, backend: str, window: int | None):
    """The layer's call in a step of `window` deferred rows per row (None: decode-only): ``fn(hidden, live, count)``,
    the step's tensors set inside, as `shared_static` sets them from its index tensor."""

    if window is not None:  # a fused step leaves its joins pending, as compiled batch steps do
        buffers["pending"] = torch.zeros_like(buffers["prefix"])

    def fn(hidden, live, count):
        step = GDNBatchGraphStep(layers={}, backend=backend, live=live, lazy=window is not None)
        if window is not None:
            step.count = count
            step.valid = torch.arange(window, device=hidden.device)[None, :] < count[:, None]
        return gdn_batch_forward_graph(glue, module, hidden, buffers, step)

    return fn


def batch1_function(glue, module, buffers: dict, backend: str, window: int | None):
    """The same step of a batch-1 conversation (``--path batch1``: `gdn_rows_forward_graph`, what a compiled
    static step of one conversation runs, `generation/decode.py`): its `GDNLayerState` in the fixed layout on row 0
    of `buffers`."""
    layer = GDNLayerState(fixed=True)
    layer.set_state(buffers["state"][:1], buffers["prefix"].shape[-1])
    layer.conv = buffers["conv"][:1]
    layer.prefix = PrefixCheckpoint(plan_id=0, recurrent=buffers["prefix"][:1], conv=buffers["prefix_conv"][:1])
    layer.pending = torch.zeros_like(buffers["prefix"][:1])  # a fused step leaves its join pending, as there

    def fn(hidden, live, count):
        valid = None if window is None else torch.arange(window, device=hidden.device) < count[0]
        step = GDNGraphStep(valid=valid, count=None if window is None else count[0], live=True, backend=backend,
                            lazy=window is not None)
        return gdn_rows_forward_graph(glue, module, hidden, layer, step)

    return fn


def measure(fn, args, cuda: bool, reps: int, iters: int, profile: bool):
    """-> (us per call, profiler or None)."""
    for _ in range(3):
        fn(*args)
    if not cuda:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6, None
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / (iters * reps)
    prof = None
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
    return us, prof


def run(args) -> dict:
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = gdn_kernels.resolve(args.gdn_backend, torch.device(args.device))
    gdn_kernels.functions(backend)  # imported before tracing (`kernels.functions`)
    module, layers = build_layer(args.shape, args.device, dtype)
    glue = Qwen3_5GDNGlue()
    records, profiles = [], []
    make = batch1_function if args.path == "batch1" else step_function
    for batch in args.batch_sizes:
        window = args.chunk_size if args.path == "batch1" else fused_window(args.chunk_size, args.step_budget, batch)
        by_kind = {}
        for kind, rows in (("fused", window), ("decode", None)):
            buffers = batch_buffers(glue, module, batch, args.device, dtype)
            fn = make(glue, module, buffers, backend, rows)
            if not args.no_compile:
                fn = torch.compile(fn, fullgraph=True, dynamic=False)
            total = 1 if rows is None else rows + 1
            gen = torch.Generator().manual_seed(1)
            hidden = torch.randn(batch, total, module.hidden_size, generator=gen).to(args.device, dtype)
            live = torch.ones(batch, dtype=torch.bool, device=args.device)
            count = torch.full((batch,), rows or 0, dtype=torch.long, device=args.device)
            with torch.no_grad():
                us, prof = measure(fn, (hidden, live, count), cuda, args.reps, args.iters, args.profile)
            by_kind[kind] = us
            if prof is not None:
                from latency import profile_tables

                profiles.append(profile_tables(prof, f"B={batch} {kind} step, one GDN layer, {args.reps} calls",
                                               args.profile_rows, cuda))
        record = dict(path=args.path, batch_size=batch, window=window, fused_us=round(by_kind["fused"], 2),
                      decode_us=round(by_kind["decode"], 2),
                      fused_over_decode=round(by_kind["fused"] / by_kind["decode"], 3),
                      extra_ms_all_layers=round((by_kind["fused"] - by_kind["decode"]) * layers / 1e3, 3))
        records.append(record)
        print(f"{args.path} B={batch:<3} window {window:>2}: fused {record['fused_us']:9.2f} us  decode {record['decode_us']:9.2f} "
              f"us  fused/decode {record['fused_over_decode']:.3f}  +{record['extra_ms_all_layers']:.3f} ms over "
              f"{layers} layers", flush=True)
    meta = dict(command=" ".join(sys.argv), torch=torch.__version__, device=args.device, shape=args.shape, path=args.path,
                gdn_backend=backend, dtype=str(dtype), compiled=not args.no_compile, reps=args.reps,
                iters=args.iters, gdn_layers=layers, chunk_size=args.chunk_size, step_budget=args.step_budget,
                gpu=torch.cuda.get_device_name() if cuda else None, cpu=platform.processor() or platform.machine(),
                date=time.strftime("%Y-%m-%d"))
    return dict(meta=meta, records=records, profiles=profiles)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny layer on the CPU, eager (smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="qwen3.5-9b", choices=[k for k, v in SHAPES.items()
                                                                   if v["family"] == "qwen3_5"])
    parser.add_argument("--path", default="batch", choices=["batch", "batch1"],
                        help="batch: a batch's step (gdn_batch_forward_graph); batch1: one conversation's "
                             "(gdn_rows_forward_graph, batch size 1 only)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="default 1 4 8 16 (--path batch), 1 (--path batch1)")
    parser.add_argument("--chunk-size", type=int, default=RaincheckConfig.CHUNK_GDN)
    parser.add_argument("--step-budget", type=int, default=RaincheckConfig.STEP_BUDGET_GDN,
                        help="step_deferred_budget (default: the package's for GDN models, "
                             f"{RaincheckConfig.STEP_BUDGET_GDN}; 0: no cap)")
    parser.add_argument("--gdn-backend", default="auto", choices=list(gdn_kernels.BACKENDS))
    parser.add_argument("--reps", type=int, default=24, help="calls per captured CUDA graph (a step's GDN layers)")
    parser.add_argument("--iters", type=int, default=50, help="graph replays timed")
    parser.add_argument("--no-compile", action="store_true", help="eager calls (what the CPU smoke run does)")
    parser.add_argument("--profile", action="store_true", help="kernels of one replay per step kind")
    parser.add_argument("--profile-rows", type=int, default=30)
    parser.add_argument("--save", action="store_true", help="write results/gdn_layer_steps.json")
    parser.add_argument("--out", default=None, help="JSON path (default with --save: results/gdn_layer_steps.json)")
    args = parser.parse_args(argv)
    if args.batch_sizes is None:
        args.batch_sizes = [1] if args.path == "batch1" else [1, 4, 8, 16]
    if args.quick:
        args.device, args.shape, args.no_compile, args.iters = "cpu", "tiny-qwen3.5", True, 3
        args.batch_sizes = [1] if args.path == "batch1" else [1, 3]
    for name in ("reps", "iters", "chunk_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.batch_sizes) < 1:
        parser.error(f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    if args.path == "batch1" and args.batch_sizes != [1]:
        parser.error(f"--batch-sizes must be 1 with --path batch1 (one conversation), got {args.batch_sizes}")
    if args.step_budget < 0:
        parser.error(f"--step-budget must be >= 0 (0: no cap), got {args.step_budget}")
    args.step_budget = args.step_budget or None
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    torch.set_grad_enabled(False)
    result = run(args)
    out = args.out or (os.path.join(_ROOT, "benchmarks", "results", "gdn_layer_steps.json") if args.save else None)
    if out:
        profiles = result.pop("profiles")
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        if profiles:
            with open(os.path.splitext(out)[0] + "_profile.txt", "w") as f:
                f.write("\n\n".join(profiles))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
