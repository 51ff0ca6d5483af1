"""Per-call time of Raincheck's attention paths at fused-step shapes: few query rows over a whole cache.

    python benchmarks/attention_speed.py --device cuda --save     # the GPU run
    python benchmarks/attention_speed.py --quick                  # small shapes on the CPU, seconds

For the Qwen3-VL-8B (32 query heads, 8 KV heads, head dim 128) and Qwen3.5-9B (16 / 4 / 256) attention layers, bf16
on CUDA: ``q`` query rows (1 = a decode step; 8-64 = a fused step with a chunk of deferred rows) over ``k`` cached
keys under a dense boolean mask (the static cache's visibility), timed per call (median of ``--repeats`` after a
warm-up, CUDA events):

* ``sdpa``: ``F.scaled_dot_product_attention`` with the mask and ``enable_gqa`` (what the SDPA backend ran before);
* ``grouped``: `hf_raincheck.attention.sdpa.grouped_attention` (query heads of a KV head stacked as rows; scores
  in the inputs' dtype, fp32 softmax: transformers' eager precision), what fused steps run;
* ``sdpa_heads`` (one row): SDPA without GQA, the query heads of a KV head as that head's query rows (they share
  the row's mask), boolean mask; ``sdpa_heads_additive``: the same with the mask converted to an additive one
  outside the call (as a once-per-forward conversion would);
* ``grouped_fp32``: the same with fp32 scores, for reference;
* ``grouped_torch_softmax``: the grouped path with its torch softmax instead of the Triton kernel
  (`hf_raincheck.attention.softmax_triton`; the same as ``grouped`` where Triton does not run);
* ``split_keys`` (Triton): `hf_raincheck.attention.split_keys_triton.split_keys_attention`, the keys split over
  programs (``split_keys:<config>`` with ``--split-configs``: other launch options than the package's);
* ``flash`` (when flash_attn is installed): the flash backend's kernel over the k keys (``attn_backend="flash"``
  calls it per row block after gathering the keys: ``flash_gathered`` adds that gather).

* ``softmax:<config>`` (``--softmax-configs "block=1024,warps=4;block=512"``, CUDA with Triton): the grouped path
  with its softmax kernel tiled so (`hf_raincheck.attention.softmax_triton.launch_masked_softmax`'s `block` and
  `warps`; the package always runs the default tiling).

Eager calls at these sizes are launch-bound (the GPU idles between a path's kernels); ``--graphs`` times a CUDA
graph of 20 calls replayed (what a compiled static step runs), ``--compile`` lets Inductor fuse each path first.

Writes ``benchmarks/results/attention_speed.json`` with ``--save``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_raincheck.attention import flash  # noqa: E402
from hf_raincheck.attention.sdpa import grouped_attention, grouped_softmax_torch  # noqa: E402
from hf_raincheck.triton_support import triton_importable  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention_speed.json")
LAYERS = {"qwen3-vl-8b": (32, 8, 128), "qwen3.5-9b": (16, 4, 256)}


def sdpa_masked(query, key, value, visible, scaling):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scaling,
                                          enable_gqa=query.shape[1] != key.shape[1]).transpose(1, 2).contiguous()


def grouped_fp32(query, key, value, visible, scaling):
    """The grouped path with fp32 scores (its first version; twice the bytes of scores to write and read)."""
    b, hq, q, d = query.shape
    hkv, k = key.shape[1], key.shape[2]
    g = hq // hkv
    scores = torch.matmul(query.reshape(b, hkv, g * q, d).float(), key.float().transpose(-1, -2)) * scaling
    scores = scores.view(b, hkv, g, q, k).masked_fill(~visible.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(value.dtype).view(b, hkv, g * q, k)
    return torch.matmul(probs, value).view(b, hq, q, d).transpose(1, 2).contiguous()


def flash_contiguous(query, key, value, visible, scaling):
    """The flash kernel, bottom-right causal over all k keys (the visibility of a decode row; no mask)."""
    return flash._call(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, scaling)


def flash_gathered(query, key, value, visible, scaling):
    """The same after the flash backend's per-layer gather of the keys (here every key, in order)."""
    index = torch.arange(key.shape[2], device=key.device)
    count = torch.full((query.shape[0],), key.shape[2], dtype=torch.int32, device=key.device)
    return flash._gathered(query, key, value, index, count, scaling)


def grouped_torch_softmax(query, key, value, visible, scaling):
    """The grouped path with its torch softmax (what it ran before the Triton kernel; what ``HF_RAINCHECK_TRITON=0``
    and eager steps run)."""
    b, hq, q, d = query.shape
    hkv, k = key.shape[1], key.shape[2]
    g = hq // hkv
    scores = torch.matmul(query.reshape(b, hkv, g * q, d) * scaling, key.transpose(-1, -2)).view(b, hkv, g, q, k)
    probs = grouped_softmax_torch(scores, visible, value.dtype)
    return torch.matmul(probs, value).view(b, hq, q, d).transpose(1, 2).contiguous()


def sdpa_heads(query, key, value, visible, scaling, additive=None):
    """One masked row (``q = 1``) through SDPA without GQA: the ``g`` query heads of a KV head become ``g`` query rows
    of that head (a view), which share the row's mask, so SDPA's masked kernel runs with no repeated keys."""
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    if q != 1:
        raise ValueError("sdpa_heads takes one query row")
    rows = query.reshape(b, hkv, hq // hkv, d)
    mask = visible if additive is None else additive
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, 1, d).transpose(1, 2).contiguous()


_ADDITIVE: dict = {}


def sdpa_heads_additive(query, key, value, visible, scaling):
    """`sdpa_heads` with the mask made additive (0 / -inf, the values' dtype) once per mask, outside the call: what
    one conversion per forward (shared by every layer) would leave per layer."""
    additive = _ADDITIVE.get(id(visible))
    if additive is None or additive[0] is not visible:
        additive = _ADDITIVE[id(visible)] = (visible, torch.zeros(visible.shape, dtype=value.dtype,
                                             device=value.device).masked_fill_(~visible, float("-inf")))
    return sdpa_heads(query, key, value, visible, scaling, additive[1])


def split_keys(query, key, value, visible, scaling, tiling: dict | None = None):
    """`hf_raincheck.attention.split_keys_triton` with the launch options `tiling` (None: the package's)."""
    from hf_raincheck.attention.split_keys_triton import launch_split_keys, split_keys_attention

    if tiling:
        return launch_split_keys(query, key, value, visible, scaling, **tiling)
    return split_keys_attention(query, key, value, visible, scaling)


SPLIT_OPTIONS = ("splits", "block_m", "block_n", "warps", "stages")


def parse_split_tiling(text: str) -> dict:
    """``"splits=8,block_m=128"`` -> keyword arguments of `launch_split_keys`."""
    tiling = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in SPLIT_OPTIONS or not value.isdigit():
            raise SystemExit(f"--split-configs: expected '<name>=<int>' with names from {SPLIT_OPTIONS}, got {text!r}")
        tiling[name] = int(value)
    return tiling


PATHS = {"sdpa": sdpa_masked, "sdpa_heads": sdpa_heads, "sdpa_heads_additive": sdpa_heads_additive, "grouped": grouped_attention, "grouped_fp32": grouped_fp32,
         "grouped_torch_softmax": grouped_torch_softmax}
if triton_importable():
    PATHS["split_keys"] = split_keys
if flash.available():
    PATHS.update(flash=flash_contiguous, flash_gathered=flash_gathered)


def parse_tiling(text: str) -> dict:
    """``"block=1024,warps=4"`` (either may be left out) -> keyword arguments of `launch_masked_softmax`."""
    tiling = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in ("block", "warps") or not value.isdigit():
            raise SystemExit(f"--softmax-configs: expected 'block=<int>,warps=<int>' (either may be left out), "
                             f"got {text!r}")
        tiling[name] = int(value)
    return tiling


def grouped_with_softmax(tiling: dict, query, key, value, visible, scaling):
    """The grouped path (as `grouped_attention` where the kernel runs) with the softmax kernel tiled by `tiling`."""
    from hf_raincheck.attention.softmax_triton import launch_masked_softmax

    b, hq, q, d = query.shape
    hkv, k = key.shape[1], key.shape[2]
    g = hq // hkv
    scores = torch.matmul(query.reshape(b, hkv, g * q, d) * scaling, key.transpose(-1, -2)).view(b, hkv, g, q, k)
    probs = launch_masked_softmax(scores, visible, value.dtype, **tiling)
    return torch.matmul(probs, value).view(b, hq, q, d).transpose(1, 2).contiguous()


def time_graphed_us(fn, args, repeats: int, calls: int = 20) -> float:
    """Per-call GPU time with launch overhead removed, as inside a compiled (CUDA-graphed) step: `calls` calls
    captured as one CUDA graph, replayed; median over `repeats` replays, divided by `calls`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        for _ in range(calls):
            fn(*args)
    graph.replay()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(1e3 * start.elapsed_time(end) / calls)
    return statistics.median(samples)


def time_us(fn, args, repeats: int, cuda: bool, graphed: bool = False) -> float:
    if graphed:
        return time_graphed_us(fn, args, repeats)
    fn(*args)
    if cuda:
        torch.cuda.synchronize()
        samples = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            samples.append(1e3 * start.elapsed_time(end))
        return statistics.median(samples)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        samples.append(1e6 * (time.perf_counter() - t0))
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default=None)
    parser.add_argument("--keys", default=None, help="comma list of cache lengths (4352,1280; --quick 200)")
    parser.add_argument("--rows", default=None, help="comma list of query rows (1,8,16,32,64; --quick 1,8)")
    parser.add_argument("--batch", type=int, default=1, help="batch rows, each with its own mask (1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per case (50; --quick 3)")
    parser.add_argument("--graphs", action="store_true",
                        help="CUDA only: time each path as a replayed CUDA graph (no launch overhead, as in a "
                             "compiled step) instead of eager calls")
    parser.add_argument("--compile", action="store_true", help="torch.compile each path first (with --graphs)")
    parser.add_argument("--paths", default=None, help=f"comma list of paths to time (default: all of {list(PATHS)})")
    parser.add_argument("--softmax-configs", default="",
                        help="';'-separated softmax_triton tilings ('block=1024,warps=4'), each timed as the grouped "
                             "path with that softmax tiling: path softmax:<config>")
    parser.add_argument("--split-configs", default="",
                        help="';'-separated split_keys launch options ('splits=8,block_m=128,block_n=64,warps=4,"
                             "stages=3'), each timed as path split_keys:<config>")
    parser.add_argument("--no-cudnn", action="store_true",
                        help="SDPA without its cuDNN backend, as eager decode and fused steps run it "
                             "(`hf_raincheck.attention.sdpa.eager_sdpa_backends`)")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    chosen = dict(PATHS)
    if args.paths:
        unknown = [p for p in args.paths.split(",") if p not in PATHS]
        if unknown:
            parser.error(f"--paths: unknown {unknown}; choose from {list(PATHS)}")
        chosen = {p: PATHS[p] for p in args.paths.split(",")}
    for text in filter(None, args.softmax_configs.split(";")):
        chosen[f"softmax:{text}"] = lambda *a, t=parse_tiling(text): grouped_with_softmax(t, *a)
    for text in filter(None, args.split_configs.split(";")):
        chosen[f"split_keys:{text}"] = lambda *a, t=parse_split_tiling(text): split_keys(*a, tiling=t)
    device = args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    cuda = device.startswith("cuda")
    if (args.graphs or args.compile) and not cuda:
        parser.error("--graphs / --compile need --device cuda")
    if args.no_cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    paths = {name: torch.compile(fn, dynamic=False) if args.compile else fn for name, fn in chosen.items()}
    dtype = torch.bfloat16 if cuda else torch.float32
    keys = [int(k) for k in (args.keys or ("200" if args.quick else "4352,1280")).split(",")]
    rows = [int(r) for r in (args.rows or ("1,8" if args.quick else "1,8,16,32,64")).split(",")]
    repeats = args.repeats or (3 if args.quick else 50)
    layers = {"tiny": (4, 2, 32)} if args.quick else LAYERS
    records = []
    mode = ("compiled, " if args.compile else "") + ("CUDA graph replay" if args.graphs else "eager calls")
    mode += ", SDPA without cuDNN" if args.no_cudnn else ""
    print(f"per-call time, {mode}, batch {args.batch}")
    print("| layer | keys | rows | " + " | ".join(f"{p} us" for p in paths) + " | max abs diff grouped vs sdpa |"
          " max abs diff softmax tilings vs grouped | max abs diff split_keys vs sdpa |")
    print("| " + " | ".join(["---"] * (6 + len(paths))) + " |")
    for name, (hq, hkv, d) in layers.items():
        for k in keys:
            for q in rows:
                gen = torch.Generator(device=device).manual_seed(0)
                n = args.batch
                query = torch.randn(n, hq, q, d, device=device, generator=gen).to(dtype)
                key = torch.randn(n, hkv, k, d, device=device, generator=gen).to(dtype)
                value = torch.randn(n, hkv, k, d, device=device, generator=gen).to(dtype)
                visible = torch.rand(n, 1, q, k, device=device, generator=gen) < 0.9
                visible[..., :1] = True
                call = (query, key, value, visible, d ** -0.5)
                times = {}
                for p, fn in paths.items():
                    try:
                        times[p] = time_us(fn, call, repeats, cuda, args.graphs)
                    except Exception as exc:  # e.g. a kernel configuration that does not fit in shared memory
                        print(f"  {p} failed at {name} {k} keys {q} rows: {type(exc).__name__}: {str(exc)[:200]}")
                        times[p] = float("nan")
                reference = grouped_attention(*call).float()
                diff = (reference - sdpa_masked(*call).float()).abs().max().item()
                kernel_diff = max([(paths[p](*call).float() - reference).abs().max().item()
                                   for p in paths if p.startswith("softmax:") and times[p] == times[p]],
                                  default=None)
                split_diff = max([(paths[p](*call).float() - sdpa_masked(*call).float()).abs().max().item()
                                  for p in paths if p.startswith("split_keys") and times[p] == times[p]],
                                 default=None)
                records.append(dict(layer=name, batch=args.batch, heads=hq, kv_heads=hkv, head_dim=d, keys=k, rows=q,
                                    **{f"{p}_us": round(t, 2) if t == t else None for p, t in times.items()}, max_abs_diff=diff,
                                    kernel_max_abs_diff=kernel_diff, split_keys_max_abs_diff=split_diff))
                print(f"| {name} | {k} | {q} | " + " | ".join(f"{times[p]:.1f}" for p in paths) + f" | {diff:.2g} | "
                      f"{'-' if kernel_diff is None else format(kernel_diff, '.2g')} | "
                      f"{'-' if split_diff is None else format(split_diff, '.2g')} |", flush=True)
    if args.save:
        head = dict(torch=torch.__version__, device=device, timing=mode, dtype=str(dtype).replace("torch.", ""),
                    gpu=torch.cuda.get_device_name() if cuda else None, repeats=repeats, command=" ".join(sys.argv))
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(header=head, records=records), f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
