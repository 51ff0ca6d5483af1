"""Host time of a compiled static step, split into the package's own wrapper and the compiled call.

    python benchmarks/step_host_time.py                       # tiny Qwen3-VL on the CPU (dynamo, eager backend), ~30 s
    python benchmarks/step_host_time.py --device cuda --backend inductor   # the GPU path (Inductor, CUDA graphs)

`generate` reads every token back, so a step's host time adds to its wall time. This times, per decode-only and
per fused step of a Raincheck answer (`StaticStep.__call__`), the time spent outside the compiled function (the
package's Python: the chunk's views, the plan's bookkeeping) and inside the compiled call (dynamo's guards,
Inductor's wrapper, CUDA-graph replay and its input copies; on CUDA without a synchronisation, so host time only).
Medians in us over the second of two identical answers (the first compiles).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]

from transformers.generation.configuration_utils import CompileConfig  # noqa: E402

from hf_raincheck import RaincheckConfig, enable_raincheck  # noqa: E402
from hf_raincheck.generation import decode  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="eager", help="torch.compile backend (eager on the CPU: fast to build)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--chunk", type=int, default=7)
    args = parser.parse_args(argv)

    from handmade import _conv, _tiny_model  # the tests' tiny Qwen3-VL
    from helpers import generate

    model = enable_raincheck(_tiny_model("eager").to(args.device))
    inputs = {k: v.to(args.device) if torch.is_tensor(v) else v for k, v in _conv([(1, 16, 16)], [3, 2, 4]).items()}
    compile_config = CompileConfig(backend=args.backend, fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True  # compile on the CPU too
    config = RaincheckConfig(retention=0.3, chunk_size=args.chunk, guard_tokens=2, pruning="uniform",
                             completion="blocking")
    times = {}
    original = decode.StaticStep.__call__

    def timed(self, cache, turn, plan, count, token):
        inside = []
        compiled = self.compiled

        def call(*a, **k):
            t = time.perf_counter()
            out = compiled(*a, **k)
            inside.append(time.perf_counter() - t)
            return out

        self.compiled = call
        t0 = time.perf_counter()
        try:
            return original(self, cache, turn, plan, count, token)
        finally:
            self.compiled = compiled
            total = time.perf_counter() - t0
            kind = "fused" if count else "decode-only"
            times.setdefault(kind, []).append((1e6 * (total - sum(inside)), 1e6 * sum(inside)))

    decode.StaticStep.__call__ = timed
    try:
        for _ in range(2):
            times.clear()
            generate(model, inputs, args.new_tokens, config, cache_implementation="static",
                     compile_config=compile_config)
    finally:
        decode.StaticStep.__call__ = original
    print(f"| step | count | wrapper us | compiled call us |  ({args.device}, backend {args.backend})\n"
          "| --- | --- | --- | --- |")
    for kind, rows in times.items():
        wrapper = statistics.median(r[0] for r in rows)
        inside = statistics.median(r[1] for r in rows)
        print(f"| {kind} | {len(rows)} | {wrapper:.1f} | {inside:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
