"""Latency of plain generate, Full, Hard and Raincheck side by side (issue 5): TTFT, TPOT, restoration steps, E2E, memory.

    python benchmarks/latency.py --device cuda --save --profile     # the GPU run (--budget-s 400)
    python benchmarks/latency.py --device cuda --save --merge --workloads video16,image1024   # what it skipped
    python benchmarks/latency.py --quick                             # tiny shapes on the CPU, seconds (CI smoke run)
    python benchmarks/latency.py --device cuda --gpus 1,2 --save     # each model on one GPU, then split over two

Random-weight models of the Qwen3-VL-8B and Qwen3.5-9B shapes (``shapes.py``; latency does not depend on weight
values), bf16. Workloads: one 1024-token image, one 4096-token image, a 16-frame video (8 temporal groups of 256
tokens, each its own span), ~40 text tokens; ``--new-tokens`` (256) forced with ``min_new_tokens``. Per model,
workload and cache kind the policies run side by side:

* ``plain``: transformers' own generate (no ``raincheck_config``);
* ``full``, ``hard``: ``RaincheckConfig(policy=...)``;
* ``raincheck``: retention 0.3, chunk ``--chunk-size`` (the package's ``auto``: 31; 63 for Qwen3.5), guard 16,
  selector ``--pruning`` (``uniform``: selection cost is measured by ``selector_speed.py``), blocking completion so
  that E2E includes finishing D;
* ``raincheck`` with ``fused=False``: the control (the carried chunk as its own forward before the decode step);
* ``--chunk-sweep``: Raincheck with other chunk sizes on ``--sweep-workload``.

Cache kinds: ``dynamic`` (eager decode) and ``static``. On a static cache transformers compiles plain generate's
decode step (``reduce-overhead``: CUDA graphs); the script hands it one ``StaticCache`` per model, sized for the
largest workload and emptied before each call, so one graph is recorded once (a new cache per call, as
``cache_implementation="static"`` builds, would re-record it during every answer). Raincheck's policies get
``cache_implementation="static"`` and transformers' default ``compile_config`` (what they get without one too),
which compiles Raincheck's steps; ``--gdn-backend`` picks the GDN layers' kernels; the console shows the count of
compiled graphs.

Measurements (each after a warm-up call of the same shapes, which also absorbs compilation):

* ``ttft_ms``: inputs already on the device -> first token (vision, selection and prefill included): median over
  ``--ttft-repeats`` calls stopped after the first token plus the answer runs (``ttft_ms_calls``: each call's, the
  first-token-only calls first, then the answer runs in order);
* ``tpot_ms``: over the whole answer (first to last token); ``restore_step_ms`` / ``decode_step_ms``: mean
  duration of the decode steps that carried deferred tokens / of the other decode steps. A streamer's ``put``
  timestamps every token after a device synchronisation; decode step j feeds token j and ends with token j+1;
* ``e2e_ms``: the generate call (blocking completion of what the answer left pending included);
  ``restored_at_token``: the output token produced by the step that carried the last deferred chunk (None: the
  answer ended first); ``peak_mem_gib``: ``torch.cuda.max_memory_allocated`` over the answer run;
* ``one_off_steps``: ``[decode step, ms]`` of the answer's steps over 3x its median step (e.g. a CUDA graph
  recorded again; the console line counts the answers that had any, over every round);
* ``warmup_s``: seconds of the policy's warm-up answer, its first call in the process (on a static cache the
  compilation and CUDA-graph recording of the steps it is the first policy to need): what a user's first call pays
  once per process;
* ``--interleave``: per workload and cache, every policy warms up first (and once more if a later one compiled a
  graph: a chunk sweep's second chunk makes the fused step's graph dynamic in the chunk), then their ``--repeats``
  answer runs alternate round by round (the order rotating), so a drift over the call moves them alike; records add
  ``rounds``, ``tpot_ms_rounds``, ``tpot_vs_full_paired`` and ``tpot_vs_plain_paired`` (the median over rounds of TPOT
  / Full's, plain generate's, TPOT of the same round), and the targets a paired TPOT check (run to run, Full's TPOT
  moved more than the targets allow);
* medians over ``--repeats`` answer runs, ratios against Full and against plain generate (``--policies ...,plain``)
  on the same cache kind in the table, and the issue's targets
  (Raincheck TTFT <= 1.03 x Hard and <= 0.80 x Full on image4096; TPOT and the restoration step against Full's
  and a decode-only step by model family and cache, `STEP_LIMITS`: compiled Qwen3.5 1.05 / 1.20, eager 1.10 /
  1.15; compiled Qwen3-VL 1.03 / 1.15, eager 1.05 / 1.15).

Multi-GPU (``--gpus 1,2``): after the one-GPU runs the same model (same seed, same weights) is built again and
dispatched by accelerate over ``cuda:0 .. cuda:{N-1}`` with the device_map ``from_pretrained(device_map=...)``
would produce at layer granularity (``shapes.split_device_map``: vision tower and embeddings on the first GPU,
decoder layers in contiguous halves, norm and ``lm_head`` on the last); records carry ``gpus``, timing syncs every
GPU of the model, ``peak_mem_gib`` is summed over them, and ratios compare runs on the same number of GPUs. The
profile (``--profile``) then also lists each step's memory copies by kind (``Memcpy PtoP``: between GPUs).

Time budget (``--budget-s``): runs go in priority order (per model: each workload's Full, Raincheck, Hard, control,
plain, dynamic cache first; the chunk sweep last); a run whose estimated time does not fit the model's share of
what is left is skipped and listed under ``skipped`` in the JSON. Files go to ``--results-dir``
(``benchmarks/results``): with ``--save`` the JSON (``latency.json``, rewritten after every run, so a run cut short
still leaves its results; ``--merge`` keeps the file's records that this call does not measure again) and the PNG
(``latency.png``, needs matplotlib: ``pip install -e .[bench]``); with ``--profile`` a torch.profiler table of one
fused step and one decode-only step of Raincheck (first model and workload, each cache kind),
``latency_profile.txt``; with ``--profile-ttft`` (same file) one first-token call of Full, Hard and Raincheck each,
sorted by GPU time and by host time, with the wall time and the GPU kernels' busy time (a first turn whose GPU idles
is host-bound); with ``--ttft-phases N`` N first-token calls of Full, Hard and Raincheck in turn (the order rotating
per call), each split by phase (vision, selection, the prefill forward, the static cache's preparation; each phase's
function wrapped with a device sync) with the call's new ``cudaMalloc`` count: printed, and saved in the JSON header
(``ttft_phases``), with each policy's medians and Raincheck's first token over Hard's and Full's call by call
(``ttft_phases_summary``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch
import transformers
from transformers import StaticCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.configuration_utils import CompileConfig
from transformers.generation.streamers import BaseStreamer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from shapes import SHAPES, build_inputs, build_model, build_video_inputs, default_chunk_size, dispatch  # noqa: E402

import hf_raincheck  # noqa: E402
from hf_raincheck import FixedChunkSchedule, RaincheckConfig, enable_raincheck, release_static_buffers  # noqa: E402
from hf_raincheck.config import parse_chunk_size  # noqa: E402
from hf_raincheck.conversation import cache_argument, output_cache  # noqa: E402
from hf_raincheck.generation.schedule import carried_tokens  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RECORD_KEYS = ("model", "workload", "policy", "chunk_size", "fused", "ttft_ms", "tpot_ms", "restore_step_ms",
               "decode_step_ms", "e2e_ms", "restored_at_token", "peak_mem_gib", "cache", "gpus", "step_ms",
               "rounds", "tpot_ms_rounds", "tpot_vs_full_paired", "tpot_vs_plain_paired", "one_off_steps",
               "ttft_ms_calls", "warmup_s")
TEXT_BEFORE, QUESTION = 10, 30  # ~40 text tokens around the media
TARGET_WORKLOAD = "image4096"  # where the TTFT targets are checked
#: Raincheck's TPOT / Full's and restoration step / decode-only step limits per (model family, cache): the speed
#: issue's for compiled (static) and eager (dynamic) Qwen3.5 and Qwen3-VL; restoration on the dynamic caches keeps
#: the first issue's 1.15
STEP_LIMITS = {("qwen3_5", "static"): (1.05, 1.20), ("qwen3_5", "dynamic"): (1.10, 1.15),
               ("qwen3_vl", "static"): (1.03, 1.15), ("qwen3_vl", "dynamic"): (1.05, 1.15)}
# a first run of a kind has no measured estimate: assume this much (s) when deciding whether it fits the budget
# (compiled warm-ups take about a minute or more per policy and workload on a GPU, answers a few seconds)
FIRST_RUN_GUESS_S = {"eager": 20.0, "compiled": 90.0}


# ---------------------------------------------------------------------------------------------------- workloads
@dataclasses.dataclass(frozen=True)
class Workload:
    """One image of ``side x side`` merged tokens, or a video of `frames` frames of ``side x side`` per group."""

    name: str
    side: int
    frames: int = 0  # 0: an image

    @property
    def spans(self) -> int:
        return max(self.frames // 2, 1)  # two frames per temporal patch: one span per temporal group

    @property
    def visual_tokens(self) -> int:
        return self.side * self.side * self.spans

    @property
    def prompt_tokens(self) -> int:
        return TEXT_BEFORE + QUESTION + self.visual_tokens + 2 * self.spans  # <vision_start> / <vision_end>

    def inputs(self, device: str, dtype: torch.dtype) -> dict:
        if self.frames:
            return build_video_inputs(self.frames, self.side, TEXT_BEFORE, QUESTION, device, dtype)
        return build_inputs(self.side * self.side, TEXT_BEFORE, QUESTION, device, dtype)


WORKLOADS = {"image1024": Workload("image1024", 32), "image4096": Workload("image4096", 64),
             "video16": Workload("video16", 16, frames=16)}
QUICK_WORKLOADS = {"image1024": Workload("image1024", 8), "image4096": Workload("image4096", 12),
                   "video16": Workload("video16", 4, frames=16)}


# ---------------------------------------------------------------------------------------------------- policies
@dataclasses.dataclass(frozen=True)
class Policy:
    name: str  # the record's `policy`: plain | full | hard | raincheck
    config: RaincheckConfig | None

    @property
    def chunk_size(self) -> int | None:
        return self.config.chunk_size if self.name == "raincheck" else None

    @property
    def fused(self) -> bool | None:
        return self.config.fused if self.name == "raincheck" else None

    @property
    def label(self) -> str:
        if self.name != "raincheck":
            return self.name
        return ("raincheck" if self.fused else "raincheck unfused") + f" c{self.chunk_size}"


def raincheck_policy(args, chunk_size: int, fused: bool = True) -> Policy:
    return Policy("raincheck", RaincheckConfig(
        retention=args.retention, chunk_size=chunk_size, guard_tokens=args.guard_tokens, pruning=args.pruning,
        completion="blocking", fused=fused, gdn_backend=args.gdn_backend, attn_backend=args.attn_backend))


def full_policy(args) -> Policy:
    return Policy("full", RaincheckConfig(policy="full", completion="blocking", gdn_backend=args.gdn_backend,
                                          attn_backend=args.attn_backend))


POLICY_NAMES = ("full", "raincheck", "hard", "unfused", "plain")  # --policies, in priority order


def main_policies(args) -> list[Policy]:
    """Priority order: what the ratios need first (Full, Raincheck), the references last; those in --policies."""
    policies = {
        "full": full_policy(args),
        "raincheck": raincheck_policy(args, args.chunk_size),
        "hard": Policy("hard", RaincheckConfig(policy="hard", retention=args.retention, pruning=args.pruning,
                                               completion="blocking", gdn_backend=args.gdn_backend,
                                               attn_backend=args.attn_backend)),
        "unfused": raincheck_policy(args, args.chunk_size, fused=False),
        "plain": Policy("plain", None),
    }
    return [policies[name] for name in POLICY_NAMES if name in args.policies]


def first_turn_policies(args) -> list[Policy]:
    """Full, Hard and Raincheck (fused) among --policies: the ones whose first turns differ."""
    return [p for p in main_policies(args) if p.name in ("full", "hard", "raincheck") and p.fused is not False]


def run_plan(args) -> list[tuple[str, str, Policy]]:
    """(workload, cache, policy) for one model, in priority order."""
    plan = [(w, c, p) for w in args.workloads for c in args.caches for p in main_policies(args)]
    sweep = [size for size in args.chunk_sweep if size != args.chunk_size]
    plan += [(args.sweep_workload, c, raincheck_policy(args, size)) for c in args.caches for size in sweep]
    return plan


# ---------------------------------------------------------------------------------------------------- timing
class Timer(BaseStreamer):
    """Timestamps of ``put`` after a device sync: ``times[0]`` the prompt, ``times[k]`` output token k.

    `hook(k)` (optional) runs right after token k's timestamp (k = 0 for the prompt).
    """

    def __init__(self, sync, hook=None):
        self.sync, self.hook, self.times = sync, hook, []

    def put(self, value):
        self.sync()
        self.times.append(time.perf_counter())
        if self.hook is not None:
            self.hook(len(self.times) - 1)

    def end(self):
        pass


class StopAfter(StoppingCriteria):
    """Stops once `length` tokens (prompt included) exist; lets a short call keep the long call's shapes."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        done = input_ids.shape[-1] >= self.length
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def no_gc():
    """No garbage-collector pauses inside a timed call (collecting first is cheap: the model is frozen)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Bench:
    """One built model, the run's settings, and how to time calls on it."""

    def __init__(self, model, name: str, args, cuda: bool, devices: list[str] | None = None):
        self.model, self.name, self.args, self.cuda = model, name, args, cuda
        self.devices = list(dict.fromkeys(devices or [args.device]))  # distinct devices the model spans
        self.gpus = len(devices or [args.device])
        self._static_cache = None

    def sync(self) -> None:
        if self.cuda:
            for device in self.devices:  # a model split over GPUs: every GPU's queue
                torch.cuda.synchronize(device)

    def reset_peak_memory(self) -> None:
        if self.cuda:
            for device in self.devices:
                torch.cuda.reset_peak_memory_stats(device)

    def peak_memory_gib(self) -> float | None:
        """Peak allocated memory summed over the model's GPUs (None on the CPU)."""
        if not self.cuda:
            return None
        return sum(torch.cuda.max_memory_allocated(device) for device in self.devices) / 2**30

    def plain_static_cache(self) -> StaticCache:
        """One `StaticCache` (emptied) for every plain static call on this model.

        ``cache_implementation="static"`` would build a new cache per call: new buffer addresses make the compiled
        decode step re-record its CUDA graph during each answer. Reusing one cache of one size (the largest
        workload's) keeps a single graph per model, recorded during the first warm-up.
        """
        if self._static_cache is None:
            self._static_cache = StaticCache(config=self.model.config.get_text_config(decoder=True),
                                             max_cache_len=self.args.max_cache_len)
        self._static_cache.reset()
        return self._static_cache

    def generate_kwargs(self, policy: Policy, inputs: dict, cache: str, stop_after: int | None) -> dict:
        """Keyword arguments of one generate call; `stop_after` output tokens (None: the full forced answer).

        Short calls keep ``max_new_tokens`` (so static caches get the answer run's size) and stop with a criterion;
        they leave deferred tokens pending (``completion="next_turn"``), which costs nothing as the cache is dropped.
        """
        n = self.args.new_tokens
        kwargs = dict(inputs, max_new_tokens=n, do_sample=False, return_dict_in_generate=True)
        if stop_after is None:
            kwargs["min_new_tokens"] = n
        else:
            kwargs["stopping_criteria"] = StoppingCriteriaList([StopAfter(inputs["input_ids"].shape[1] + stop_after)])
        if policy.config is None:
            if cache == "static":
                kwargs.update(cache_argument(self.plain_static_cache()))
        else:
            config = policy.config if stop_after is None else dataclasses.replace(policy.config, completion="next_turn")
            kwargs["raincheck_config"] = config
            if cache == "static":
                kwargs["cache_implementation"] = "static"  # Raincheck sizes its own static cache
                kwargs["compile_config"] = CompileConfig()  # transformers' default, spelled out
        return kwargs

    def generate(self, inputs, policy, cache, stop_after=None, hook=None):
        """(output, Timer, start, end) of one generate call; start/end after a device sync."""
        timer = Timer(self.sync, hook)
        kwargs = self.generate_kwargs(policy, inputs, cache, stop_after)
        with no_gc(), torch.no_grad():
            self.sync()
            start = time.perf_counter()
            out = self.model.generate(**kwargs, streamer=timer)
            self.sync()
            end = time.perf_counter()
        return out, timer, start, end


def carry_counts(config: RaincheckConfig, deferred: int, steps: int) -> list[int]:
    """Deferred tokens carried by decode steps 1..steps (docs/design.md rule 4, the package's own schedule)."""
    schedule = config.schedule or FixedChunkSchedule(config.chunk_size, config.guard_tokens)
    counts, pending = [], deferred
    for step in range(1, steps + 1):
        count = carried_tokens(schedule, step, pending)
        counts.append(count)
        pending -= count
    return counts


def restoration(out, policy: Policy, steps: int) -> tuple[list[int], int | None]:
    """Per decode step carried counts and ``restored_at_token`` (checked against the cache's own stats)."""
    if policy.name != "raincheck":
        return [0] * steps, None
    record = output_cache(out).turn_stats[-1]
    counts = carry_counts(policy.config, record.deferred, steps)
    if sum(counts) != record.restored_during_decode:
        print(f"  warning: the schedule carries {sum(counts)} deferred tokens, the cache counted "
              f"{record.restored_during_decode}")
    if record.deferred == 0 or sum(counts) < record.deferred:
        return counts, None
    last_step = max(j for j, count in enumerate(counts, start=1) if count)
    return counts, last_step + 1  # step j produces output token j + 1


def mean_ms(values: list[float]) -> float | None:
    return 1e3 * statistics.fmean(values) if values else None


def median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def answer_run(bench: Bench, inputs, policy, cache) -> dict:
    """One forced answer of ``--new-tokens`` tokens: every metric of a record (TTFT: one sample)."""
    bench.reset_peak_memory()
    out, timer, start, end = bench.generate(inputs, policy, cache)
    tokens = timer.times[1:]
    if len(tokens) != bench.args.new_tokens:
        raise RuntimeError(f"expected {bench.args.new_tokens} tokens, the streamer saw {len(tokens)}")
    steps = [b - a for a, b in zip(tokens, tokens[1:])]  # steps[j-1]: decode step j
    counts, restored_at = restoration(out, policy, len(steps))
    del out
    return dict(
        ttft_ms=1e3 * (tokens[0] - start),
        tpot_ms=1e3 * (tokens[-1] - tokens[0]) / max(len(steps), 1),
        restore_step_ms=mean_ms([s for s, c in zip(steps, counts) if c]),
        decode_step_ms=mean_ms([s for s, c in zip(steps, counts) if not c]),
        e2e_ms=1e3 * (end - start),
        restored_at_token=restored_at,
        peak_mem_gib=bench.peak_memory_gib(),
        step_ms=[round(1e3 * s, 3) for s in steps],
    )


def ttft_run(bench: Bench, inputs, policy, cache) -> float:
    _, timer, start, _ = bench.generate(inputs, policy, cache, stop_after=1)
    return 1e3 * (timer.times[1] - start)


def warm_up(bench: Bench, inputs, policy: Policy, cache: str) -> tuple[list[float], float]:
    """A whole answer (every step kind and every switch between them, decode-only -> fused -> decode-only, runs
    once, so compilation and CUDA-graph recording stay out of the measured calls), then the TTFT-only calls;
    returns their TTFTs and the warm-up's seconds."""
    t0 = time.perf_counter()
    bench.generate(inputs, policy, cache)
    warmup_s = time.perf_counter() - t0
    return [ttft_run(bench, inputs, policy, cache) for _ in range(bench.args.ttft_repeats)], warmup_s


def make_record(bench: Bench, workload: str, policy: Policy, cache: str, ttfts: list[float],
                answers: list[dict], warmup_s: float) -> dict:
    """One record from a run's warm-up, TTFT calls and answer runs: medians (peak memory: the maximum)."""
    record = dict(model=bench.name, workload=workload, policy=policy.name, chunk_size=policy.chunk_size,
                  fused=policy.fused, cache=cache, gpus=bench.gpus)
    record["ttft_ms"] = statistics.median(ttfts + [a["ttft_ms"] for a in answers])
    record["ttft_ms_calls"] = [round(t, 2) for t in ttfts + [a["ttft_ms"] for a in answers]]
    for key in ("tpot_ms", "restore_step_ms", "decode_step_ms", "e2e_ms", "restored_at_token"):
        record[key] = median_or_none([a[key] for a in answers])
    record["peak_mem_gib"] = max((a["peak_mem_gib"] for a in answers if a["peak_mem_gib"] is not None), default=None)
    record["step_ms"] = answers[len(answers) // 2]["step_ms"] if answers else None  # per decode step, one answer
    record["one_off_steps"] = one_off_steps(record["step_ms"])
    record["rounds"] = len(answers)
    record["tpot_ms_rounds"] = [round(a["tpot_ms"], 4) for a in answers]
    record["tpot_vs_full_paired"] = None
    record["tpot_vs_plain_paired"] = None
    record["warmup_s"] = round(warmup_s, 2)
    return {key: record[key] for key in RECORD_KEYS}


def one_off_steps(step_ms: list[float] | None) -> list[list] | None:
    """``[decode step, ms]`` of the steps that took over 3x the median step: one-offs such as a CUDA graph recorded
    again (a new conversation's buffers at new addresses used to re-record the graphs of its first decode and fused
    steps)."""
    if not step_ms:
        return None
    limit = 3 * statistics.median(step_ms)
    return [[j + 1, ms] for j, ms in enumerate(step_ms) if ms > limit]


def paired_ratios(records: list[dict]) -> None:
    """``tpot_vs_full_paired`` (``tpot_vs_plain_paired``) of each interleaved record: the median over rounds of its
    TPOT / Full's (plain generate's) TPOT in the same round (a drift over the run moves both alike)."""
    for reference in ("full", "plain"):
        base = next((r for r in records if r["policy"] == reference), None)
        if base is None:
            continue
        for record in records:
            pairs = [a / b for a, b in zip(record["tpot_ms_rounds"], base["tpot_ms_rounds"]) if b]
            if pairs and len(record["tpot_ms_rounds"]) == len(base["tpot_ms_rounds"]):
                record[f"tpot_vs_{reference}_paired"] = round(statistics.median(pairs), 4)


# ---------------------------------------------------------------------------------------------------- profile
def profile_steps(bench: Bench, inputs, cache: str) -> str:
    """torch.profiler tables of decode step `guard` (decode only), step `guard + 2` (fused) and the second decode
    step after restoration finished (decode only, nothing pending) of Raincheck, and of Full's decode steps
    `guard` and the same late step (the same step kinds without a plan, for comparison)."""
    from torch.profiler import ProfilerActivity

    args = bench.args
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.cuda else [])
    profilers, walls = {}, {}
    raincheck = raincheck_policy(args, args.chunk_size)
    out, _, _, _ = bench.generate(inputs, raincheck, cache, stop_after=args.guard_tokens + 4)  # warm-up
    counts = carry_counts(raincheck.config, output_cache(out).turn_stats[-1].deferred, 8 * args.new_tokens)
    del out
    late = max((j for j, c in enumerate(counts, start=1) if c), default=args.guard_tokens) + 2
    runs = [(raincheck, {"decode-only": args.guard_tokens, "fused": args.guard_tokens + 2,
                         "decode-only after restoration": late}),
            (full_policy(args), {"Full decode": args.guard_tokens, "Full decode (late)": late})]
    for policy, steps in runs:
        hook = step_profiler(steps, activities, profilers, walls)
        if policy is not raincheck:
            bench.generate(inputs, policy, cache, stop_after=late + 2)  # warm-up
        bench.generate(inputs, policy, cache, stop_after=late + 2, hook=hook)
    sort_by = "device_time_total" if bench.cuda else "cpu_time_total"
    parts = []
    for name, prof in profilers.items():
        parts.append(f"## {name} step ({cache} cache): wall {1e3 * walls[name]:.2f} ms{kernel_busy(prof)}\n")
        parts.append(prof.key_averages().table(sort_by=sort_by, row_limit=args.profile_rows))
    return "\n".join(parts)


def step_profiler(steps: dict, activities, profilers: dict, walls: dict):
    """A `Timer` hook that profiles decode step ``steps[name]`` for every name: ``profilers[name]`` (a stopped
    torch.profiler) and ``walls[name]`` (its wall time, s). Decode step j runs between the puts of output tokens j and
    j + 1 (both after a sync)."""
    from torch.profiler import profile

    def hook(k):
        for name, step in steps.items():
            if k == step and step >= 1:
                profilers[name] = profile(activities=activities)
                profilers[name].start()
                walls[name] = time.perf_counter()
            elif k == step + 1 and name in profilers:
                walls[name] = time.perf_counter() - walls[name]
                profilers[name].stop()

    return hook


def profile_ttft(bench: Bench, inputs, cache: str) -> str:
    """torch.profiler tables of one first-token call (vision, selection and prefill) of Full, Hard and Raincheck:
    where a first turn's time goes, sorted by GPU time and by host time."""
    from torch.profiler import ProfilerActivity, profile

    args = bench.args
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.cuda else [])
    policies = first_turn_policies(args)
    parts = []
    for policy in policies:
        bench.generate(inputs, policy, cache, stop_after=1)  # warm-up (compilation, autotuning)
        with profile(activities=activities) as prof:
            _, _, start, end = bench.generate(inputs, policy, cache, stop_after=1)
        parts.append(profile_tables(prof, f"first token, {policy.label} ({cache} cache): wall "
                                          f"{1e3 * (end - start):.2f} ms", args.profile_rows, bench.cuda))
    return "\n".join(parts)


def profile_tables(prof, header: str, rows: int, cuda: bool) -> str:
    """``## header`` (with the GPU kernels' busy time) and the profile's operator tables: by GPU time (with CUDA),
    then by host time, `rows` rows each."""
    averages = prof.key_averages()
    tables = [averages.table(sort_by="device_time_total", row_limit=rows)] if cuda else []
    tables.append(averages.table(sort_by="self_cpu_time_total", row_limit=rows))
    return "\n".join([f"## {header}{kernel_busy(prof)}\n", *tables])


def ttft_phases(bench: Bench, inputs, cache: str, calls: int) -> list[dict]:
    """`calls` first-token calls of Full, Hard and Raincheck in turn (after one warm-up each), every call's time
    split by phase: each phase's function wrapped with a device sync before and after (so the phases add up to
    about the call, a little slower than unwrapped). The order rotates from call to call, so that no policy always
    runs right after the same one (with a fixed order, Raincheck's calls, each right after Full's long prefill, had
    a vision phase ~2 ms longer than Hard's and Full's in all seven calls kept of a ten-call run on the H200).
    Where a first turn's time goes, call by call: a phase that varies between calls shows here, where one profiled
    call cannot."""
    from hf_raincheck.cache.deferred_cache import DeferredPrefillCache
    from hf_raincheck.generation import enable as enable_module
    from hf_raincheck.generation import turn as turn_module
    from hf_raincheck.generation.decode import StaticStep

    adapter = getattr(bench.model, "_raincheck_state").adapter
    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            bench.sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                bench.sync()
                spent[name] = spent.get(name, 0.0) + 1e3 * (time.perf_counter() - t0)
        return wrapper

    # (phase, where the caller looks the function up, its name there)
    targets = [("prepare_turn", enable_module, "prepare_turn"), ("vision", adapter, "vision_features"),
               ("selection", turn_module, "select_kept"), ("prefill forward", enable_module, "run_rows"),
               ("reserve", DeferredPrefillCache, "reserve"), ("persist GDN", DeferredPrefillCache, "persist_gdn_states"),
               ("static prepare", StaticStep, "prepare")]
    saved = []
    for name, where, attr in targets:
        own = attr in vars(where)  # False: an instance's method from its class (restored by deleting)
        original = vars(where)[attr] if own else getattr(where, attr)
        static = isinstance(original, staticmethod)
        wrapped = timed(name, original.__func__ if static else original)
        setattr(where, attr, staticmethod(wrapped) if static else wrapped)
        saved.append((where, attr, original if own else None))
    rows = []
    try:
        policies = first_turn_policies(bench.args)
        for policy in policies:
            bench.generate(inputs, policy, cache, stop_after=1)  # warm-up
        for k in range(calls):
            shift = k % len(policies)  # the order rotating per call: no policy always follows the same one
            for policy in policies[shift:] + policies[:shift]:
                spent.clear()
                before = cuda_segments(bench)
                ttft = ttft_run(bench, inputs, policy, cache)
                after = cuda_segments(bench)
                phases = {name: round(ms, 2) for name, ms in spent.items()}
                known = sum(ms for name, ms in spent.items() if name not in ("vision", "selection"))
                rows.append(dict(policy=policy.label, cache=cache, call=k, ttft_ms=round(ttft, 2),
                                 other_ms=round(ttft - known, 2), **phases,
                                 cuda_mallocs=None if before is None else after - before))
    finally:
        for where, attr, original in reversed(saved):
            if original is None:
                delattr(where, attr)
            else:
                setattr(where, attr, original)
    return rows


def cuda_segments(bench: Bench) -> int | None:
    """Segments the CUDA caching allocator has taken from the driver so far (each a ``cudaMalloc``; None on the
    CPU): a call that allocates new ones pays for them (and its memory did not fit the cached blocks)."""
    if not bench.cuda:
        return None
    return sum(torch.cuda.memory_stats(device).get("segment.all.allocated", 0) for device in bench.devices)


def ttft_phase_table(rows: list[dict]) -> str:
    names = [n for n in ("prepare_turn", "vision", "selection", "prefill forward", "reserve", "persist GDN",
                         "static prepare") if any(n in r for r in rows)]
    lines = ["| policy | cache | call | TTFT ms | " + " | ".join(names) + " | other | cudaMallocs |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['cache']} | {r['call']} | {r['ttft_ms']:.1f} | "
                     + " | ".join(fmt(r.get(n)) for n in names) + f" | {r['other_ms']:.1f} | "
                     + ("-" if r["cuda_mallocs"] is None else str(r["cuda_mallocs"])) + " |")
    return "\n".join(lines)


def ttft_phase_summary(rows: list[dict]) -> list[dict]:
    """Per cache: each policy's median first token and median phases over its calls, and Raincheck's first token
    over Hard's and Full's call by call (call k of each: the policies ran in turn, so a slow stretch of the machine
    hits neighbouring calls): the median of those paired ratios and their range."""
    summary = []
    for cache in dict.fromkeys(r["cache"] for r in rows):
        mine = [r for r in rows if r["cache"] == cache]
        calls = {(r["policy"], r["call"]): r["ttft_ms"] for r in mine}
        raincheck = next((p for p in dict.fromkeys(r["policy"] for r in mine) if p.startswith("raincheck")), None)
        for policy in dict.fromkeys(r["policy"] for r in mine):
            own = [r for r in mine if r["policy"] == policy]
            entry = dict(cache=cache, policy=policy, calls=len(own),
                         ttft_ms=round(statistics.median(r["ttft_ms"] for r in own), 2))
            for name in ("prefill forward", "persist GDN"):
                if any(name in r for r in own):
                    entry[name] = round(statistics.median(r.get(name, 0.0) for r in own), 2)
            if raincheck is not None and policy == raincheck:
                for other in ("hard", "full"):
                    ratios = [calls[(policy, r["call"])] / calls[(other, r["call"])] for r in own
                              if (other, r["call"]) in calls]
                    if ratios:
                        entry[f"paired_vs_{other}"] = round(statistics.median(ratios), 4)
                        entry[f"paired_vs_{other}_range"] = [round(min(ratios), 4), round(max(ratios), 4)]
            summary.append(entry)
    return summary


def ttft_phase_summary_lines(summary: list[dict]) -> str:
    lines = []
    for e in summary:
        text = f"  {e['cache']:7s} {e['policy']:16s} median TTFT {e['ttft_ms']:7.1f} ms of {e['calls']} calls"
        if "prefill forward" in e:
            text += f", prefill forward {e['prefill forward']:.1f} ms"
        for other in ("hard", "full"):
            if f"paired_vs_{other}" in e:
                low, high = e[f"paired_vs_{other}_range"]
                text += f"; / {other}, call by call: {e[f'paired_vs_{other}']:.3f} (median; {low:.3f}-{high:.3f})"
        lines.append(text)
    return "\n".join(lines)


def kernel_busy(prof) -> str:
    """', GPU kernels busy X ms' (host-bound when far below the wall time), or '' without CUDA events."""
    try:
        busy = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # noqa: BLE001  (profiler internals differ between versions; the table still comes)
        return ""
    return (f", GPU kernels busy {busy / 1e3:.2f} ms" if busy else "") + copies(prof)


def copy_counts(prof) -> dict[str, int]:
    """The profiled step's memory-copy operations by kind, as the profiler names them (``Memcpy PtoP (Device ->
    Device)``: between GPUs; ``Memcpy DtoD ...``, ``Memcpy HtoD ...``)."""
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("Memcpy"):
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def copies(prof) -> str:
    """', copies: N Memcpy PtoP, ...' (`copy_counts`, short names), or '' when there are none."""
    counts = copy_counts(prof)
    return (", copies: " + ", ".join(f"{n} {k.split(' (')[0]}" for k, n in sorted(counts.items()))) if counts else ""


# ---------------------------------------------------------------------------------------------------- reporting
def group_key(record: dict) -> tuple:
    return record["model"], gpus_of(record), record["workload"], record["cache"]


def gpus_of(record: dict) -> int:
    """GPUs the model was split over (records written before the option existed ran on one)."""
    return record.get("gpus") or 1


LABELS = ("plain", "full", "hard", "raincheck", "raincheck unfused")


def label_of(record: dict) -> str:
    if record["policy"] != "raincheck":
        return record["policy"]
    return "raincheck" if record["fused"] else "raincheck unfused"


def find(records, model, workload, cache, policy, chunk_size=None, fused=None, gpus=1) -> dict | None:
    for r in records:
        if (r["model"], gpus_of(r), r["workload"], r["cache"], r["policy"]) == (model, gpus, workload, cache,
                                                                                 policy) and (
            chunk_size is None or (r["chunk_size"] == chunk_size and r["fused"] == fused)
        ):
            return r
    return None


def ratio(a, b):
    return a / b if a is not None and b else None


def check_targets(records: list[dict], chunk_size: int | str) -> list[dict]:
    """The issue's targets per (model, workload, cache), each against Full (or Hard) on the same cache kind; the
    Raincheck run checked is the one of `chunk_size` (``"auto"``: each model's default)."""
    checks = []
    for model, gpus, workload, cache in sorted({group_key(r) for r in records}):
        rc = find(records, model, workload, cache, "raincheck", default_chunk_size(model, chunk_size), True, gpus)
        if rc is None:
            continue
        full = find(records, model, workload, cache, "full", gpus=gpus)
        hard = find(records, model, workload, cache, "hard", gpus=gpus)
        tpot_limit, step_limit = STEP_LIMITS[(SHAPES[model]["family"], cache)]
        candidates = [(f"TPOT <= {tpot_limit} x full", ratio(rc["tpot_ms"], full and full["tpot_ms"]), tpot_limit),
                      (f"TPOT <= {tpot_limit} x full (median of paired rounds)", rc.get("tpot_vs_full_paired"),
                       tpot_limit),
                      (f"restore step <= {step_limit} x decode step",
                       ratio(rc["restore_step_ms"], rc["decode_step_ms"]), step_limit)]
        if workload == TARGET_WORKLOAD:
            candidates = [("TTFT <= 1.03 x hard", ratio(rc["ttft_ms"], hard and hard["ttft_ms"]), 1.03),
                          ("TTFT <= 0.80 x full", ratio(rc["ttft_ms"], full and full["ttft_ms"]), 0.80)] + candidates
        for target, value, limit in candidates:
            if value is not None:
                checks.append(dict(model=model, gpus=gpus, workload=workload, cache=cache, target=target,
                                   value=round(value, 4), limit=limit, met=value <= limit))
    return checks


def fmt(value, digits=1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown_tables(records: list[dict], checks: list[dict]) -> str:
    order = {label: i for i, label in enumerate(LABELS)}
    records = sorted(records, key=lambda r: (group_key(r), order[label_of(r)], r["chunk_size"] or 0))
    lines = ["| model | GPUs | workload | cache | policy | chunk | fused | TTFT ms | TPOT ms | restore step ms | "
             "decode step ms | E2E ms | restored at | peak GiB | TTFT / full | TPOT / full | TPOT / full, paired | "
             "TTFT / plain | TPOT / plain | TPOT / plain, paired |",
             "| " + " | ".join(["---"] * 20) + " |"]
    for r in records:
        full = find(records, r["model"], r["workload"], r["cache"], "full", gpus=gpus_of(r))
        plain = find(records, r["model"], r["workload"], r["cache"], "plain", gpus=gpus_of(r))
        lines.append("| " + " | ".join([
            r["model"], str(gpus_of(r)), r["workload"], r["cache"], r["policy"], fmt(r["chunk_size"], 0),
            "" if r["fused"] is None else str(r["fused"]), fmt(r["ttft_ms"]), fmt(r["tpot_ms"], 2),
            fmt(r["restore_step_ms"], 2), fmt(r["decode_step_ms"], 2), fmt(r["e2e_ms"], 0),
            fmt(r["restored_at_token"], 0), fmt(r["peak_mem_gib"], 2),
            fmt(ratio(r["ttft_ms"], full and full["ttft_ms"]), 3),
            fmt(ratio(r["tpot_ms"], full and full["tpot_ms"]), 3), fmt(r.get("tpot_vs_full_paired"), 3),
            fmt(ratio(r["ttft_ms"], plain and plain["ttft_ms"]), 3),
            fmt(ratio(r["tpot_ms"], plain and plain["tpot_ms"]), 3), fmt(r.get("tpot_vs_plain_paired"), 3)]) + " |")
    lines += ["", "| model | GPUs | workload | cache | target | value | met |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in checks:
        lines.append(f"| {c['model']} | {c.get('gpus') or 1} | {c['workload']} | {c['cache']} | {c['target']} | "
                     f"{c['value']:.3f} | "
                     f"{'met' if c['met'] else '**missed**'} |")
    return "\n".join(lines)


def plot(records: list[dict], chunk_size: int | str, path: str) -> None:
    """TTFT and TPOT bars per policy per workload; one row per model, two panels per cache kind."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.patches  # noqa: F401 - matplotlib.patches.Patch below
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no plot")
        return
    main = [r for r in records
            if r["policy"] != "raincheck" or r["chunk_size"] == default_chunk_size(r["model"], chunk_size)]
    models = list(dict.fromkeys((r["model"], gpus_of(r)) for r in main))
    caches = list(dict.fromkeys(r["cache"] for r in main))
    fig, axes = plt.subplots(len(models), 2 * len(caches), figsize=(6 * len(caches) * 2, 3.6 * len(models)),
                             squeeze=False)
    for row, (model, gpus) in enumerate(models):
        for col, (cache, metric) in enumerate((c, m) for c in caches for m in ("ttft_ms", "tpot_ms")):
            bar_panel(axes[row][col], [r for r in main if (r["model"], gpus_of(r), r["cache"]) == (model, gpus, cache)],
                      metric)
            where = f"{model} on {gpus} GPUs" if gpus > 1 else model
            axes[row][col].set_title(f"{where}, {cache} cache: {metric[:4].upper()} (ms)", fontsize=9)
    labels = [label for label in LABELS if any(label_of(r) == label for r in main)]
    handles = [matplotlib.patches.Patch(color=label_color(label), label=label) for label in labels]
    fig.legend(handles=handles, loc="upper center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def label_color(label: str) -> str:
    """One colour per policy label in every panel (the figure has one legend)."""
    return f"C{LABELS.index(label) % 10}"


def bar_panel(ax, records: list[dict], metric: str) -> None:
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    labels = [label for label in LABELS if any(label_of(r) == label for r in records)]
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        xs, ys = [], []
        for w, workload in enumerate(workloads):
            match = [r for r in records if r["workload"] == workload and label_of(r) == label]
            if match and match[0][metric] is not None:
                xs.append(w + i * width)
                ys.append(match[0][metric])
        ax.bar(xs, ys, width, label=label, color=label_color(label))
    ax.set_xticks([w + 0.4 - width / 2 for w in range(len(workloads))], workloads, fontsize=8)


# ---------------------------------------------------------------------------------------------------- output
def header(args, cuda: bool, workloads: dict) -> dict:
    return dict(
        torch=torch.__version__, transformers=transformers.__version__, hf_raincheck=hf_raincheck.__version__,
        gpu=torch.cuda.get_device_name() if cuda else None, cpu=platform.processor() or platform.machine(),
        gpu_count=torch.cuda.device_count() if cuda else 0, placements=args.gpus,
        device=args.device, dtype="bfloat16" if cuda else "float32",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join(sys.argv), quick=args.quick,
        settings=dict(new_tokens=args.new_tokens, repeats=args.repeats, ttft_repeats=args.ttft_repeats,
                      interleave=args.interleave,
                      retention=args.retention, chunk_size=args.chunk_size, guard_tokens=args.guard_tokens,
                      pruning=args.pruning, completion="blocking", static_max_cache_len=args.max_cache_len,
                      budget_s=args.budget_s, attn_backend=args.attn_backend, gdn_backend=args.gdn_backend,
                      env={k: v for k, v in os.environ.items() if k.startswith("HF_RAINCHECK_")}),
        workloads={name: dict(visual_tokens=workloads[name].visual_tokens, prompt_tokens=workloads[name].prompt_tokens,
                              spans=workloads[name].spans)
                   for name in dict.fromkeys(w for w, _, _ in run_plan(args))},
    )


def record_key(record: dict) -> tuple:
    return (*(record[k] for k in ("model", "workload", "policy", "chunk_size", "fused", "cache")), gpus_of(record))


def merge_into(previous: list[dict], records: list[dict]) -> list[dict]:
    """The records of `previous` that `records` does not measure again, then `records`."""
    new = {record_key(r) for r in records}
    return [r for r in previous if record_key(r) not in new] + records


def load_report(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def write_json(path: str, head: dict, records: list[dict], skipped: list, errors: list) -> None:
    report = dict(header=dict(head, skipped=skipped, errors=errors), records=records,
                  targets=check_targets(records, head["settings"]["chunk_size"]))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------- driver
class Budget:
    """Wall-clock budget, shared fairly between models; per-kind estimates of a run's duration."""

    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + seconds
        self.model_deadline = self.deadline
        self.estimates: dict = {}

    def start_model(self, models_left: int) -> None:
        now = time.perf_counter()
        self.model_deadline = now + max(self.deadline - now, 0.0) / models_left

    @staticmethod
    def kind(policy: Policy, cache: str, cuda: bool) -> tuple:
        """Every policy compiles its steps on a static cache on CUDA (plain generate transformers' decode step,
        the others Raincheck's steps)."""
        compiled = cuda and cache == "static"
        return policy.name, policy.fused, cache, "compiled" if compiled else "eager"

    def fits(self, kind: tuple) -> bool:
        guess = self.estimates.get(kind, FIRST_RUN_GUESS_S[kind[-1]])
        return time.perf_counter() + guess <= self.model_deadline

    def record(self, kind: tuple, seconds: float, warmup_s: float) -> None:
        """The next run of this kind: as long; an eager warm-up capped at 10 s (nothing to compile again), a
        compiled one kept whole (the next run of a kind is another workload or chunk size, whose new shapes
        compile again, about as long as the first)."""
        warm = warmup_s if kind[-1] == "compiled" else min(warmup_s, 10.0)
        self.estimates[kind] = 1.1 * (seconds - warmup_s) + warm + 2.0


class Results:
    """What the run produced so far; with ``--save`` the JSON is rewritten after every record."""

    def __init__(self, args, head: dict):
        self.args, self.head = args, head
        self.records, self.skipped, self.errors, self.profile = [], [], [], None
        self.path = os.path.join(args.results_dir, "latency.json")
        previous = load_report(self.path) if args.save and args.merge else {}
        self.previous = previous.get("records", [])
        if previous:  # the header describes this call; earlier calls' workloads and commands stay listed
            old = previous["header"]
            head["workloads"] = {**old.get("workloads", {}), **head["workloads"]}
            head["earlier_calls"] = old.get("earlier_calls", []) + [dict(date=old.get("date"), command=old.get("command"))]

    def all_records(self) -> list[dict]:
        return merge_into(self.previous, self.records)

    def save(self) -> None:
        if self.args.save:
            write_json(self.path, self.head, self.all_records(), self.skipped, self.errors)


def compiled_graphs() -> int:
    """Graphs torch.compile produced for the current model (0: nothing ran compiled)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def release_model_memory(cuda: bool) -> None:
    """After a model's runs (its objects already deleted): the collector sees them again and frees them, the finished
    conversations' static buffers kept for the model's next one are released, compiled graphs dropped."""
    gc.unfreeze()
    gc.collect()
    release_static_buffers()
    torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()


def set_compile_limits() -> None:
    """Room for one decode graph per shape and cache kind (and Raincheck's own graphs) without falling back."""
    config = torch._dynamo.config
    for name, value in (("recompile_limit", 64), ("cache_size_limit", 64),
                        ("accumulated_recompile_limit", 1024), ("accumulated_cache_size_limit", 1024)):
        if hasattr(config, name):
            setattr(config, name, value)


def rewarm_after_later_graphs(bench: Bench, inputs, cache: str, ready: list[dict], failed) -> None:
    """One more warm-up answer for each policy warmed up before a later policy's warm-up compiled a graph. A chunk
    sweep's second chunk size recompiles the fused step with the chunk dynamic (transformers' ``CompileConfig``
    leaves ``dynamic=None``: automatic dynamic shapes), and dynamo then serves every chunk size from that graph,
    whose CUDA graph for the default chunk is warmed up and recorded at its first fused step: without this, in the
    first measured answer (~80 ms on a Qwen3.5-9B step)."""
    latest = max((entry["graphs"] for entry in ready), default=0)
    for entry in ready:
        if entry["graphs"] < latest and not entry["failed"]:
            t0 = time.perf_counter()
            try:
                bench.generate(inputs, entry["policy"], cache)
                print(f"  warmed up again after later compiles: {entry['policy'].label}", flush=True)
            except Exception as error:  # noqa: BLE001
                entry["failed"] = True
                failed(entry["policy"], error)
            entry["warmup_s"] += time.perf_counter() - t0
            entry["seconds"] += time.perf_counter() - t0


def run_policies(bench: Bench, inputs: dict, workload: str, cache: str, policies: list[Policy], budget: Budget,
                 results: Results) -> None:
    """Records of `policies` on one (workload, cache): each warms up (compiles, records its graphs, TTFT calls),
    then their ``--repeats`` answer runs alternate round by round (the order rotating each round; one policy: its
    answers in a row), so that with ``--interleave`` (all of a workload's policies at once) a drift over the call
    (clocks, host load) moves every policy alike; records carry per-round TPOTs and the median paired ratio to
    Full. A policy whose estimated run does not fit the budget is skipped; one that fails loses only itself."""
    def failed(policy: Policy, error: Exception) -> None:  # one failing run must not lose the others
        results.errors.append(dict(model=bench.name, workload=workload, cache=cache, policy=policy.label,
                                   error=f"{type(error).__name__}: {error}"))
        print(f"  FAILED {workload} {cache} {policy.label}: {type(error).__name__}: {error}", flush=True)
        traceback.print_exc(limit=3)
        if bench.cuda:
            torch.cuda.empty_cache()

    ready = []
    for policy in policies:
        kind = budget.kind(policy, cache, bench.cuda)
        if not budget.fits(kind):  # the whole run of this policy: its warm-up now, its answers over the rounds
            results.skipped.append(dict(model=bench.name, workload=workload, cache=cache, policy=policy.label))
            print(f"  skipped (time budget): {workload} {cache} {policy.label}", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            ttfts, warmup_s = warm_up(bench, inputs[workload], policy, cache)
        except Exception as error:  # noqa: BLE001
            failed(policy, error)
            continue
        ready.append(dict(policy=policy, kind=kind, ttfts=ttfts, warmup_s=warmup_s,
                          seconds=time.perf_counter() - t0, answers=[], failed=False, graphs=compiled_graphs()))
    rewarm_after_later_graphs(bench, inputs[workload], cache, ready, failed)
    for round_index in range(bench.args.repeats):
        shift = round_index % max(len(ready), 1)
        for entry in ready[shift:] + ready[:shift]:
            if entry["failed"]:
                continue
            t0 = time.perf_counter()
            try:
                entry["answers"].append(answer_run(bench, inputs[workload], entry["policy"], cache))
            except Exception as error:  # noqa: BLE001
                entry["failed"] = True
                failed(entry["policy"], error)
            entry["seconds"] += time.perf_counter() - t0
    done = [entry for entry in ready if not entry["failed"] and entry["answers"]]
    records = [make_record(bench, workload, e["policy"], cache, e["ttfts"], e["answers"], e["warmup_s"])
               for e in done]
    paired_ratios(records)
    for record, entry in zip(records, done):
        budget.record(entry["kind"], entry["seconds"], entry["warmup_s"])
        results.records.append(record)
        paired = record["tpot_vs_full_paired"]
        offs = [one_off_steps(answer["step_ms"]) for answer in entry["answers"]]
        off_note = next((f", one-off steps in {sum(map(bool, offs))} of {len(offs)} answers (first: {o})"
                         for o in offs if o), "")
        print(f"  {workload:9s} {cache:7s} {entry['policy'].label:22s} TTFT {record['ttft_ms']:8.1f} ms  "
              f"TPOT {record['tpot_ms']:7.2f} ms  ({entry['seconds']:.0f} s, warm-up {entry['warmup_s']:.0f} s, "
              f"compiled graphs {compiled_graphs()}" + (f", {record['rounds']} rounds" if record["rounds"] > 1 else "")
              + ("" if paired is None or len(done) == 1 else f", paired TPOT / full {paired:.3f}") + off_note + ")",
              flush=True)
    results.save()


def placement_devices(args, gpus: int) -> list[str]:
    """The devices a model is split over: ``cuda:0 .. cuda:{gpus-1}`` (one GPU: ``--device`` as given); on the CPU
    ``cpu`` repeated, which still dispatches through accelerate's hooks (a smoke run of the multi-GPU path)."""
    if gpus == 1:
        return [args.device]
    if args.device.startswith("cuda"):
        return [f"cuda:{i}" for i in range(gpus)]
    return [args.device] * gpus


def run_model(model_name: str, gpus: int, args, workloads: dict, budget: Budget, results: Results,
              cuda: bool) -> None:
    """Builds one model (split over `gpus` GPUs with an accelerate device_map when > 1) and runs its plan (the
    profile first, on the first model)."""
    started = time.perf_counter()
    args = argparse.Namespace(**dict(vars(args), chunk_size=default_chunk_size(model_name, args.chunk_size)))
    dtype = torch.bfloat16 if cuda else torch.float32
    devices = placement_devices(args, gpus)
    model = build_model(model_name, devices[0], dtype)
    if gpus > 1:
        model = dispatch(model, devices)
    bench = Bench(enable_raincheck(model), model_name, args, cuda, devices)
    del model
    torch._dynamo.utils.counters.clear()
    gc.collect()
    gc.freeze()  # the model's objects leave the collector's view: a collection before each timed call is ~free
    where = f" on {gpus} GPUs ({', '.join(devices)})" if gpus > 1 else ""
    print(f"\n== {model_name}{where}: built in {time.perf_counter() - started:.1f} s", flush=True)
    plan = run_plan(args)
    inputs = {name: workloads[name].inputs(devices[0], dtype) for name in dict.fromkeys(w for w, _, _ in plan)}
    if args.ttft_phases and model_name == args.models[0]:
        rows = [r for cache in args.caches for r in ttft_phases(bench, inputs[args.workloads[0]], cache, args.ttft_phases)]
        table = ttft_phase_table(rows)
        summary = ttft_phase_summary(rows)
        print(f"\n# {model_name}, {args.workloads[0]}: first-token calls by phase (ms, synced)\n{table}\n\n"
              f"{ttft_phase_summary_lines(summary)}\n", flush=True)
        results.head.setdefault("ttft_phases", {})[model_name] = rows
        results.head.setdefault("ttft_phases_summary", {})[model_name] = summary
    if (args.profile or args.profile_ttft) and model_name == args.models[0]:
        first = args.workloads[0]
        try:
            text = "\n".join(profile_steps(bench, inputs[first], cache) for cache in args.caches) if args.profile else ""
            if args.profile_ttft:
                text += "\n".join(profile_ttft(bench, inputs[first], cache) for cache in args.caches)
        except Exception as error:  # noqa: BLE001
            text = f"profile failed: {type(error).__name__}: {error}"
            print(f"  {text}")
        results.profile = (results.profile or "") + (
            f"# {model_name}{where}, {first}, Raincheck chunk {args.chunk_size}\n\n" + text + "\n\n")
    groups: dict = {}  # --interleave: a workload's policies together; else each run on its own
    for k, (workload, cache, policy) in enumerate(plan):
        groups.setdefault((workload, cache) if args.interleave else k, (workload, cache, []))[2].append(policy)
    for workload, cache, policies in groups.values():
        run_policies(bench, inputs, workload, cache, policies, budget, results)
    results.head.setdefault("compiled_graphs", {})[model_name] = compiled_graphs()
    del bench, inputs
    release_model_memory(cuda)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU, seconds (smoke run)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--models", default=None, help=f"comma list of {sorted(SHAPES)} (default: the two 8B-class)")
    parser.add_argument("--workloads", default="image4096,image1024,video16",
                        help="comma list of image1024, image4096, video16 (priority order)")
    parser.add_argument("--caches", default="dynamic,static", help="comma list of dynamic, static")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES),
                        help=f"comma list of {', '.join(POLICY_NAMES)} (unfused: the fused=False control)")
    parser.add_argument("--gpus", default="1",
                        help="comma list of GPU counts to split each model over with an accelerate device_map "
                             "(e.g. 1,2: the one-GPU run, then the same model split over cuda:0 and cuda:1)")
    parser.add_argument("--chunk-sweep", default=None,
                        help="Raincheck chunk sizes on --sweep-workload (7,15,31,63; --quick 15,31; '' off)")
    parser.add_argument("--sweep-workload", default="image4096")
    parser.add_argument("--repeats", type=int, default=1, help="forced answers per run (each a mean over its steps)")
    parser.add_argument("--interleave", action="store_true",
                        help="per workload and cache: warm every policy up, then alternate their --repeats answer "
                             "runs round by round; records add per-round TPOTs and the median paired TPOT / Full")
    parser.add_argument("--ttft-repeats", type=int, default=None, help="extra first-token-only calls (4; --quick 1)")
    parser.add_argument("--new-tokens", type=int, default=None, help="forced answer length (256; --quick 24)")
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--chunk-size", type=parse_chunk_size, default="auto",
                        help="Raincheck's chunk size (default auto: the package's, 31; 63 for qwen3.5)")
    parser.add_argument("--guard-tokens", type=int, default=16)
    parser.add_argument("--attn-backend", default="auto", choices=("auto", "sdpa", "eager", "flash"),
                        help="RaincheckConfig.attn_backend of the Full / Hard / Raincheck runs")
    parser.add_argument("--gdn-backend", default="auto", choices=("auto", "torch", "fla"),
                        help="RaincheckConfig.gdn_backend of Qwen3.5 runs (auto: fla-core on CUDA when installed)")
    parser.add_argument("--pruning", default="uniform", help="selector of hard and raincheck")
    parser.add_argument("--budget-s", type=float, default=400.0,
                        help="wall-clock budget of the runs (s): what does not fit is skipped")
    parser.add_argument("--profile", action="store_true", help="torch.profiler tables of one fused step")
    parser.add_argument("--profile-ttft", action="store_true",
                        help="torch.profiler tables of one first-token call of Full, Hard and Raincheck")
    parser.add_argument("--ttft-phases", type=int, default=0, metavar="CALLS",
                        help="CALLS first-token calls of Full, Hard and Raincheck, each split by phase (vision, "
                             "selection, prefill forward, ...; synced), printed and saved in the header")
    parser.add_argument("--profile-rows", type=int, default=30)
    parser.add_argument("--save", action="store_true", help="write latency.json and latency.png to --results-dir")
    parser.add_argument("--merge", action="store_true", help="with --save: keep the existing file's other records")
    parser.add_argument("--results-dir", default=RESULTS_DIR)
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    args.models = (args.models or ("tiny,tiny-qwen3.5" if args.quick else "qwen3-vl-8b,qwen3.5-9b")).split(",")
    args.new_tokens = args.new_tokens or (24 if args.quick else 256)
    args.ttft_repeats = args.ttft_repeats if args.ttft_repeats is not None else (1 if args.quick else 4)
    if args.chunk_sweep is None:
        args.chunk_sweep = "15,31" if args.quick else "7,15,31,63"
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.policies = [p for p in args.policies.split(",") if p]
    args.caches = [c for c in args.caches.split(",") if c]
    args.chunk_sweep = [int(c) for c in args.chunk_sweep.split(",") if c]
    try:
        args.gpus = [int(g) for g in args.gpus.split(",") if g]
    except ValueError:
        parser.error(f"--gpus: a comma list of GPU counts (e.g. 1,2), got {args.gpus!r}")
    available = torch.cuda.device_count() if args.device.startswith("cuda") else None
    if not args.gpus or any(g < 1 or (available is not None and g > available) for g in args.gpus):
        parser.error(f"--gpus: counts from 1 to {available if available is not None else 'any (CPU: cpu repeated)'}"
                     f", got {args.gpus}")
    for name, values, allowed in (("models", args.models, SHAPES), ("workloads", args.workloads, WORKLOADS),
                                  ("caches", args.caches, ("dynamic", "static")),
                                  ("policies", args.policies, POLICY_NAMES),
                                  ("sweep-workload", [args.sweep_workload], WORKLOADS)):
        unknown = [v for v in values if v not in allowed]
        if unknown:
            parser.error(f"--{name}: unknown {unknown}; choose from {sorted(allowed)}")
    if args.new_tokens < args.guard_tokens + 4:
        parser.error(f"--new-tokens must be at least guard + 4 = {args.guard_tokens + 4}")
    return args


def report(args, results: Results) -> None:
    """The Markdown tables, what was skipped or failed, and the files."""
    records = results.records
    print(f"\n{args.new_tokens} forced tokens, retention {args.retention}, guard {args.guard_tokens}, selector "
          f"{args.pruning}; median of {args.repeats} answer(s) (TTFT: of {args.repeats + args.ttft_repeats} calls); "
          f"{results.head['elapsed_s']:.0f} s\n")
    print(markdown_tables(records, check_targets(records, args.chunk_size)))
    if results.skipped:
        print(f"\nskipped for the time budget ({len(results.skipped)}): "
              + "; ".join(f"{s['model']} {s['workload']} {s['cache']} {s['policy']}" for s in results.skipped))
    if results.errors:
        print(f"\nfailed ({len(results.errors)}): " + "; ".join(
            f"{e['model']} {e['workload']} {e['cache']} {e['policy']}: {e['error']}" for e in results.errors))
    if results.profile:
        path = os.path.join(args.results_dir, "latency_profile.txt")
        with open(path, "w") as f:
            f.write(results.profile)
        print(f"\nwrote {path}")
    if args.save:
        results.save()
        print(f"wrote {results.path}")
        plot(results.all_records(), args.chunk_size, os.path.join(args.results_dir, "latency.png"))


def main(argv=None):
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.quick:
        torch.set_num_threads(1)  # tiny matmuls: more threads only fight over a shared CPU
    workloads = QUICK_WORKLOADS if args.quick else WORKLOADS
    # plain generate's static cache gets one size for every workload: one compiled decode graph per model
    args.max_cache_len = max(workloads[w].prompt_tokens for w, _, _ in run_plan(args)) + args.new_tokens
    set_compile_limits()
    os.makedirs(args.results_dir, exist_ok=True)
    results = Results(args, header(args, cuda, workloads))
    budget = Budget(args.budget_s)
    started = time.perf_counter()
    runs = [(model_name, gpus) for model_name in args.models for gpus in args.gpus]
    for i, (model_name, gpus) in enumerate(runs):
        budget.start_model(len(runs) - i)
        run_model(model_name, gpus, args, workloads, budget, results, cuda)
    results.head["elapsed_s"] = round(time.perf_counter() - started, 1)
    report(args, results)
    return 1 if results.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
