"""Batches (issue 28): Full, Hard, Raincheck and plain transformers ``generate`` on the same left-padded batch.

    python benchmarks/batch.py --device cuda --save --budget-s 400     # Qwen3-VL-8B, B = 1 4 8 16, eager (dynamic)
    python benchmarks/batch.py --device cuda --save --models qwen3.5-9b --batch-sizes 1 4 --rounds 1
    python benchmarks/batch.py --device cuda --save --cache static --batch-sizes 1 4   # compiled steps
    python benchmarks/batch.py --quick                                 # tiny Qwen3-VL on the CPU, B = 1 3 (smoke run)

Random-weight models of the real shapes (``shapes.py``: Qwen3-VL-8B, Qwen3.5-9B), bf16 on CUDA. Per model and batch
size B (``--batch-sizes``, default 1 4 8 16) one left-padded batch of B rows, each its own conversation: ~40 text
tokens (the question's length differs from row to row, so the batch is padded) around one image of
``--image-tokens`` merged tokens (default 1024; a comma list is cycled over the rows: mixed sizes), every row's
pixels and text drawn from its own seed (different images). Answers of ``--new-tokens`` (256) tokens are forced with
``min_new_tokens`` (no EOS). The methods run on that batch side by side:

* ``plain``: transformers' own batched ``generate`` (no ``raincheck_config``);
* ``full``, ``hard``: ``RaincheckConfig(policy="full")`` / ``policy="hard"`` (Hard: ``--retention``, ``--pruning``);
* ``raincheck``: the package's defaults (retention 0.3, ``chunk_size="auto"``: 31, or 63 for Qwen3.5; guard 16,
  the ``mmtok`` selector, ``step_deferred_budget="auto"``: 128, or 1024 for Qwen3.5; each overridable) except
  ``completion="blocking"``, so that a call's end includes every row's deferred tokens restored (as ``latency.py``).
  Full and Hard are blocking too (nothing to complete).

Cache kinds (``--cache``): ``dynamic`` (default; eager decode): batches run in the shared engine (every row in each
forward; Qwen3.5 too); ``static`` (``cache_implementation="static"``, compiled steps): batches run the shared engine
on a static batch cache with compiled decode / fused steps at batch B (``generation/shared_static.py``; Qwen3.5's
Gated DeltaNet layers too); ``--attn-backend flash`` runs the rows one after the other. Each record says how its rows
ran (``rows``: ``batched`` for plain generate, ``batch-1``, ``shared`` or ``one by one``; ``rows_why`` says why). Plain generate on a static cache gets one ``StaticCache`` per
batch size (emptied before each call, so its compiled decode step records one graph per B).

Measurements, per (model, B): every method first warms up (an answer of ``--warmup-tokens``: 48 on a dynamic
cache, where nothing compiles; the whole answer on a static one, which compiles and records every step kind) and
makes ``--ttft-repeats`` first-token calls; then ``--rounds`` paired rounds, each running every method's first-token
call and answer in turn (the order rotating from round to round), so that a drift over the run moves every method
alike. Timed calls start and end after ``torch.cuda.synchronize``; the garbage collector is off inside them.

* ``ttft_ms``: the batch's first token: a call that stops after one token (a stopping criterion, so the call keeps the
  answer's ``max_new_tokens`` and shapes; Raincheck methods with ``completion="next_turn"`` there, so nothing is
  completed after it), inputs already on the device (vision, selection and prefill of every row included); the
  median over the warm-up's and the rounds' calls. Rows run one by one: every row's prefill and first token, in turn;
* ``tpot_ms``: per output step after the first: a streamer that timestamps each step after a device sync (first to
  last token over ``new_tokens - 1`` steps; ``tpot_from: "streamer"``), or, where the rows run one by one (a
  streamer is refused there), ``(answer call - the round's first-token call) / (new_tokens - 1)``
  (``tpot_from: "e2e - ttft"``: a per-step figure of the whole batch, whose rows decoded in turn);
* ``tokens_per_s``: ``B x new_tokens / answer call`` (the whole call: blocking completion included);
* ``peak_mem_gib``: ``torch.cuda.max_memory_allocated`` over the answer call (statistics reset before it);
* Raincheck: ``restored_at_token`` (the output token produced by the step that carried the batch's last deferred
  chunk, replayed from the schedule and the step budget and checked against the rows' own counts:
  ``replay_matches``), the per-row deferred counts, and with a streamer the mean restoration / decode-only step;
* medians over the rounds; ratios RC / Full, RC / Hard and Full / plain: TPOT and tokens/s the median of the
  rounds' paired ratios, TTFT the ratio of the medians over every first-token call (both kinds kept in the JSON);
  the issue's targets (Raincheck TTFT <= 0.80 x Full for B >= 4; TPOT <= 1.05 x Full for B <= 8, <= 1.10 x above,
  which the issue sets for the compiled path; throughput >= 0.95 x Full's);
* ``--profile-steps``: after a batch size's rounds, one more answer of Raincheck and of Full with torch.profiler
  tables of decode step ``guard + 2`` (Raincheck's first fused step) and of the step two after Raincheck's
  restoration ended (decode only), written next to the JSON (``X_profile.txt``);
* ``--profile-ttft``: after a batch size's rounds, one more first-token call of every Raincheck, Hard and Full method
  under torch.profiler (after one unprofiled call), its tables in the same file: where a batch's first token goes.

Time budget (``--budget-s``): shared fairly between the models, then between each model's batch sizes; a batch size
whose estimated warm-ups and first round (from the previous batch size's calls) do not fit is skipped, later rounds
stop at the batch size's share; the JSON is rewritten after every batch size (``--save``: ``--results-dir``/batch.json,
or ``--out PATH``), so a run cut short keeps what it measured. A method that fails loses only its own record.
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from latency import (  # noqa: E402
    Timer, compiled_graphs, kernel_busy, no_gc, profile_tables, release_model_memory, set_compile_limits,
    step_profiler)
from shapes import SHAPES, build_inputs, build_model  # noqa: E402

import hf_raincheck  # noqa: E402
from hf_raincheck import FixedChunkSchedule, RaincheckConfig, enable_raincheck  # noqa: E402
from hf_raincheck.config import parse_chunk_size  # noqa: E402
from hf_raincheck.conversation import batch_inputs, cache_argument, output_cache  # noqa: E402
from hf_raincheck.generation.batch import shared_steps_supported  # noqa: E402
from hf_raincheck.generation.schedule import carried_tokens  # noqa: E402
from hf_raincheck.generation.shared_batch import carry_counts  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TEXT_BEFORE, QUESTION = 10, 30  # ~40 text tokens around the image; row i's question is 3 * (i % 4) tokens longer
PAD = 0  # shapes.build_model's pad_token_id
METHODS = ("raincheck", "full", "hard", "plain")  # --methods; the table's order is TABLE_ORDER
TABLE_ORDER = ("plain", "full", "hard", "raincheck")
PAIRS = (("raincheck", "full"), ("raincheck", "hard"), ("full", "plain"))
#: what ``--step-budget auto`` (the package default) resolves to (each record's ``step_budget``)
STEP_BUDGET_AUTO = (f" ({RaincheckConfig.STEP_BUDGET_ATTENTION}; {RaincheckConfig.STEP_BUDGET_GDN} for models with "
                    "Gated DeltaNet layers)")
CHUNK_AUTO = f" ({RaincheckConfig.CHUNK_ATTENTION}; {RaincheckConfig.CHUNK_GDN} for models with Gated DeltaNet layers)"

RECORD_KEYS = ("model", "cache", "batch_size", "method", "rows", "rows_why", "image_tokens", "prompt_tokens",
               "new_tokens",
               "ttft_ms", "ttft_ms_calls", "ttft_ms_rounds", "tpot_ms", "tpot_ms_rounds", "tpot_from",
               "tokens_per_s", "tokens_per_s_rounds", "e2e_ms", "e2e_ms_rounds", "peak_mem_gib", "rounds",
               "warmup_s", "answer_ttft_ms", "step_ms", "step_p50_ms", "restore_step_ms", "decode_step_ms", "restored_at_token",
               "deferred_per_row", "restored_during_decode", "pending_at_answer_end", "restored_after_answer",
               "replay_matches", "step_budget")


# ---------------------------------------------------------------------------------------------------- methods
@dataclasses.dataclass(frozen=True)
class Method:
    name: str  # plain | full | hard | raincheck
    config: RaincheckConfig | None  # None: transformers' own generate


def build_methods(args) -> list[Method]:
    """The methods of --methods, in its order (warm-ups and the first round run in this order)."""
    common = dict(completion="blocking", attn_backend=args.attn_backend, gdn_backend=args.gdn_backend)
    configs = {
        "raincheck": RaincheckConfig(retention=args.retention, chunk_size=args.chunk_size,
                                     guard_tokens=args.guard_tokens, pruning=args.pruning,
                                     step_deferred_budget=args.step_budget, **common),
        "full": RaincheckConfig(policy="full", **common),
        "hard": RaincheckConfig(policy="hard", retention=args.retention, pruning=args.pruning, **common),
        "plain": None,
    }
    methods = [Method(name, configs[name]) for name in args.methods]
    # --step-budget-sweep: Raincheck again at other step budgets, in the same rounds (paired with the others)
    methods += [Method(f"raincheck-b{budget}", dataclasses.replace(configs["raincheck"], step_deferred_budget=budget))
                for budget in args.step_budget_sweep]
    return methods


def sweep_name(name: str) -> bool:
    """A --step-budget-sweep method (``raincheck-b<N>``)."""
    return name.startswith("raincheck-b")


# ---------------------------------------------------------------------------------------------------- inputs
def row_image_tokens(args, batch_size: int) -> list[int]:
    return [args.image_tokens[i % len(args.image_tokens)] for i in range(batch_size)]


def make_batch(args, batch_size: int, device: str, dtype: torch.dtype) -> tuple[dict, list[int]]:
    """A left-padded batch of `batch_size` rows (row i: seed i, its own image and text) and each row's prompt
    length; laid out as the processor lays out a batch (``hf_raincheck.conversation.batch_inputs``)."""
    rows = [build_inputs(tokens, TEXT_BEFORE, QUESTION + 3 * (i % 4), device, dtype, seed=i)
            for i, tokens in enumerate(row_image_tokens(args, batch_size))]
    batch = dict(batch_inputs(rows, PAD))
    return batch, [int(r["input_ids"].shape[1]) for r in rows]


# ---------------------------------------------------------------------------------------------------- timing
class FirstToken(StoppingCriteria):
    """Stops every row after its first token (the call keeps the answer's ``max_new_tokens``, so its shapes)."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.ones((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)


class Bench:
    """One built model, the run's settings, and how to time calls on it."""

    def __init__(self, model, name: str, args, cuda: bool):
        self.model, self.name, self.args, self.cuda = model, name, args, cuda
        self.device = torch.device(args.device)
        self._static_caches: dict[int, StaticCache] = {}

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reset_peak_memory(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory_gib(self) -> float | None:
        """Peak allocated memory of the model's GPU (weights included); None on the CPU."""
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None

    def rows_why(self, method: Method, batch_size: int) -> str | None:
        """Why a Raincheck method runs the rows of a batch of `batch_size` one after the other (None: it does not),
        as the package decides it (`shared_steps_supported`)."""
        if method.config is None or batch_size == 1:
            return None
        state = self.model._raincheck_state
        cache_implementation = "static" if self.args.cache == "static" else None
        return shared_steps_supported(state, cache_implementation, state.backend(method.config), None)

    def rows(self, method: Method, batch_size: int) -> str:
        """How `method` runs a batch of `batch_size` rows: batched (transformers) / batch-1 / shared / one by one."""
        if method.config is None:
            return "batched"
        if batch_size == 1:
            return "batch-1"
        return "shared" if self.rows_why(method, batch_size) is None else "one by one"

    def streams(self, method: Method, batch_size: int) -> bool:
        """A streamer times every step (refused where a batch's rows run one after the other)."""
        return self.rows(method, batch_size) != "one by one"

    def static_cache(self, batch: dict) -> StaticCache:
        """One `StaticCache` per batch size for plain generate (emptied before each call): its compiled decode step
        records one graph per batch size instead of one per call."""
        size = batch["input_ids"].shape[0]
        if size not in self._static_caches:
            self._static_caches[size] = StaticCache(config=self.model.config.get_text_config(decoder=True),
                                                    max_cache_len=batch["input_ids"].shape[1] + self.args.new_tokens)
        self._static_caches[size].reset()
        return self._static_caches[size]

    def drop_static_caches(self) -> None:
        self._static_caches.clear()

    def generate(self, method: Method, batch: dict, *, first_token_only=False, new_tokens=None, streamer=None):
        """(output, start, end) of one generate call; start and end after a device sync."""
        n = self.args.new_tokens
        kwargs = dict(batch, max_new_tokens=n, do_sample=False, return_dict_in_generate=True)
        if first_token_only:
            kwargs["stopping_criteria"] = StoppingCriteriaList([FirstToken()])
        else:
            kwargs["max_new_tokens"] = kwargs["min_new_tokens"] = new_tokens or n
        if streamer is not None:
            kwargs["streamer"] = streamer
        if method.config is None:
            if self.args.cache == "static":
                kwargs.update(cache_argument(self.static_cache(batch)))
        else:
            config = method.config
            if first_token_only and config.policy == "raincheck":
                config = dataclasses.replace(config, completion="next_turn")  # the cache is dropped: complete nothing
            kwargs["raincheck_config"] = config
            if self.args.cache == "static":
                kwargs["cache_implementation"] = "static"
                kwargs["compile_config"] = CompileConfig()  # transformers' default, spelled out
        with no_gc(), torch.no_grad():
            self.sync()
            start = time.perf_counter()
            out = self.model.generate(**kwargs)
            self.sync()
            end = time.perf_counter()
        return out, start, end


def ttft_call(bench: Bench, method: Method, batch: dict) -> float:
    out, start, end = bench.generate(method, batch, first_token_only=True)
    width = batch["input_ids"].shape[1]
    if out.sequences.shape != (batch["input_ids"].shape[0], width + 1):
        raise RuntimeError(f"a first-token call returned sequences of shape {tuple(out.sequences.shape)}")
    del out
    return 1e3 * (end - start)


def restoration(bench: Bench, method: Method, cache, batch_size: int, steps: int) -> dict:
    """Raincheck's per-row accounting of the answer and ``restored_at_token``: the schedule (and, in the shared
    engine, ``step_deferred_budget`` shared over the rows) replayed for the rows' deferred counts."""
    empty = dict(restored_at_token=None, deferred_per_row=None, restored_during_decode=None,
                 pending_at_answer_end=None, restored_after_answer=None, replay_matches=None, counts=None,
                 step_budget=None)
    if method.config is None or method.config.policy != "raincheck":
        return empty
    stats = [row[-1] for row in cache.row_turn_stats]
    config = method.config
    shared = bench.rows(method, batch_size) == "shared"
    pending = [s.deferred for s in stats]
    gdn = bench.model._raincheck_state.adapter.gdn_glue is not None
    config = config.for_model(gdn)  # "auto" chunk size as generate ran it
    schedule = config.schedule or FixedChunkSchedule(config.chunk_size, config.guard_tokens)
    budget = config.step_budget(gdn)
    per_step = []  # the batch's deferred tokens carried by decode steps 1..steps
    per_row = [0] * batch_size
    for step in range(1, steps + 1):
        wanted = [carried_tokens(schedule, step, p) for p in pending]
        counts = carry_counts(wanted, budget) if shared else wanted
        pending = [p - c for p, c in zip(pending, counts)]
        per_row = [a + c for a, c in zip(per_row, counts)]
        per_step.append(sum(counts))
    matches = per_row == [s.restored_during_decode for s in stats]
    if not matches:
        print(f"  warning: the replayed schedule carries {per_row} deferred tokens per row, the rows counted "
              f"{[s.restored_during_decode for s in stats]}", flush=True)
    carried = [j for j, c in enumerate(per_step, start=1) if c]
    done = any(s.deferred for s in stats) and not any(pending)
    return dict(
        restored_at_token=carried[-1] + 1 if done and carried else None,  # step j produces output token j + 1
        deferred_per_row=[s.deferred for s in stats],
        restored_during_decode=sum(s.restored_during_decode for s in stats),
        pending_at_answer_end=sum(s.pending_at_answer_end for s in stats),
        restored_after_answer=sum(s.restored_after_answer for s in stats),
        replay_matches=matches,
        counts=per_step,
        step_budget=budget if shared else None,  # the budget the shared steps ran with ("auto" resolved)
    )


def answer_run(bench: Bench, method: Method, batch: dict) -> dict:
    """One forced answer of ``--new-tokens`` tokens for every row."""
    n, size = bench.args.new_tokens, batch["input_ids"].shape[0]
    timer = Timer(bench.sync) if bench.streams(method, size) else None
    bench.reset_peak_memory()
    out, start, end = bench.generate(method, batch, streamer=timer)
    peak = bench.peak_memory_gib()
    width = batch["input_ids"].shape[1]
    if out.sequences.shape != (size, width + n):
        raise RuntimeError(f"expected sequences of shape {(size, width + n)}, got {tuple(out.sequences.shape)}")
    restored = restoration(bench, method, output_cache(out), size, n - 1)
    del out
    e2e = end - start
    run = dict(e2e_ms=1e3 * e2e, tokens_per_s=size * n / e2e, peak_mem_gib=peak, tpot_ms=None, answer_ttft_ms=None,
               step_ms=None, step_p50_ms=None, restore_step_ms=None, decode_step_ms=None, **restored)
    if timer is not None:
        tokens = timer.times[1:]
        if len(tokens) != n:
            raise RuntimeError(f"expected {n} timestamped steps, the streamer saw {len(tokens)}")
        steps = [b - a for a, b in zip(tokens, tokens[1:])]  # steps[j-1]: decode step j
        counts = restored["counts"] or [0] * len(steps)
        run.update(tpot_ms=1e3 * (tokens[-1] - tokens[0]) / (n - 1), answer_ttft_ms=1e3 * (tokens[0] - start),
                   step_ms=[round(1e3 * s, 3) for s in steps], step_p50_ms=1e3 * statistics.median(steps),
                   restore_step_ms=mean_ms([s for s, c in zip(steps, counts) if c]),
                   decode_step_ms=mean_ms([s for s, c in zip(steps, counts) if not c]))
    return run


def mean_ms(values: list[float]) -> float | None:
    return 1e3 * statistics.fmean(values) if values else None


def median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------------- one batch size
@dataclasses.dataclass
class Entry:
    """One method's calls at one batch size."""

    method: Method
    warmup_s: float = 0.0
    ttft_calls: list = dataclasses.field(default_factory=list)  # the warm-up's, then one per round
    ttft_rounds: list = dataclasses.field(default_factory=list)
    answers: list = dataclasses.field(default_factory=list)
    failed: bool = False


def make_record(bench: Bench, entry: Entry, batch_size: int, prompt_tokens: list[int]) -> dict:
    n, answers = bench.args.new_tokens, entry.answers
    for answer, ttft in zip(answers, entry.ttft_rounds):
        if answer["tpot_ms"] is None:  # rows one by one: the rest of the call over the steps after the first
            answer["tpot_ms"] = (answer["e2e_ms"] - ttft) / (n - 1)
            answer["tpot_from"] = "e2e - ttft"
        else:
            answer.setdefault("tpot_from", "streamer")
    middle = answers[len(answers) // 2]
    record = dict(
        model=bench.name, cache=bench.args.cache, batch_size=batch_size, method=entry.method.name,
        rows=bench.rows(entry.method, batch_size), rows_why=bench.rows_why(entry.method, batch_size),
        image_tokens=row_image_tokens(bench.args, batch_size),
        prompt_tokens=prompt_tokens, new_tokens=n,
        ttft_ms=statistics.median(entry.ttft_calls), ttft_ms_calls=[round(t, 2) for t in entry.ttft_calls],
        ttft_ms_rounds=[round(t, 2) for t in entry.ttft_rounds],
        tpot_ms=median_or_none([a["tpot_ms"] for a in answers]),
        tpot_ms_rounds=[round(a["tpot_ms"], 4) for a in answers], tpot_from=answers[0]["tpot_from"],
        tokens_per_s=median_or_none([a["tokens_per_s"] for a in answers]),
        tokens_per_s_rounds=[round(a["tokens_per_s"], 2) for a in answers],
        e2e_ms=median_or_none([a["e2e_ms"] for a in answers]), e2e_ms_rounds=[round(a["e2e_ms"], 1) for a in answers],
        peak_mem_gib=max((a["peak_mem_gib"] for a in answers if a["peak_mem_gib"] is not None), default=None),
        rounds=len(answers), warmup_s=round(entry.warmup_s, 2),
        answer_ttft_ms=[None if a["answer_ttft_ms"] is None else round(a["answer_ttft_ms"], 2) for a in answers],
        step_ms=middle["step_ms"], step_p50_ms=median_or_none([a["step_p50_ms"] for a in answers]),
        restore_step_ms=median_or_none([a["restore_step_ms"] for a in answers]),
        decode_step_ms=median_or_none([a["decode_step_ms"] for a in answers]),
        restored_at_token=middle["restored_at_token"], deferred_per_row=middle["deferred_per_row"],
        restored_during_decode=middle["restored_during_decode"], pending_at_answer_end=middle["pending_at_answer_end"],
        restored_after_answer=middle["restored_after_answer"],
        replay_matches=None if middle["replay_matches"] is None else all(a["replay_matches"] for a in answers),
        step_budget=middle["step_budget"],
    )
    return {key: record[key] for key in RECORD_KEYS}


def paired(a: list, b: list):
    """Median over rounds of a[r] / b[r] (None without a full set of pairs)."""
    pairs = [x / y for x, y in zip(a, b) if x is not None and y]
    return round(statistics.median(pairs), 4) if pairs and len(a) == len(b) else None


def pair_ratios(records: list[dict]) -> list[dict]:
    """RC / Full, RC / Hard and Full / plain of one (model, cache, batch size). TPOT and tokens/s: the median of the
    rounds' paired ratios (``*_of_medians``: the ratio of the medians); TTFT: the ratio of the medians over every
    first-token call (the warm-up's and the rounds'; a prefill varies little from call to call, and one call per
    round is few pairs), ``ttft_paired`` the rounds' paired median."""
    by_method = {r["method"]: r for r in records}
    out = []
    sweeps = [(name, other) for name in by_method if sweep_name(name) for other in ("full", "raincheck")]
    for top, bottom in PAIRS + tuple(sweeps):
        a, b = by_method.get(top), by_method.get(bottom)
        if a is None or b is None:
            continue
        out.append(dict(model=a["model"], cache=a["cache"], batch_size=a["batch_size"], pair=f"{top}/{bottom}",
                        ttft=rounded_ratio(a["ttft_ms"], b["ttft_ms"]),
                        tpot=paired(a["tpot_ms_rounds"], b["tpot_ms_rounds"]),
                        tokens_per_s=paired(a["tokens_per_s_rounds"], b["tokens_per_s_rounds"]),
                        ttft_paired=paired(a["ttft_ms_rounds"], b["ttft_ms_rounds"]),
                        tpot_of_medians=rounded_ratio(a["tpot_ms"], b["tpot_ms"]),
                        step_p50=rounded_ratio(a["step_p50_ms"], b["step_p50_ms"]),
                        tokens_per_s_of_medians=rounded_ratio(a["tokens_per_s"], b["tokens_per_s"])))
    return out


def rounded_ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


def check_targets(ratios: list[dict]) -> list[dict]:
    """The issue's targets, each from the RC / Full ratios of one batch size (`pair_ratios`; TPOT: set for the
    compiled path, reported for every cache kind)."""
    checks = []
    for r in ratios:
        if r["pair"] != "raincheck/full":
            continue
        size = r["batch_size"]
        tpot_limit = 1.05 if size <= 8 else 1.10
        candidates = [(f"TPOT <= {tpot_limit:.2f} x full", r["tpot"], tpot_limit, "<="),
                      ("tokens/s >= 0.95 x full", r["tokens_per_s"], 0.95, ">=")]
        if size >= 4:
            candidates.insert(0, ("TTFT <= 0.80 x full", r["ttft"], 0.80, "<="))
        for target, value, limit, sense in candidates:
            if value is not None:
                met = value <= limit if sense == "<=" else value >= limit
                checks.append(dict(model=r["model"], cache=r["cache"], batch_size=size, target=target, value=value,
                                   limit=limit, met=met))
    return checks


def run_batch_size(bench: Bench, batch_size: int, methods: list[Method], budget: Budget, results: Results,
                   groups_left: int) -> None:
    """Every method at one batch size: warm-ups, then --rounds paired rounds within this batch size's share."""
    args, dtype = bench.args, (torch.bfloat16 if bench.cuda else torch.float32)
    if not budget.fits_group(bench.name, batch_size, methods, bench):
        for method in methods:
            results.skipped.append(dict(model=bench.name, cache=args.cache, batch_size=batch_size, method=method.name))
        print(f"  skipped (time budget): B={batch_size}", flush=True)
        results.save()
        return
    batch, prompt_tokens = make_batch(args, batch_size, args.device, dtype)
    group_deadline = budget.group_deadline(groups_left)
    entries = [Entry(m) for m in methods]

    def failed(entry: Entry, error: Exception) -> None:  # one failing method must not lose the others
        entry.failed = True
        results.errors.append(dict(model=bench.name, cache=args.cache, batch_size=batch_size,
                                   method=entry.method.name, error=f"{type(error).__name__}: {error}"))
        print(f"  FAILED B={batch_size} {entry.method.name}: {type(error).__name__}: {error}", flush=True)
        traceback.print_exc(limit=4)
        if bench.cuda:
            torch.cuda.empty_cache()

    for entry in entries:
        if time.perf_counter() >= budget.model_deadline:
            entry.failed = True
            results.skipped.append(dict(model=bench.name, cache=args.cache, batch_size=batch_size,
                                        method=entry.method.name))
            print(f"  skipped (time budget): B={batch_size} {entry.method.name}", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            bench.generate(entry.method, batch, new_tokens=args.warmup_tokens)  # compiles / records graphs (static)
            entry.ttft_calls += [ttft_call(bench, entry.method, batch) for _ in range(args.ttft_repeats)]
        except Exception as error:  # noqa: BLE001
            failed(entry, error)
        entry.warmup_s = time.perf_counter() - t0
    for round_index in range(args.rounds):
        live = [e for e in entries if not e.failed]
        if not live:
            break
        if round_index:  # the first round always runs (its estimate fitted); later ones within the share
            last = results.round_seconds[(bench.name, batch_size)]
            if time.perf_counter() + last > group_deadline:
                print(f"  B={batch_size}: {round_index} round(s) (time budget)", flush=True)
                break
        t0 = time.perf_counter()
        shift = round_index % len(live)
        for entry in live[shift:] + live[:shift]:
            try:
                ttft = ttft_call(bench, entry.method, batch)
                entry.answers.append(answer_run(bench, entry.method, batch))
                entry.ttft_calls.append(ttft)
                entry.ttft_rounds.append(ttft)
            except Exception as error:  # noqa: BLE001
                failed(entry, error)
        results.round_seconds[(bench.name, batch_size)] = time.perf_counter() - t0
    done = [e for e in entries if not e.failed and e.answers]
    records = [make_record(bench, e, batch_size, prompt_tokens) for e in done]
    for e, record in zip(done, records):
        budget.record(bench.name, batch_size, e.method.name, record["rows"], e.warmup_s,
                      statistics.fmean(a["e2e_ms"] for a in e.answers) / 1e3)
        print(f"  B={batch_size:<3d} {e.method.name:9s} {record['rows'][:10]:10s} TTFT {record['ttft_ms']:9.1f} ms  "
              f"TPOT {record['tpot_ms']:7.2f} ms  {record['tokens_per_s']:8.1f} tok/s  peak "
              f"{fmt(record['peak_mem_gib'], 2)} GiB  ({record['rounds']} rounds, warm-up {e.warmup_s:.0f} s"
              + (f", restored at token {record['restored_at_token']}" if record["restored_at_token"] else "")
              + ")", flush=True)
    results.records += records
    results.ratios += pair_ratios(records)
    if args.profile_steps and bench.streams(entries[0].method, batch_size):
        results.profiles.append(profile_steps(bench, done, batch, batch_size))
    if args.profile_ttft:
        results.profiles.append(profile_ttft(bench, done, batch, batch_size))
    del batch
    bench.drop_static_caches()
    results.save()


def profile_steps(bench: Bench, entries: list[Entry], batch: dict, batch_size: int) -> str:
    """torch.profiler tables (GPU time, then host time) of Raincheck's first fused step (decode step
    ``guard_tokens + 2``) and of a decode-only step two steps after its last restoration, and of Full's steps at
    the same indices (the same step kinds without a plan), each in one more answer after the rounds: where a fused
    step's extra time goes, and whether a decode-only step after restoration costs what Full's does."""
    from torch.profiler import ProfilerActivity

    args = bench.args
    by = {e.method.name: e for e in entries}
    raincheck = by.get("raincheck")
    restored_at = raincheck.answers[-1]["restored_at_token"] if raincheck is not None else None
    if restored_at is None:
        return f"## B={batch_size}: no Raincheck answer that restored during decode; nothing profiled\n"
    steps = {"fused": args.guard_tokens + 2}
    if restored_at + 2 < args.new_tokens:
        steps["decode-only after restoration"] = restored_at + 2
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.cuda else [])
    parts = []
    for name in ("raincheck", "full"):
        if name not in by:
            continue
        profilers, walls = {}, {}
        hook = step_profiler(steps, activities, profilers, walls)
        bench.generate(by[name].method, batch, streamer=Timer(bench.sync, hook))
        for label, prof in profilers.items():
            parts.append(profile_tables(prof, f"{bench.name}, {args.cache} cache, B={batch_size}, {name}: decode step "
                                              f"{steps[label]} ({label}): wall {1e3 * walls[label]:.2f} ms",
                                        args.profile_rows, bench.cuda))
            print(f"  profiled B={batch_size} {name} step {steps[label]} ({label}): wall {1e3 * walls[label]:.2f} ms"
                  f"{kernel_busy(prof)}", flush=True)
    return "\n".join(parts)


def profile_ttft(bench: Bench, entries: list[Entry], batch: dict, batch_size: int) -> str:
    """torch.profiler tables (GPU time, then host time) of one first-token call of Raincheck, Hard and Full (each
    after one unprofiled call): the batch's vision, selection and prefill, where a first token's time goes."""
    from torch.profiler import ProfilerActivity, profile

    args = bench.args
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.cuda else [])
    parts = []
    for entry in entries:
        if entry.method.config is None:  # plain generate: transformers' own prefill
            continue
        ttft_call(bench, entry.method, batch)
        with profile(activities=activities) as prof:
            wall = ttft_call(bench, entry.method, batch)
        parts.append(profile_tables(prof, f"{bench.name}, {args.cache} cache, B={batch_size}, {entry.method.name}: "
                                          f"first-token call: wall {wall:.2f} ms", args.profile_rows, bench.cuda))
        print(f"  profiled B={batch_size} {entry.method.name} first-token call: wall {wall:.2f} ms"
              f"{kernel_busy(prof)}", flush=True)
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------- budget
class Budget:
    """Wall-clock budget: shared fairly between the models, then between a model's batch sizes."""

    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + seconds
        self.model_deadline = self.deadline
        self.last: dict = {}  # (model, method) -> (batch size, rows, warm-up s, answer s) of its latest batch size

    def start_model(self, models_left: int) -> None:
        now = time.perf_counter()
        self.model_deadline = now + max(self.deadline - now, 0.0) / models_left

    def group_deadline(self, groups_left: int) -> float:
        now = time.perf_counter()
        return now + max(self.model_deadline - now, 0.0) / max(groups_left, 1)

    def record(self, model: str, batch_size: int, method: str, rows: str, warmup_s: float, answer_s: float) -> None:
        self.last[(model, method)] = (batch_size, rows, warmup_s, answer_s)

    def estimate(self, model: str, batch_size: int, method: Method, bench: Bench) -> float | None:
        """Seconds of `method`'s warm-up and first round at `batch_size`, from its previous batch size: answers
        scale with B where the rows run one by one, with sqrt(B) where they share forwards (eager steps are mostly
        host time at these sizes); None without a previous batch size."""
        last = self.last.get((model, method.name))
        if last is None:
            return None
        size, rows, warmup_s, answer_s = last
        grow = batch_size / size
        rows_now = bench.rows(method, batch_size)
        scale = grow if rows_now == "one by one" else grow ** 0.5
        if rows == "batch-1" and rows_now == "one by one":
            scale = batch_size
        warm = warmup_s * scale if bench.args.cache == "dynamic" else warmup_s + answer_s * (scale - 1)
        return warm + answer_s * scale * 1.1

    def fits_group(self, model: str, batch_size: int, methods: list[Method], bench: Bench) -> bool:
        now = time.perf_counter()
        if now >= self.model_deadline:
            return False
        estimates = [self.estimate(model, batch_size, m, bench) for m in methods]
        known = [e for e in estimates if e is not None]
        return not known or now + sum(known) <= self.model_deadline


# ---------------------------------------------------------------------------------------------------- output
class Results:
    """What the run produced so far; with --save / --out the JSON is rewritten after every batch size."""

    def __init__(self, args, meta: dict):
        self.args, self.meta = args, meta
        self.records, self.ratios, self.skipped, self.errors = [], [], [], []
        self.profiles: list[str] = []  # --profile-steps / --profile-ttft: texts of tables per batch size
        self.round_seconds: dict = {}
        self.path = args.out or (os.path.join(args.results_dir, "batch.json") if args.save else None)

    def report(self) -> dict:
        return dict(meta=dict(self.meta, skipped=self.skipped, errors=self.errors), records=self.records,
                    ratios=self.ratios, targets=check_targets(self.ratios))

    def save(self) -> None:
        if self.path is None:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.report(), f, indent=1)
        os.replace(tmp, self.path)
        if self.profiles:
            with open(self.profile_path, "w") as f:
                f.write("\n".join(self.profiles))

    @property
    def profile_path(self) -> str:
        """Where --profile-steps / --profile-ttft write their tables: next to the JSON (``X.json`` -> ``X_profile.txt``)."""
        return os.path.splitext(self.path)[0] + "_profile.txt"


def meta(args, cuda: bool, methods: list[Method]) -> dict:
    return dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        torch=torch.__version__, transformers=transformers.__version__, hf_raincheck=hf_raincheck.__version__,
        gpu=torch.cuda.get_device_name(torch.device(args.device)) if cuda else None,
        cpu=platform.processor() or platform.machine(),
        device=args.device, dtype="bfloat16" if cuda else "float32",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), quick=args.quick,
        settings=dict(models=args.models, cache=args.cache, batch_sizes=args.batch_sizes,
                      image_tokens=args.image_tokens, new_tokens=args.new_tokens, rounds=args.rounds,
                      ttft_repeats=args.ttft_repeats, warmup_tokens=args.warmup_tokens, budget_s=args.budget_s,
                      text_tokens=f"{TEXT_BEFORE} before the image, {QUESTION} + 3 * (row % 4) after",
                      env={k: v for k, v in os.environ.items() if k.startswith("HF_RAINCHECK_")}),
        configs={m.name: (None if m.config is None else m.config.to_dict()) for m in methods},
    )


def fmt(value, digits=1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown_tables(report: dict) -> str:
    order = {name: i for i, name in enumerate(TABLE_ORDER)}
    records = sorted(report["records"], key=lambda r: (r["model"], r["cache"], r["batch_size"],
                                                       order.get(r["method"], len(order)), r["method"]))
    lines = ["| model | cache | B | method | rows | TTFT ms | TPOT ms | step p50 ms | tokens/s | E2E s | peak GiB | "
             "restored at |", "| " + " | ".join(["---"] * 12) + " |"]
    for r in records:
        lines.append("| " + " | ".join([
            r["model"], r["cache"], str(r["batch_size"]), r["method"], r["rows"], fmt(r["ttft_ms"]),
            fmt(r["tpot_ms"], 2) + ("" if r["tpot_from"] == "streamer" else " *"), fmt(r["step_p50_ms"], 2),
            fmt(r["tokens_per_s"]),
            fmt(r["e2e_ms"] / 1e3, 2), fmt(r["peak_mem_gib"], 2), fmt(r["restored_at_token"], 0)]) + " |")
    if any(r["tpot_from"] != "streamer" for r in records):
        lines.append("\n\\* rows one by one: (answer call - first-token call) / (new tokens - 1)")
    lines += ["", "| model | cache | B | ratio | TTFT | TPOT | step p50 | tokens/s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(report["ratios"], key=lambda r: (r["model"], r["cache"], r["batch_size"], r["pair"])):
        lines.append(f"| {r['model']} | {r['cache']} | {r['batch_size']} | {r['pair']} | {fmt(r['ttft'], 3)} | "
                     f"{fmt(r['tpot'], 3)} | {fmt(r.get('step_p50'), 3)} | {fmt(r['tokens_per_s'], 3)} |")
    lines += ["", "| model | cache | B | target | value | met |", "| --- | --- | --- | --- | --- | --- |"]
    for c in report["targets"]:
        lines.append(f"| {c['model']} | {c['cache']} | {c['batch_size']} | {c['target']} | {c['value']:.3f} | "
                     f"{'met' if c['met'] else '**missed**'} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- driver
def run_model(model_name: str, args, methods: list[Method], budget: Budget, results: Results, cuda: bool) -> None:
    started = time.perf_counter()
    dtype = torch.bfloat16 if cuda else torch.float32
    bench = Bench(enable_raincheck(build_model(model_name, args.device, dtype)), model_name, args, cuda)
    torch._dynamo.utils.counters.clear()
    gc.collect()
    gc.freeze()  # the model's objects leave the collector's view: a collection before each timed call is ~free
    widest = max(args.batch_sizes)
    print(f"\n== {model_name}, {args.cache} cache: built in {time.perf_counter() - started:.1f} s; at B > 1: "
          + "; ".join(f"{m.name} {bench.rows(m, widest)}" + (f" ({bench.rows_why(m, widest)})"
                                                           if bench.rows_why(m, widest) else "") for m in methods),
          flush=True)
    for k, batch_size in enumerate(args.batch_sizes):
        run_batch_size(bench, batch_size, methods, budget, results, len(args.batch_sizes) - k)
        if cuda:
            torch.cuda.empty_cache()
    results.meta.setdefault("compiled_graphs", {})[model_name] = compiled_graphs()
    del bench
    release_model_memory(cuda)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU, seconds (smoke run)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--models", default=None,
                        help=f"comma list of {sorted(SHAPES)} (default qwen3-vl-8b; --quick tiny)")
    parser.add_argument("--cache", default="dynamic", choices=("dynamic", "static"),
                        help="dynamic: eager decode (the shared engine); static: cache_implementation='static', "
                             "compiled steps (Qwen3.5's Raincheck rows one by one)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 1 4 8 16 (--quick 1 3)")
    parser.add_argument("--image-tokens", default=None,
                        help="merged tokens of each row's image (squares), a comma list cycled over the rows for "
                             "mixed sizes (default 1024; --quick 64,36)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    parser.add_argument("--new-tokens", type=int, default=None, help="forced answer length (256; --quick 24)")
    parser.add_argument("--rounds", type=int, default=2, help="paired rounds (each: every method's answer)")
    parser.add_argument("--ttft-repeats", type=int, default=None,
                        help="first-token calls per method after its warm-up (2; --quick 1), besides one per round")
    parser.add_argument("--warmup-tokens", type=int, default=None,
                        help="answer length of the warm-up call on a dynamic cache (48, at most --new-tokens); "
                             "a static cache always warms up with the whole answer (compilation)")
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--chunk-size", type=parse_chunk_size, default="auto",
                        help="Raincheck's chunk size (default auto: the package's, 31; 63 for qwen3.5)")
    parser.add_argument("--guard-tokens", type=int, default=16)
    parser.add_argument("--pruning", default="mmtok", help="selector of hard and raincheck (the package default)")
    parser.add_argument("--step-budget", default="auto",
                        help="RaincheckConfig.step_deferred_budget of raincheck (the default 'auto': the model's, "
                             "128 or 512 for Qwen3.5; 'none': no cap)")
    parser.add_argument("--step-budget-sweep", type=int, nargs="*", default=[], metavar="N",
                        help="also run raincheck with each of these step budgets, in the same rounds (methods "
                             "raincheck-b<N>, paired with full and raincheck)")
    parser.add_argument("--attn-backend", default="auto", choices=("auto", "sdpa", "eager", "flash"))
    parser.add_argument("--gdn-backend", default="auto", choices=("auto", "torch", "fla"))
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="wall-clock budget of the runs (s): batch sizes that do not fit are skipped")
    parser.add_argument("--profile-steps", action="store_true",
                        help="after each batch size's rounds: torch.profiler tables of Raincheck's first fused step "
                             "and a decode-only step after restoration, and Full's same steps (needs --save or --out; "
                             "written next to the JSON as *_profile.txt)")
    parser.add_argument("--profile-ttft", action="store_true",
                        help="after each batch size's rounds: torch.profiler tables of one first-token call of "
                             "Raincheck, Hard and Full (needs --save or --out; written to the *_profile.txt file)")
    parser.add_argument("--profile-rows", type=int, default=25, help="rows per profiler table")
    parser.add_argument("--save", action="store_true", help="write --results-dir/batch.json")
    parser.add_argument("--out", default=None, help="write the JSON here (implies --save)")
    parser.add_argument("--results-dir", default=RESULTS_DIR)
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")
    args.models = [m for m in (args.models or ("tiny" if args.quick else "qwen3-vl-8b")).split(",") if m]
    args.batch_sizes = args.batch_sizes or ([1, 3] if args.quick else [1, 4, 8, 16])
    args.new_tokens = args.new_tokens or (24 if args.quick else 256)
    args.ttft_repeats = args.ttft_repeats if args.ttft_repeats is not None else (1 if args.quick else 2)
    if args.cache == "static" and args.warmup_tokens not in (None, args.new_tokens):
        parser.error("--warmup-tokens: a static cache warms up with the whole answer (it compiles every step kind "
                     f"at the answer's cache size); leave it out or pass --new-tokens ({args.new_tokens})")
    default_warmup = args.new_tokens if args.cache == "static" else min(48, args.new_tokens)
    args.warmup_tokens = args.warmup_tokens if args.warmup_tokens is not None else default_warmup
    args.methods = [m for m in args.methods.split(",") if m]
    try:
        args.image_tokens = [int(t) for t in (args.image_tokens or ("64,36" if args.quick else "1024")).split(",") if t]
    except ValueError:
        parser.error(f"--image-tokens: a comma list of square token counts (e.g. 1024 or 1024,576), "
                     f"got {args.image_tokens!r}")
    for name, values, allowed in (("models", args.models, SHAPES), ("methods", args.methods, METHODS)):
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            parser.error(f"--{name}: unknown or empty {unknown or values}; choose from {sorted(allowed)}")
    if len(set(args.methods)) != len(args.methods):
        parser.error(f"--methods: each method once, got {args.methods}")
    bad = [t for t in args.image_tokens if t < 1 or round(t ** 0.5) ** 2 != t]
    if bad or not args.image_tokens:
        parser.error(f"--image-tokens: square token counts >= 1 (a side x side grid), got {args.image_tokens}")
    if any(b < 1 for b in args.batch_sizes) or len(set(args.batch_sizes)) != len(args.batch_sizes):
        parser.error(f"--batch-sizes: distinct sizes >= 1, got {args.batch_sizes}")
    if args.new_tokens < 2:
        parser.error(f"--new-tokens: at least 2 (TPOT needs a step after the first token), got {args.new_tokens}")
    if not 1 <= args.warmup_tokens <= args.new_tokens:
        parser.error(f"--warmup-tokens: 1 .. --new-tokens ({args.new_tokens}), got {args.warmup_tokens}")
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")
    if args.ttft_repeats < 0:
        parser.error(f"--ttft-repeats: at least 0, got {args.ttft_repeats}")
    if any(b < 1 for b in args.step_budget_sweep) or len(set(args.step_budget_sweep)) != len(args.step_budget_sweep):
        parser.error(f"--step-budget-sweep: distinct budgets >= 1, got {args.step_budget_sweep}")
    if args.step_budget.lower() == "none":
        args.step_budget = None
    elif args.step_budget.lower() == "auto":
        args.step_budget = "auto"
    else:
        try:
            args.step_budget = int(args.step_budget)
        except ValueError:
            parser.error(f"--step-budget: an int >= 1, 'auto' or 'none', got {args.step_budget!r}")
    if args.out:
        args.save = True
    for option, wanted in (("--profile-steps", args.profile_steps), ("--profile-ttft", args.profile_ttft)):
        if wanted and not args.save:
            parser.error(f"{option}: pass --save or --out (the tables are written next to the JSON)")
    if args.profile_rows < 1:
        parser.error(f"--profile-rows: at least 1, got {args.profile_rows}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.quick:
        torch.set_num_threads(1)  # tiny matmuls: more threads only fight over a shared CPU
    set_compile_limits()
    methods = build_methods(args)
    results = Results(args, meta(args, cuda, methods))
    budget = Budget(args.budget_s)
    started = time.perf_counter()
    for i, model_name in enumerate(args.models):
        budget.start_model(len(args.models) - i)
        run_model(model_name, args, methods, budget, results, cuda)
    results.meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    report = results.report()
    print(f"\n{args.new_tokens} forced tokens, images {args.image_tokens} (cycled over the rows), {args.cache} cache; "
          f"raincheck: retention {args.retention}, chunk {args.chunk_size}"
          f"{CHUNK_AUTO if args.chunk_size == 'auto' else ''}, guard {args.guard_tokens}, selector "
          f"{args.pruning}, step budget {args.step_budget}{STEP_BUDGET_AUTO if args.step_budget == 'auto' else ''}, "
          f"blocking; ratios: TPOT and tokens/s paired medians over "
          f"rounds, TTFT of the medians over first-token calls; {results.meta['elapsed_s']:.0f} s\n")
    print(markdown_tables(report))
    if results.skipped:
        print(f"\nskipped for the time budget ({len(results.skipped)}): "
              + "; ".join(f"{s['model']} B={s['batch_size']} {s['method']}" for s in results.skipped))
    if results.errors:
        print(f"\nfailed ({len(results.errors)}): " + "; ".join(
            f"{e['model']} B={e['batch_size']} {e['method']}: {e['error']}" for e in results.errors))
    if results.path:
        results.save()
        print(f"\nwrote {results.path}" + (f" and {results.profile_path}" if results.profiles else ""))
    return 1 if results.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
