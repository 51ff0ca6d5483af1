"""The Raincheck server (``hf-raincheck serve``) against plain ``transformers serve`` on the same model.

    python benchmarks/serve.py                                   # CPU smoke run: the shipped GridQA model
    python benchmarks/serve.py --random-weights qwen3-vl-8b --device cuda --out serve_h200.json
                                                                 # H200: the Qwen3-VL-8B shape, random weights
    python benchmarks/serve.py --model Qwen/Qwen3-VL-8B-Instruct --device cuda --dtype bfloat16 --image-tokens 4096

Models: the shipped GridQA checkpoint (default, CPU); ``--model``: a Hub id or path that each server loads;
``--random-weights SHAPE``: a random-weight Qwen3-VL of a `shapes.SHAPES` shape built in memory (`serve_model`:
nothing downloaded or written to disk; the GridQA processor with its token ids; images of ``--image-tokens``
merged tokens; an LM head of the full vocabulary whose answers decode, re-encode to themselves and never end
early, so every answer has exactly ``--max-tokens`` tokens in both servers). The Raincheck server gets the model
object (`RaincheckServer(model, processor=...)`); plain ``transformers serve`` gets a copy of it (made before
Raincheck is enabled on the original) put into its model manager's cache of loaded models (this instance's
``loaded_models``; transformers' code is not patched), requested by name like any model. That side needs
transformers 5.23 or 5.24, whose ``transformers serve`` runs models in its own process (5.25 runs each in an engine
process: there ``--servers plain`` is refused; ``--servers raincheck`` runs).

Both servers run in this process at the same time, each on a free localhost port, driven through the `openai`
client with streaming requests (greedy, ``max_tokens``), so the times are what a client sees. The measurements
alternate between the servers phase by phase; before each of the plain server's phases the Raincheck server
finishes restoring what its conversations left pending (it does that between requests), so the two never share
the device:

* TTFT of a conversation's first turn (an image and a question) and of its second turn (a text follow-up, sent
  ``--think-ms`` after the first answer ended): the Raincheck server prefills the kept visual tokens first and,
  on turn 2, only the new tokens (the conversation's cache is reused; what was deferred is restored while the
  client "reads", or folded into the prefill); plain ``transformers serve`` prefills the whole conversation on
  every request. Medians over ``--repeats`` conversations with different images.
* throughput with 1 / 4 / 8 (``--concurrency``) conversations of ``--turns`` turns at once: completion tokens per
  second of wall time, and the mean TTFT under that load. The Raincheck server answers concurrent requests in
  shared batched `generate` calls (``--max-batch-size``, ``--batch-window-ms``; the calls' row counts are in its
  result's ``batches``); plain ``transformers serve`` answers one request at a time.

``--budget-s``: a phase (a TTFT repeat, a concurrency level) starts only if its estimated time (from the phases
before) fits in what is left; the phases that do not fit are listed under ``skipped`` for both servers alike.
On CUDA each server's phases record the GPU memory (``gpu_memory``: allocated at the phase's start, its peak
``torch.cuda.max_memory_allocated``, allocated at its end); a run that fails still writes its JSON (``error``).
Images: the GridQA grids for the default model, otherwise smooth random RGB images (seeded per conversation).
Answers differ between the two servers (Raincheck answers from the kept tokens first), so throughput is per
generated token.
"""

from __future__ import annotations

import argparse
import base64
import copy
import functools
import io
import json
import logging
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "serve.json")

from hf_raincheck.transformers_coupling import SERVING_ENGINE_PROCESS, installed_transformers_version  # noqa: E402

#: defaults of the options left out, per mode: ``--random-weights qwen3-vl-8b`` fits one 540 s GPU call (model
#: build, warm-up and both servers; see the benchmarks page)
DEFAULTS = {
    "gridqa": dict(max_tokens=32, repeats=3, turns=3, think_ms=200, image_tokens=None, cache_budget_mb=4096,
                   budget_s=None),
    "model": dict(max_tokens=64, repeats=3, turns=3, think_ms=1000, image_tokens=4096, cache_budget_mb=16384,
                  budget_s=None),
    "random-8b": dict(max_tokens=32, repeats=3, turns=3, think_ms=1000, image_tokens=4096, cache_budget_mb=16384,
                      budget_s=420),
    "random-small": dict(max_tokens=8, repeats=2, turns=2, think_ms=100, image_tokens=64, cache_budget_mb=1024,
                         budget_s=None),
}
REQUEST_TIMEOUT_S = 180  # a request that takes longer fails the run (instead of hanging it)
QUESTIONS = ["what is in C3?", "what is in E5?", "how many red things are in column 3?", "list row B.",
             "what is in H1?", "where in row D is the blue circle?"]


# ---------------------------------------------------------------------------------------------- the client side
@functools.lru_cache(maxsize=64)
def image_url(image_tokens: int | None, index: int) -> str:
    """A data URL: the GridQA grid `index` (`image_tokens` None), else a smooth random square image whose side
    gives `image_tokens` merged tokens (`serve_model.image_side`), as a JPEG."""
    if image_tokens is None:
        from hf_raincheck.gridqa import make_dialogue

        image, fmt = make_dialogue(100 + index).image(), "PNG"
    else:
        import numpy as np
        from PIL import Image

        from serve_model import image_side

        side = image_side(image_tokens)
        coarse = np.random.default_rng(index).integers(0, 256, (max(side // 32, 2),) * 2 + (3,), dtype=np.uint8)
        image, fmt = Image.fromarray(coarse).resize((side, side), Image.BICUBIC), "JPEG"
    buf = io.BytesIO()
    image.save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def stream_turn(client, model: str, messages: list, max_tokens: int) -> dict:
    """One streamed request: its answer, TTFT (s), completion tokens, and the Raincheck usage extension (if any)."""
    start = time.perf_counter()
    ttft, pieces, usage = None, [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, max_tokens=max_tokens,
                                                temperature=0):
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - start
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    end = time.perf_counter() - start
    return {"answer": "".join(pieces), "ttft": ttft if ttft is not None else end, "seconds": end,
            "tokens": usage.completion_tokens if usage is not None else 0,
            "raincheck": (usage.model_extra or {}).get("raincheck") if usage is not None else None}


def conversation(server, args, index: int, turns: int, think_s: float) -> list[dict]:
    """One conversation: turn 1 with an image, then text follow-ups (`stream_turn` results, one per turn)."""
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    content = [{"type": "image_url", "image_url": {"url": image_url(args.image_tokens, index)}},
               {"type": "text", "text": QUESTIONS[index % len(QUESTIONS)]}]
    messages = [{"role": "user", "content": content}]
    results = []
    for turn in range(turns):
        result = stream_turn(client, server.model_id, messages, args.max_tokens)
        results.append(result)
        messages += [{"role": "assistant", "content": result["answer"]},
                     {"role": "user", "content": QUESTIONS[(index + turn + 1) % len(QUESTIONS)]}]
        if turn + 1 < turns:
            time.sleep(think_s)
    return results


# ---------------------------------------------------------------------------------------------- the servers
class RaincheckSide:
    name = "raincheck"

    def __init__(self, args, model=None, processor=None):
        from hf_raincheck import RaincheckConfig
        from hf_raincheck.serve import DEFAULT_MODEL, RaincheckServer

        config = RaincheckConfig(retention=args.retention, pruning=args.pruning)
        common = dict(port=0, cache_budget_mb=args.cache_budget_mb, max_batch_size=args.max_batch_size,
                      batch_window_ms=args.batch_window_ms)
        if model is not None:
            self.server = RaincheckServer(model, config, processor=processor, model_name=model.name_or_path, **common)
        else:
            self.server = RaincheckServer(args.model, config, device=args.device, dtype=args.dtype, **common)
        self.model_id = args.model or (model.name_or_path if model is not None else DEFAULT_MODEL)
        self.server.start()
        self.base_url = self.server.base_url
        self.call_log = None
        if getattr(args, "log_calls", False):  # every batched call's rows and (CUDA) memory: `serve_memory.CallLog`
            from serve_memory import CallLog

            self.call_log = CallLog().install()

    def settle(self, timeout: float = 120.0) -> None:
        """Waits until the server has nothing queued, running or left to restore."""
        if not self.server.scheduler.wait_idle(timeout):
            raise RuntimeError(f"the Raincheck server was still busy {timeout:g} s after a phase")

    def extra(self) -> dict:
        extra = {"pool": self.server.pool.snapshot(), "batches": self.server.scheduler.batch_stats.snapshot(),
                 "restored_between_requests": self.server.scheduler.restored_between_requests}
        if self.call_log is not None:
            extra["calls"] = list(self.call_log.entries)
        return extra

    def stop(self) -> None:
        if self.call_log is not None:
            self.call_log.uninstall()
        self.server.stop()


class PlainSide:
    name = "plain"

    def __init__(self, args, model=None, processor=None):
        import hf_raincheck.testing  # noqa: F401 - lets AutoProcessor build Qwen3-VL processors without torchvision
        from transformers.cli.serve import Serve

        from hf_raincheck.gridqa import default_path
        from hf_raincheck.serve.app import free_port

        self.port = free_port()
        if model is not None:
            # the model object goes into this instance's cache of loaded models, under the name the client sends
            from transformers.cli.serving.model_manager import TimedModel

            self.model_id = model.name_or_path
            self.serve = Serve(port=self.port, host="127.0.0.1", non_blocking=True, model_timeout=-1,
                               log_level="error")
            manager = self.serve._model_manager
            manager.loaded_models[manager.process_model_name(self.model_id)] = TimedModel(
                model, timeout_seconds=-1, processor=processor)
        else:
            self.model_id = args.model or default_path()
            self.serve = Serve(force_model=self.model_id, port=self.port, host="127.0.0.1", non_blocking=True,
                               device="cpu" if args.model is None else args.device, dtype=args.dtype,
                               log_level="error")
        # transformers serve configures uvicorn's loggers at "info": one access line per request; keep warnings only
        logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
        deadline = time.monotonic() + 600
        while not self.serve.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("transformers serve did not start")
            time.sleep(0.05)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def settle(self, timeout: float = 120.0) -> None:
        pass

    def extra(self) -> dict:
        return {}

    def stop(self) -> None:
        self.serve.kill_server()


# ---------------------------------------------------------------------------------------------- device memory
def gpu_memory_start() -> dict | None:
    """Resets CUDA's peak counter; the bytes allocated now (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.reset_peak_memory_stats()
    return {"allocated_at_start_gb": torch.cuda.memory_allocated() / 2**30}


def gpu_memory_end(start: dict | None) -> dict | None:
    """`start` plus the peak allocated since it (``torch.cuda.max_memory_allocated``) and what is allocated now."""
    import torch

    if start is None:
        return None
    return dict(start, peak_allocated_gb=torch.cuda.max_memory_allocated() / 2**30,
                allocated_at_end_gb=torch.cuda.memory_allocated() / 2**30)


# ---------------------------------------------------------------------------------------------- the phases
class Budget:
    """What is left of ``--budget-s`` (None: no limit) and what each server's requests took so far."""

    MARGIN = 1.25

    def __init__(self, seconds: float | None, start: float):
        self.deadline = None if seconds is None else start + seconds
        self.request_s: dict[str, float] = {}  # seconds per request (wall of a phase / its requests), per server

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def fits(self, requests_by_server: dict[str, float], fixed_s: float) -> bool:
        cost = sum(n * self.request_s.get(name, 0.0) + fixed_s for name, n in requests_by_server.items())
        return cost * self.MARGIN <= self.left()

    def observe(self, name: str, wall_s: float, requests: int) -> None:
        self.request_s[name] = wall_s / max(requests, 1)


def throughput_run(side, args, n: int, think_s: float) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        runs = list(pool.map(lambda i: conversation(side, args, 200 + i, args.turns, think_s), range(n)))
    wall = time.perf_counter() - start
    turns = [t for run in runs for t in run]
    tokens = sum(t["tokens"] for t in turns)
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "completion_tokens": tokens, "requests": len(turns),
            "mean_ttft_s": statistics.fmean(t["ttft"] for t in turns),
            "answers_of_max_tokens": sum(t["tokens"] == args.max_tokens for t in turns)}


def summarize(sides: list, results: dict) -> None:
    """The TTFT medians and each server's own counters, into `results` (after every phase: a run stopped
    midway still leaves a consistent report)."""
    for side in sides:
        result = results[side.name]
        for turn in (1, 2):
            values = result[f"ttft_turn{turn}_all_s"]
            result[f"ttft_turn{turn}_s"] = statistics.median(values) if values else None
        result.update(side.extra())


def measure(sides: list, args, budget: Budget, after_phase=lambda results, skipped: None) -> tuple[dict, list[str]]:
    """Both servers, phase by phase (module docstring); (results by server, skipped phases). `after_phase` is
    called after each phase, once `results` and `skipped` (the objects returned) are up to date."""
    think_s = args.think_ms / 1000
    results = {side.name: {"ttft_turn1_all_s": [], "ttft_turn2_all_s": [], "turn2_raincheck": [],
                           "throughput": {}, "gpu_memory": {}} for side in sides}
    skipped = []

    def phase_done():
        summarize(sides, results)
        after_phase(results, skipped)

    after_phase(results, skipped)
    for side in sides:  # warm-up: one 2-turn conversation each (not measured); the first per-request estimate
        start = time.perf_counter()
        conversation(side, args, 999, 2, 0)
        budget.observe(side.name, time.perf_counter() - start, 2)
        side.settle()
    for i in range(args.repeats):
        if not budget.fits({side.name: 2 for side in sides}, think_s):
            skipped.append(f"ttft repeat {i + 1} of {args.repeats}")
            continue
        for side in sides:
            begin = time.perf_counter()
            memory = gpu_memory_start()
            try:
                first, second = conversation(side, args, i, 2, think_s)
            finally:
                results[side.name]["gpu_memory"][f"ttft {i + 1}"] = gpu_memory_end(memory)
            budget.observe(side.name, time.perf_counter() - begin - think_s, 2)
            results[side.name]["ttft_turn1_all_s"].append(first["ttft"])
            results[side.name]["ttft_turn2_all_s"].append(second["ttft"])
            if second["raincheck"] is not None:
                results[side.name]["turn2_raincheck"].append(second["raincheck"])
            side.settle()
        phase_done()
    for n in args.concurrency:
        if not budget.fits({side.name: n * args.turns for side in sides}, (args.turns - 1) * think_s):
            skipped.append(f"throughput at {n} conversations")
            continue
        for side in sides:
            memory = gpu_memory_start()
            try:
                run = throughput_run(side, args, n, think_s)
            finally:
                results[side.name]["gpu_memory"][f"throughput {n}"] = gpu_memory_end(memory)
            results[side.name]["throughput"][str(n)] = run
            budget.observe(side.name, run["wall_s"], run["requests"])
            side.settle()
        phase_done()
    summarize(sides, results)
    return results, skipped


# ---------------------------------------------------------------------------------------------- the command
def parse_args(argv=None):
    from hf_raincheck.serve.scheduler import DEFAULT_BATCH_WINDOW_S, DEFAULT_MAX_BATCH_SIZE
    from shapes import SHAPES

    qwen3_vl_shapes = [name for name, spec in SHAPES.items() if spec["family"] == "qwen3_vl"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default=None, help="Hub id or path (default: the shipped GridQA Qwen3-VL, CPU)")
    which.add_argument("--random-weights", default=None, choices=qwen3_vl_shapes,
                       help="serve a random-weight model of this shape from memory (benchmarks/serve_model.py)")
    parser.add_argument("--device", default="auto", help="auto: cuda if there is one (random weights), else cpu")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on cuda, float32 on cpu (random weights)")
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--pruning", default="mmtok")
    parser.add_argument("--image-tokens", type=int, default=None,
                        help="merged visual tokens per image (a square number; not for the GridQA model; "
                             "default 4096, tiny shapes 64)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default: per mode)")
    parser.add_argument("--think-ms", type=float, default=None, help="pause between an answer and the next turn")
    parser.add_argument("--repeats", type=int, default=None, help="conversations for the TTFT medians")
    parser.add_argument("--turns", type=int, default=None, help="turns per conversation in the throughput runs")
    parser.add_argument("--concurrency", default="1,4,8", help="concurrent conversations, comma-separated")
    parser.add_argument("--servers", default="raincheck,plain", help="which servers: raincheck, plain")
    parser.add_argument("--cache-budget-mb", type=float, default=None,
                        help="the Raincheck server's conversation pool (default 4096; 16384 for 4096-token images)")
    parser.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE,
                        help="the Raincheck server's --max-batch-size (1: one request at a time)")
    parser.add_argument("--batch-window-ms", type=float, default=DEFAULT_BATCH_WINDOW_S * 1000,
                        help="the Raincheck server's --batch-window-ms")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the whole script (model build included); phases that would not fit are "
                             "skipped (default: 420 with --random-weights qwen3-vl-8b, else none)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--log-calls", action="store_true",
                        help="record every batched call of the Raincheck server (rows, KV capacity, CUDA memory "
                             "before / after) under its result's 'calls' (benchmarks/serve_memory.py)")
    parser.add_argument("--save", action="store_true", help=f"write the JSON to {os.path.relpath(RESULTS, ROOT)}")
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    if args.random_weights is not None:
        mode = "random-8b" if args.random_weights == "qwen3-vl-8b" else "random-small"
    else:
        mode = "model" if args.model is not None else "gridqa"
    if mode == "gridqa" and args.image_tokens is not None:
        parser.error("--image-tokens: the GridQA model's images are its own grids; give --model or --random-weights")
    for name, value in DEFAULTS[mode].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.mode = mode
    try:
        args.concurrency = [int(n) for n in args.concurrency.split(",") if n]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    args.servers = [s for s in args.servers.split(",") if s]
    for name in args.servers:
        if name not in ("raincheck", "plain"):
            parser.error(f"--servers: unknown server {name!r}; allowed: raincheck, plain")
    checks = [("--max-batch-size", args.max_batch_size >= 1, ">= 1"), ("--max-tokens", args.max_tokens >= 1, ">= 1"),
              ("--repeats", args.repeats >= 0, ">= 0"), ("--turns", args.turns >= 1, ">= 1"),
              ("--think-ms", args.think_ms >= 0, ">= 0"), ("--concurrency", all(n >= 1 for n in args.concurrency),
                                                           "integers >= 1"),
              ("--budget-s", args.budget_s is None or args.budget_s > 0, "> 0")]
    for flag, ok, allowed in checks:
        if not ok:
            parser.error(f"{flag} must be {allowed}, got {getattr(args, flag[2:].replace('-', '_'))}")
    if args.image_tokens is not None:
        from serve_model import image_side

        try:
            image_side(args.image_tokens)
        except ValueError as error:
            parser.error(str(error))
    if "plain" in args.servers and SERVING_ENGINE_PROCESS:
        parser.error(f"--servers plain: the plain side runs transformers serve in this process (its model object, the "
                     f"package's torchvision-free processors), as transformers 5.23 and 5.24 do; transformers "
                     f"{installed_transformers_version()} runs each model in an engine process of its own. Run it "
                     "under transformers 5.23 or 5.24, or pass --servers raincheck")
    return args


def random_model(args) -> tuple:
    """(model, processor, header fields) of ``--random-weights``: built on the device, checked on one image."""
    import torch

    import serve_model

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    start = time.perf_counter()
    processor = serve_model.load_processor(args.image_tokens)
    model = serve_model.build(args.random_weights, args.device, getattr(torch, args.dtype), processor)
    from PIL import Image

    sample = Image.open(io.BytesIO(base64.b64decode(image_url(args.image_tokens, 0).split(",", 1)[1])))
    tokens = serve_model.image_tokens_of(processor, sample)
    if tokens != args.image_tokens:
        raise RuntimeError(f"the processor gives {tokens} merged tokens per image, not --image-tokens "
                           f"{args.image_tokens}")
    head = {"model": f"{model.name_or_path} (random weights, {args.dtype}, {args.device})",
            "image_tokens": tokens, "vocab_size": model.config.text_config.vocab_size,
            "answer_vocabulary": len(serve_model.answer_vocabulary(processor.tokenizer)),
            "build_s": time.perf_counter() - start}
    return model, processor, head


def main(argv=None) -> dict:
    start = time.monotonic()
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = {"model": args.model or "hf-raincheck/gridqa-qwen3-vl (CPU)", "device": args.device,
              "retention": args.retention, "pruning": args.pruning, "max_tokens": args.max_tokens,
              "max_batch_size": args.max_batch_size, "batch_window_ms": args.batch_window_ms,
              "think_ms": args.think_ms, "repeats": args.repeats, "turns": args.turns,
              "image_tokens": args.image_tokens, "cache_budget_mb": args.cache_budget_mb, "budget_s": args.budget_s}
    models = {}
    if args.random_weights is not None:
        model, processor, head = random_model(args)
        report.update(head, device=args.device)
        # plain serve gets its own copy, made before the Raincheck server enables Raincheck on the original
        models = {"plain": (copy.deepcopy(model), processor) if "plain" in args.servers else None,
                  "raincheck": (model, processor)}
    kinds = {"raincheck": RaincheckSide, "plain": PlainSide}
    out = args.out or (RESULTS if args.save else None)

    def write(results, skipped, partial: bool) -> None:
        report.update(servers=results, skipped=skipped, partial=partial, total_s=time.monotonic() - start)
        servers = report["servers"]
        if "raincheck" in servers and "plain" in servers and servers["plain"].get("ttft_turn2_s") and \
                servers["raincheck"].get("ttft_turn2_s"):
            ratio = servers["raincheck"]["ttft_turn2_s"] / servers["plain"]["ttft_turn2_s"]
            report["turn2_ttft_raincheck_over_plain"] = ratio
            report["turn2_ttft_target_met"] = ratio <= 0.3
        if out:
            with open(out, "w") as f:
                json.dump(report, f, indent=2)

    sides = []
    seen = {}

    def after_phase(results, skipped) -> None:
        seen.update(results=results, skipped=skipped)
        write(results, skipped, partial=True)

    try:
        for name in args.servers:
            sides.append(kinds[name](args, *(models.get(name) or (None, None))))
        report["setup_s"] = time.monotonic() - start
        setup_memory = gpu_memory_end(gpu_memory_start())
        if setup_memory is not None:
            report["gpu_allocated_after_setup_gb"] = setup_memory["allocated_at_end_gb"]
        results, skipped = measure(sides, args, Budget(args.budget_s, start), after_phase=after_phase)
    except Exception as error:
        if seen:  # the phases so far and the failing phase's GPU memory (gpu_memory), then the error
            report["error"] = f"{type(error).__name__}: {error}"
            for side in sides:  # (the failing phase's calls too)
                if getattr(side, "call_log", None) is not None:
                    seen["results"][side.name]["calls"] = list(side.call_log.entries)
            write(seen["results"], seen["skipped"], partial=True)
        raise
    finally:
        for side in sides:
            side.stop()
    write(results, skipped, partial=False)
    print_table(report, args)
    return report


def print_table(report: dict, args) -> None:
    def ms(value):
        return f"{value * 1000:>9.0f} ms" if value is not None else f"{'-':>12}"

    print(f"{'server':<10} {'TTFT turn 1':>12} {'TTFT turn 2':>12}  " +
          "  ".join(f"{n} conv tok/s (TTFT)" for n in args.concurrency))
    for name, result in report["servers"].items():
        row = "  ".join(f"{t['tokens_per_s']:>9.1f} ({t['mean_ttft_s'] * 1000:>6.0f} ms)"
                        for t in result["throughput"].values())
        print(f"{name:<10} {ms(result['ttft_turn1_s'])} {ms(result['ttft_turn2_s'])}  {row}")
    if "turn2_ttft_raincheck_over_plain" in report:
        print(f"turn-2 TTFT raincheck / plain: {report['turn2_ttft_raincheck_over_plain']:.3f} (target <= 0.3)")
    if "batches" in report["servers"].get("raincheck", {}):
        print(f"raincheck generate calls by rows (all runs): {report['servers']['raincheck']['batches']['sizes']}")
    for name, result in report["servers"].items():
        peaks = {phase: round(m["peak_allocated_gb"], 1) for phase, m in result.get("gpu_memory", {}).items() if m}
        if peaks:
            print(f"{name} GPU peak allocated per phase (GiB): {peaks}")
    if report["skipped"]:
        print(f"skipped (--budget-s {args.budget_s:g}): {', '.join(report['skipped'])}")
    print(f"total {report['total_s']:.0f} s (setup {report['setup_s']:.0f} s)")


if __name__ == "__main__":
    main()
