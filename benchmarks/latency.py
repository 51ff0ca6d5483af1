"""Latency of Full, Hard and Raincheck side by side: TTFT, TPOT, end-to-end, peak memory (random weights).

    python benchmarks/latency.py --shape tiny --device cpu                 # smoke run, seconds
    python benchmarks/latency.py --shape qwen3-vl-8b --device cuda         # the real shape on a GPU
    python benchmarks/latency.py --shape qwen3.5-9b --device cuda          # hybrid GDN model

Latency does not depend on weight values, so the model is built from a config with random weights; answer
lengths are forced with ``min_new_tokens``. Writes a JSON table (``--out``) and prints a Markdown table with
ratios to Full.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers.generation.streamers import BaseStreamer

from hf_raincheck import RaincheckConfig, enable_raincheck
from shapes import SHAPES, build_inputs, build_model  # noqa: F401  (benchmarks/ is the script's directory)

class Timer(BaseStreamer):
    def __init__(self, sync):
        self.sync, self.times, self.start = sync, [], None

    def put(self, value):
        self.sync()
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_once(model, inputs, cfg, n, sync):
    timer = Timer(sync)
    sync()
    start = time.perf_counter()
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=timer, return_dict_in_generate=True)
    if cfg is not None:
        kwargs["raincheck_config"] = cfg
    out = model.generate(**inputs, **kwargs)
    sync()
    end = time.perf_counter()
    generated = timer.times[1:]  # the first put is the prompt
    ttft = generated[0] - start
    tpot = (generated[-1] - generated[0]) / max(len(generated) - 1, 1)
    cache = out.past_key_values
    restored = None
    if cfg is not None and cfg.policy == "raincheck":
        restored = dict(decode=cache.stats.during_decode, after=cache.stats.after_answer)
    return dict(ttft_ms=1e3 * ttft, tpot_ms=1e3 * tpot, e2e_ms=1e3 * (end - start), restored=restored)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--image-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--chunk-size", type=int, default=31)
    parser.add_argument("--guard-tokens", type=int, default=16)
    parser.add_argument("--pruning", default="mmtok", help="selector of hard and raincheck (default: the package's)")
    parser.add_argument("--out", default="latency.json")
    args = parser.parse_args(argv)

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    model = enable_raincheck(build_model(args.shape, args.device, dtype))
    inputs = build_inputs(args.image_tokens, 30, 30, args.device, dtype)
    policies = {
        "plain generate": None,
        "full": RaincheckConfig(policy="full"),
        "hard": RaincheckConfig(policy="hard", retention=args.retention, pruning=args.pruning),
        "raincheck": RaincheckConfig(retention=args.retention, chunk_size=args.chunk_size, pruning=args.pruning,
                                     guard_tokens=args.guard_tokens, completion="blocking"),
    }
    rows = {}
    with torch.no_grad():
        # agreement: policy="full" through Raincheck's path vs plain generate (same tokens expected up to fp noise)
        common = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, output_logits=True,
                      return_dict_in_generate=True)
        plain = model.generate(**inputs, **common)
        full = model.generate(**inputs, raincheck_config=policies["full"], **common)
        agreement = dict(
            first_logits_max_abs_diff=float((plain.logits[0] - full.logits[0]).abs().max()),
            first_logits_scale=float(plain.logits[0].abs().max()),
            same_tokens=int((plain.sequences == full.sequences).all()),
        )
        print("full-vs-plain agreement:", agreement)
        for name, cfg in policies.items():
            run_once(model, inputs, cfg, 8, sync)  # warm-up
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            runs = [run_once(model, inputs, cfg, args.new_tokens, sync) for _ in range(args.repeats)]
            row = {k: statistics.median(r[k] for r in runs) for k in ("ttft_ms", "tpot_ms", "e2e_ms")}
            row["restored"] = runs[-1]["restored"]
            if args.device.startswith("cuda"):
                row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            rows[name] = row
    base = rows["full"]
    print(f"\nshape {args.shape}, {args.device}, prompt {inputs['input_ids'].shape[1]} tokens "
          f"({args.image_tokens} visual), {args.new_tokens} new tokens, retention {args.retention}, "
          f"chunk {args.chunk_size}, guard {args.guard_tokens}, selector {args.pruning}, median of {args.repeats}\n")
    print("| policy | TTFT ms | TPOT ms | E2E ms | TTFT / full | TPOT / full | restored (decode / after) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        restored = "" if not row["restored"] else f"{row['restored']['decode']} / {row['restored']['after']}"
        print(f"| {name} | {row['ttft_ms']:.1f} | {row['tpot_ms']:.2f} | {row['e2e_ms']:.0f} | "
              f"{row['ttft_ms'] / base['ttft_ms']:.3f} | {row['tpot_ms'] / base['tpot_ms']:.3f} | {restored} |")
    with open(args.out, "w") as f:
        json.dump(dict(args=vars(args), rows=rows, agreement=agreement), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
