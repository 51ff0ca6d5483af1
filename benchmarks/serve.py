"""The Raincheck server (``hf-raincheck serve``) against plain ``transformers serve`` on the same model.

    python benchmarks/serve.py                                   # CPU smoke run: the shipped GridQA model
    python benchmarks/serve.py --model Qwen/Qwen3-VL-8B-Instruct --device cuda --dtype bfloat16 \\
        --image-size 1024 --max-tokens 128 --save                 # H200: JSON to benchmarks/results/serve.json

Both servers run in this process (one after the other, each on a free localhost port) and are driven through the
`openai` client with streaming requests (greedy, ``max_tokens``), so the times are what a client sees:

* TTFT of a conversation's first turn (an image and a question) and of its second turn (a text follow-up, sent
  ``--think-ms`` after the first answer ended): the Raincheck server prefills the kept visual tokens first and,
  on turn 2, only the new tokens (the conversation's cache is reused; what was deferred is restored while the
  client "reads", or folded into the prefill); plain ``transformers serve`` prefills the whole conversation on
  every request. Medians over ``--repeats`` conversations with different images.
* throughput with 1 / 4 / 8 (``--concurrency``) conversations of ``--turns`` turns at once: completion tokens per
  second of wall time, and the mean TTFT under that load. The Raincheck server answers concurrent requests in
  shared batched `generate` calls (``--max-batch-size``, ``--batch-window-ms``; the calls' row counts are in its
  result's ``batches``); plain ``transformers serve`` answers one request at a time.

Images: the GridQA grids for the default model, otherwise random-noise RGB images of ``--image-size`` pixels a
side (seeded per conversation). Answers differ between the two servers (Raincheck answers from the kept tokens
first), so throughput is per generated token.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results", "serve.json")


def image_url(args, index: int) -> str:
    if args.model is None:
        from hf_raincheck.gridqa import make_dialogue

        image = make_dialogue(100 + index).image()
    else:
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(index)
        image = Image.fromarray(rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


QUESTIONS = ["what is in C3?", "what is in E5?", "how many red things are in column 3?", "list row B.",
             "what is in H1?", "where in row D is the blue circle?"]


def stream_turn(client, model: str, messages: list, max_tokens: int) -> tuple[str, float, int]:
    """(answer, TTFT s, completion tokens) of one streamed request."""
    start = time.perf_counter()
    ttft, pieces, tokens = None, [], 0
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, max_tokens=max_tokens,
                                                temperature=0):
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - start
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(pieces), ttft if ttft is not None else time.perf_counter() - start, tokens


def conversation(base_url: str, model: str, args, index: int, turns: int, think_s: float) -> list[tuple[float, int]]:
    """One conversation: turn 1 with an image, then text follow-ups; (TTFT, tokens) per turn."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    content = [{"type": "image_url", "image_url": {"url": image_url(args, index)}},
               {"type": "text", "text": QUESTIONS[index % len(QUESTIONS)]}]
    messages = [{"role": "user", "content": content}]
    results = []
    for turn in range(turns):
        answer, ttft, tokens = stream_turn(client, model, messages, args.max_tokens)
        results.append((ttft, tokens))
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": QUESTIONS[(index + turn + 1) % len(QUESTIONS)]}]
        if turn + 1 < turns:
            time.sleep(think_s)
    return results


def measure(base_url: str, model: str, args) -> dict:
    think_s = args.think_ms / 1000
    conversation(base_url, model, args, 999, 2, 0)  # warm-up
    firsts, seconds = [], []
    for i in range(args.repeats):
        (t1, _), (t2, _) = conversation(base_url, model, args, i, 2, think_s)
        firsts.append(t1)
        seconds.append(t2)
    result = {"ttft_turn1_s": statistics.median(firsts), "ttft_turn2_s": statistics.median(seconds),
              "throughput": {}}
    for n in args.concurrency:
        start = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            runs = list(pool.map(lambda i: conversation(base_url, model, args, 200 + i, args.turns, think_s),
                                 range(n)))
        wall = time.perf_counter() - start
        tokens = sum(t for run in runs for _, t in run)
        ttfts = [ttft for run in runs for ttft, _ in run]
        result["throughput"][str(n)] = {"tokens_per_s": tokens / wall, "wall_s": wall, "completion_tokens": tokens,
                                        "mean_ttft_s": statistics.fmean(ttfts)}
    return result


def run_raincheck(args) -> dict:
    from hf_raincheck import RaincheckConfig
    from hf_raincheck.serve import DEFAULT_MODEL, RaincheckServer

    config = RaincheckConfig(retention=args.retention, pruning=args.pruning)
    server = RaincheckServer(args.model, config, port=0, device=args.device, dtype=args.dtype,
                             cache_budget_mb=args.cache_budget_mb, max_batch_size=args.max_batch_size,
                             batch_window_ms=args.batch_window_ms).start()
    try:
        result = measure(server.base_url, args.model or DEFAULT_MODEL, args)
        result["pool"] = server.pool.snapshot()
        result["batches"] = server.scheduler.batch_stats.snapshot()
        return result
    finally:
        server.stop()


def run_plain(args) -> dict:
    import hf_raincheck.testing  # noqa: F401 - lets AutoProcessor build Qwen3-VL processors without torchvision
    from transformers.cli.serve import Serve

    from hf_raincheck.gridqa import default_path
    from hf_raincheck.serve.app import free_port

    model = args.model or default_path()
    port = free_port()
    serve = Serve(force_model=model, port=port, host="127.0.0.1", non_blocking=True,
                  device="cpu" if args.model is None else args.device, dtype=args.dtype, log_level="error")
    try:
        deadline = time.monotonic() + 600
        while not serve.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("transformers serve did not start")
            time.sleep(0.05)
        return measure(f"http://127.0.0.1:{port}/v1", model, args)
    finally:
        serve.kill_server()


def parse_args(argv=None):
    from hf_raincheck.serve.scheduler import DEFAULT_BATCH_WINDOW_S, DEFAULT_MAX_BATCH_SIZE

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="Hub id or path (default: the shipped GridQA Qwen3-VL, CPU)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--pruning", default="mmtok")
    parser.add_argument("--image-size", type=int, default=1024, help="side of the random images (non-default models)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--think-ms", type=float, default=200, help="pause between an answer and the next turn")
    parser.add_argument("--repeats", type=int, default=3, help="conversations for the TTFT medians")
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation in the throughput runs")
    parser.add_argument("--concurrency", default="1,4,8", help="concurrent conversations, comma-separated")
    parser.add_argument("--servers", default="raincheck,plain", help="which servers: raincheck, plain")
    parser.add_argument("--cache-budget-mb", type=float, default=4096)
    parser.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE,
                        help="the Raincheck server's --max-batch-size (1: one request at a time)")
    parser.add_argument("--batch-window-ms", type=float, default=DEFAULT_BATCH_WINDOW_S * 1000,
                        help="the Raincheck server's --batch-window-ms")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--save", action="store_true", help=f"write the JSON to {os.path.relpath(RESULTS, ROOT)}")
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    args.concurrency = [int(n) for n in args.concurrency.split(",") if n]
    args.servers = [s for s in args.servers.split(",") if s]
    for name in args.servers:
        if name not in ("raincheck", "plain"):
            parser.error(f"--servers: unknown server {name!r}; allowed: raincheck, plain")
    if args.max_batch_size < 1:
        parser.error(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    runners = {"raincheck": run_raincheck, "plain": run_plain}
    report = {"model": args.model or "hf-raincheck/gridqa-qwen3-vl (CPU)", "device": args.device,
              "retention": args.retention, "pruning": args.pruning, "max_tokens": args.max_tokens,
              "max_batch_size": args.max_batch_size, "batch_window_ms": args.batch_window_ms,
              "think_ms": args.think_ms, "turns": args.turns, "servers": {}}
    for name in args.servers:
        report["servers"][name] = runners[name](args)
    print(f"{'server':<10} {'TTFT turn 1':>12} {'TTFT turn 2':>12}  " +
          "  ".join(f"{n} conv tok/s (TTFT)" for n in args.concurrency))
    for name, result in report["servers"].items():
        row = "  ".join(f"{t['tokens_per_s']:>9.1f} ({t['mean_ttft_s'] * 1000:>6.0f} ms)"
                        for t in result["throughput"].values())
        print(f"{name:<10} {result['ttft_turn1_s'] * 1000:>9.0f} ms {result['ttft_turn2_s'] * 1000:>9.0f} ms  {row}")
    if "batches" in report["servers"].get("raincheck", {}):
        print(f"raincheck generate calls by rows (all runs): {report['servers']['raincheck']['batches']['sizes']}")
    out = args.out or (RESULTS if args.save else None)
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
