"""Answer quality of Full / Hard / Raincheck on held-out GridQA dialogues with the shipped tiny trained models.

    python benchmarks/quality.py --quick                              # small subset, < 1 minute on CPU
    python benchmarks/quality.py --arch qwen3_vl --dialogues 500 --jobs 16   # the whole grid (many cores)
    python benchmarks/quality.py --selectors mmtok uniform --retentions 0.3 --chunks 7 31 --dialogues 100

One grid in pieces (several machines, runs that a timeout may kill), summarised once:

    timeout 600 python benchmarks/quality.py --dialogues 250 --jobs 64 --save-results a.jsonl       # machine A
    python benchmarks/quality.py --start 250 --dialogues 250 --jobs 16 --save-results b.jsonl        # machine B
    timeout 600 python benchmarks/quality.py --dialogues 250 --jobs 64 --save-results a.jsonl   # killed? resumes
    python benchmarks/quality.py --merge a.jsonl b.jsonl --out benchmarks/results/quality.json

A grid can also grow by configurations: a part that runs only some policies (``--policies raincheck --chunks 7``: no
Full / Hard runs, so no summary of its own) merges with a part that has the baselines:

    python benchmarks/quality.py --retentions 0.3 --chunks 31 --save-results a.jsonl
    python benchmarks/quality.py --retentions 0.3 --chunks 7 15 --causal-retentions --policies raincheck \
        --save-results c.jsonl
    python benchmarks/quality.py --merge a.jsonl c.jsonl      # = --retentions 0.3 --chunks 7 15 31

``--save-results PATH`` appends every finished dialogue's results to a JSON-lines file (after a header line with the
arch, model, grid and versions) as soon as it finishes; when PATH exists, it must hold the same configuration, and its
dialogues are skipped. ``--merge PATH ...`` runs no model: it checks that the files' headers agree (arch, model,
guard tokens, completion, max new tokens), takes for every dialogue the union of its runs in the files (the grid is
the union of theirs; a dialogue that lacks a run of some configuration is left out, with a warning) and writes the
same summary as one run of that grid (``meta``: ``parts``, ``indices``, ``cpu_s`` the summed run time, ``wall_s``
null).

Every dialogue (``hf_raincheck.gridqa`` split ``"test"``, indices ``--start`` ..) is played as a real chat: turn 1
through the processor's chat template, later turns through ``next_turn_inputs`` on the returned cache, with the
model's own earlier answers in the history. Policies:

* ``full``: plain ``model.generate`` (no Raincheck), the cache carried from turn to turn;
* ``hard``: ``RaincheckConfig(policy="hard", retention, pruning=selector)``: the pruned tokens are never prefilled;
* ``raincheck``: ``RaincheckConfig(retention, pruning=selector, chunk_size, guard_tokens, completion, visibility)``.

A turn is correct when its greedy answer equals the reference (``gridqa.task.is_correct``). Per turn (1..4, and
``"2+"``: turns 2-4 pooled) the JSON records accuracy, n, and a 95% bootstrap interval (dialogues resampled, the
same resample for every policy), and for Hard / Raincheck the share of the loss that Raincheck recovers,
``(acc_raincheck - acc_hard) / (acc_full - acc_hard)``, with its interval (undefined where Full - Hard = 0 in a
resample; ``recovered_defined`` says in how many). ``subset: "long"`` records turn 1 restricted to questions whose
reference answer is longer than ``guard_tokens`` tokens (only there can tokens restored during decoding change the
answer). Raincheck runs also report how many tokens were restored during decoding / after the answer / in a later
prefill. Visibility (``"boundary"``, the paper's, vs ``"causal"``) is compared at ``--causal-retentions`` x
``--causal-chunks`` for every selector.

Turn 1 is also reported per question (``subset``): ``named_cells`` (the question names its cells: ``cell``,
``larger``, ``colour``), ``line`` (a row or column answered cell by cell in source order: ``row``, ``column``,
``count``, ``search``) and ``kind=<kind>``. Every answer is stored; Hard / Raincheck records carry
``same_as_full`` (share of answers equal to Full's) and ``same_as_full_same_history`` (only turns whose earlier
answers all equal Full's: a different turn-1 answer in the history changes what follows, whatever restoration did).
``--completion`` picks what happens to tokens still deferred when an answer ends: ``blocking``, ``next_turn`` (the
next question arrives at once and its prefill folds them in) or ``background`` (a worker restores them in
``--completion-chunk-size`` chunks and the next question arrives uniformly in ``[0, --preempt-ms)`` after the answer,
drawn from the dialogue's index, preempting it wherever it is).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import itertools
import json
import os
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ALL_SELECTORS = ("mmtok", "hiprune", "divprune", "visionzip", "uniform", "random")

# ------------------------------------------------------------------------------------------------------------------
# one dialogue under one policy
# ------------------------------------------------------------------------------------------------------------------


def play(model, processor, dialogue, config, max_new_tokens, image=None, preempt_s: float = 0.0):
    """Plays a dialogue; returns per turn ``(answer, correct, answer_tokens)`` and restoration stats.

    Under ``completion="background"`` the next question arrives a random time in ``[0, preempt_s)`` after the
    answer (drawn from the dialogue's index, so a rerun draws the same delays): the worker still restoring the
    deferred tokens is preempted wherever it is, and the next prefill folds in what it left."""
    from hf_raincheck import complete_deferred
    from hf_raincheck.conversation import cache_argument, next_turn_inputs, output_cache
    from hf_raincheck.gridqa import task

    image = image if image is not None else dialogue.image()
    background = config is not None and config.policy == "raincheck" and config.completion == "background"
    delays = np.random.default_rng([4321, dialogue.index]).random(len(dialogue.turns)) * preempt_s
    out = cache = None
    turns = []
    for j, turn in enumerate(dialogue.turns):
        if background and j > 0 and delays[j] > 0:
            time.sleep(float(delays[j]))
        if j == 0:
            messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                                     {"type": "text", "text": turn.question}]}]
            inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True, return_tensors="pt")
        else:
            inputs = next_turn_inputs(processor, out.sequences, [{"role": "user", "content": turn.question}])
        inputs = {k: v.to(model.device) for k, v in inputs.items()}
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
        if cache is not None:
            kwargs.update(cache_argument(cache))
        if config is not None:
            kwargs["raincheck_config"] = config
        out = model.generate(**inputs, **kwargs)
        cache = output_cache(out)
        new = out.sequences[0, inputs["input_ids"].shape[1] :]
        answer = processor.decode(new, skip_special_tokens=True).strip()
        turns.append((answer, task.is_correct(answer, turn.answer), int(new.numel())))
    stats = None
    if config is not None and config.policy == "raincheck":
        if config.completion in ("next_turn", "background"):
            complete_deferred(model, cache)  # the dialogue is over: count what was still pending
        s = cache.stats
        stats = {"during_decode": s.during_decode, "after_answer": s.after_answer, "during_prefill": s.during_prefill}
    return turns, stats


# ------------------------------------------------------------------------------------------------------------------
# the grid of configurations
# ------------------------------------------------------------------------------------------------------------------


POLICIES = ("full", "hard", "raincheck")


def config_grid(args):
    """``[(key, RaincheckConfig or None)]``; key = (policy, selector, retention, chunk, visibility)."""
    from hf_raincheck import RaincheckConfig

    grid = [(("full", None, None, None, None), None)]
    for sel, ret in itertools.product(args.selectors, args.retentions):
        grid.append((("hard", sel, ret, None, None), RaincheckConfig(policy="hard", retention=ret, pruning=sel)))
    raincheck = set()
    for sel, ret, chunk in itertools.product(args.selectors, args.retentions, args.chunks):
        raincheck.add((sel, ret, chunk, "boundary"))
    for sel, ret, chunk in itertools.product(args.selectors, args.causal_retentions, args.causal_chunks):
        raincheck.add((sel, ret, chunk, "causal"))
        if ret not in args.retentions:  # a causal point needs its Hard baseline
            key = ("hard", sel, ret, None, None)
            if all(k != key for k, _ in grid):
                grid.append((key, RaincheckConfig(policy="hard", retention=ret, pruning=sel)))
    for sel, ret, chunk, vis in sorted(raincheck, key=lambda x: (ALL_SELECTORS.index(x[0]) if x[0] in ALL_SELECTORS
                                                                 else 99, x[1], x[2], x[3])):
        cfg = RaincheckConfig(policy="raincheck", retention=ret, pruning=sel, chunk_size=chunk,
                              guard_tokens=args.guard_tokens, completion=args.completion, visibility=vis,
                              completion_chunk_size=args.completion_chunk_size)
        grid.append((("raincheck", sel, ret, chunk, vis), cfg))
    policies = getattr(args, "policies", None) or POLICIES
    return [(k, cfg) for k, cfg in grid if k[0] in policies]


def missing_baselines(grid):
    """The Full / Hard runs that a summary of ``grid`` needs and that it lacks (a ``--policies`` part of a grid)."""
    keys = {k for k, _ in grid}
    need = [("full", None, None, None, None)] + [("hard", k[1], k[2], None, None) for k in keys if k[0] == "raincheck"]
    return [k for k in dict.fromkeys(need) if k not in keys]


# ------------------------------------------------------------------------------------------------------------------
# workers
# ------------------------------------------------------------------------------------------------------------------

_WORKER = {}


def _load(args):
    if (gdn_kernels(args) == "torch" and "transformers.models.qwen3_5" not in sys.modules
            and "fla" not in sys.modules and importlib.util.find_spec("fla") is not None):
        # transformers' Qwen3.5 GDN layers call fla-core's Triton kernels whenever fla imports, also on CPU tensors
        # (they fail there: no active Triton driver); a CPU run on a machine that has fla, or --gdn-kernels torch,
        # takes the torch path (transformers' and the package's own)
        sys.modules.setdefault("fla", None)
    from hf_raincheck import enable_raincheck
    from hf_raincheck.gridqa import load_default

    torch.set_num_threads(args.threads)
    model, processor = load_default(args.arch, path=args.model, device=args.device)
    if any(k[0] != "full" for k, _ in config_grid(args)):
        enable_raincheck(model)
    return model, processor


def gdn_kernels(args) -> str:
    """The Gated DeltaNet kernels a run uses: ``"fla"`` (fla-core's Triton kernels, CUDA only, when installed) or
    ``"torch"`` (transformers' torch code and the package's reference paths)."""
    if args.gdn_kernels == "torch" or not str(args.device).startswith("cuda"):
        return "torch"
    return "fla" if importlib.util.find_spec("fla") is not None else "torch"


def _init_worker(args):
    _WORKER["args"] = args
    _WORKER["model"], _WORKER["processor"] = _load(args)
    _WORKER["grid"] = config_grid(args)


def _run_index(index):
    from hf_raincheck.gridqa import task

    args, model, processor, grid = _WORKER["args"], _WORKER["model"], _WORKER["processor"], _WORKER["grid"]
    dialogue = task.make_dialogue(index, "test")
    image = dialogue.image()
    gold_len = [len(processor.tokenizer.encode(t.answer, add_special_tokens=False)) for t in dialogue.turns]
    result = {"index": index, "kinds": [t.kind for t in dialogue.turns], "gold_tokens": gold_len, "runs": {}}
    with torch.no_grad():
        for key, cfg in grid:
            t0 = time.perf_counter()
            turns, stats = play(model, processor, dialogue, cfg, args.max_new_tokens, image=image,
                                preempt_s=args.preempt_ms / 1000.0)
            result["runs"][json.dumps(key)] = {
                "correct": [c for _, c, _ in turns],
                "tokens": [n for _, _, n in turns],
                "answers": [a for a, _, _ in turns],
                "stats": stats,
                "seconds": time.perf_counter() - t0,
            }
    return result


# ------------------------------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------------------------------


def _acc(matrix, turn_cols, idx):
    """Pooled accuracy over dialogues ``idx`` (rows) and turn columns; NaN entries (missing turns) skipped."""
    sub = matrix[np.ix_(idx, turn_cols)] if idx is not None else matrix[:, turn_cols]
    return np.nanmean(sub) if np.isfinite(sub).any() else np.nan


def _boot(matrices, turn_cols, rows, n_boot, rng):
    """Bootstrap accuracies ``[n_boot, len(matrices)]`` over the dialogues in ``rows``."""
    rows = np.asarray(rows)
    out = np.empty((n_boot, len(matrices)))
    stacked = np.stack([m[np.ix_(rows, turn_cols)] for m in matrices])  # [M, D, T]
    valid = np.isfinite(stacked[0])
    vals = np.nan_to_num(stacked)
    for b in range(n_boot):
        pick = rng.integers(0, len(rows), len(rows))
        count = valid[pick].sum()
        out[b] = vals[:, pick].sum(axis=(1, 2)) / max(count, 1) if count else np.nan
    return out


def turn1_subsets(results, guard_tokens):
    """Dialogue rows of each turn-1 subset: ``long`` (reference answer longer than ``guard_tokens`` tokens: only
    there can tokens restored during decoding change the answer), ``named_cells`` / ``line`` (the question names
    its cells / walks a row or column in source order: `hf_raincheck.gridqa.task.NAMED_CELL_KINDS`,
    ``LINE_KINDS``) and ``kind=<kind>`` for every first-question kind present."""
    from hf_raincheck.gridqa import task

    first = np.array([r["kinds"][0] for r in results])
    out = {"long": np.flatnonzero([r["gold_tokens"][0] > guard_tokens for r in results]),
           "named_cells": np.flatnonzero(np.isin(first, task.NAMED_CELL_KINDS)),
           "line": np.flatnonzero(np.isin(first, task.LINE_KINDS))}
    for kind in task.QUESTION_KINDS:
        out[f"kind={kind}"] = np.flatnonzero(first == kind)
    return {k: v for k, v in out.items() if len(v)}


def summarize(results, grid, args):
    keys = [k for k, _ in grid]
    n = len(results)
    # correctness matrices [D, 4] (NaN: the dialogue has no such turn)
    mats = {}
    for k in keys:
        m = np.full((n, 4), np.nan)
        for i, r in enumerate(results):
            c = r["runs"][json.dumps(k)]["correct"]
            m[i, : len(c)] = c
        mats[k] = m
    full = ("full", None, None, None, None)
    # answers equal to Full's, per turn (NaN: no such turn, or answers not stored)
    same = {}
    for k in keys:
        m = np.full((n, 4), np.nan)
        for i, r in enumerate(results):
            mine, ref = r["runs"][json.dumps(k)].get("answers"), r["runs"][json.dumps(full)].get("answers")
            if mine is not None and ref is not None:
                m[i, : len(mine)] = [a == b for a, b in zip(mine, ref)]
        same[k] = m
    # ... and only where every earlier answer equals Full's too (the same history: what restoration decides, apart
    # from a different turn-1 answer carried into the conversation)
    same_history = {}
    for k in keys:
        m = same[k].copy()
        earlier = np.ones(n, dtype=bool)
        for t in range(4):
            m[~earlier, t] = np.nan
            earlier &= np.nan_to_num(same[k][:, t], nan=1.0) == 1.0
        same_history[k] = m
    rng = np.random.default_rng(args.seed)
    records = []
    turn_sets = [(str(t + 1), [t], None, None) for t in range(4)] + [("2+", [1, 2, 3], None, None)]
    for subset, rows in turn1_subsets(results, args.guard_tokens).items():
        turn_sets.append(("1", [0], subset, rows))
    for label, cols, subset, rows in turn_sets:
        rows = np.arange(n) if rows is None else rows
        if not len(rows) or not np.isfinite(mats[full][np.ix_(rows, cols)]).any():
            continue
        boot_keys = keys
        boots = _boot([mats[k] for k in boot_keys], cols, rows, args.bootstrap, rng)
        index = {k: i for i, k in enumerate(boot_keys)}
        count = int(np.isfinite(mats[full][np.ix_(rows, cols)]).sum())
        for k in keys:
            policy, sel, ret, chunk, vis = k
            acc = float(_acc(mats[k], cols, rows))
            lo, hi = np.nanpercentile(boots[:, index[k]], [2.5, 97.5])
            rec = {
                "arch": args.arch, "policy": policy, "selector": sel, "retention": ret, "chunk_size": chunk,
                "visibility": vis, "guard_tokens": args.guard_tokens if policy == "raincheck" else None,
                "completion": args.completion if policy == "raincheck" else None,
                "turn": label, "subset": subset or "all", "accuracy": acc, "n": count,
                "accuracy_ci95": [float(lo), float(hi)],
            }
            if policy != "full" and np.isfinite(same[k][np.ix_(rows, cols)]).any():
                rec["same_as_full"] = float(np.nanmean(same[k][np.ix_(rows, cols)]))
                sub = same_history[k][np.ix_(rows, cols)]
                if np.isfinite(sub).any():
                    rec["same_as_full_same_history"] = float(np.nanmean(sub))
                    rec["n_same_history"] = int(np.isfinite(sub).sum())
            if policy == "raincheck":
                hard = ("hard", sel, ret, None, None)
                f, h = float(_acc(mats[full], cols, rows)), float(_acc(mats[hard], cols, rows))
                rec["recovered"] = (acc - h) / (f - h) if f != h else None
                bf, bh, br = boots[:, index[full]], boots[:, index[hard]], boots[:, index[k]]
                denom = bf - bh
                ok = np.abs(denom) > 1e-12
                ratio = (br[ok] - bh[ok]) / denom[ok]
                rec["recovered_ci95"] = [float(x) for x in np.percentile(ratio, [2.5, 97.5])] if ok.any() else None
                rec["recovered_defined"] = float(ok.mean())
                rec["loss_hard"] = f - h
            records.append(rec)
    restore = {}
    timing = {}
    for k in keys:
        runs = [r["runs"][json.dumps(k)] for r in results]
        timing[json.dumps(k)] = float(np.mean([x["seconds"] for x in runs]))
        if k[0] == "raincheck":
            restore[json.dumps(k)] = {
                s: float(np.mean([x["stats"][s] for x in runs])) for s in ("during_decode", "after_answer", "during_prefill")
            }
    return records, restore, timing


def markdown(records, arch):
    def get(policy, sel, ret, chunk, vis, turn, subset="all"):
        for r in records:
            if (r["policy"], r["selector"], r["retention"], r["chunk_size"], r["visibility"], r["turn"],
                    r["subset"]) == (policy, sel, ret, chunk, vis, turn, subset):
                return r
        return None

    full1, full2 = get("full", None, None, None, None, "1"), get("full", None, None, None, None, "2+")
    lines = [
        f"arch {arch}: Full accuracy turn 1 {full1['accuracy']:.3f}, turns 2+ {full2['accuracy']:.3f} "
        f"(n {full1['n']} / {full2['n']})",
        "",
        "| selector | retention | chunk | visibility | hard t1 | raincheck t1 | hard t2+ | raincheck t2+ | "
        "recovered t2+ [95% CI] | recovered t1 long-answer [95% CI] |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def fmt(rec):
        if rec is None or rec.get("recovered") is None:
            return "n/a"
        ci = rec.get("recovered_ci95")
        return f"{rec['recovered']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else f"{rec['recovered']:.2f}"

    for r in records:
        if r["policy"] != "raincheck" or r["turn"] != "1" or r["subset"] != "all":
            continue
        sel, ret, chunk, vis = r["selector"], r["retention"], r["chunk_size"], r["visibility"]
        h1, h2 = get("hard", sel, ret, None, None, "1"), get("hard", sel, ret, None, None, "2+")
        r2 = get("raincheck", sel, ret, chunk, vis, "2+")
        rl = get("raincheck", sel, ret, chunk, vis, "1", "long")
        lines.append(
            f"| {sel} | {ret} | {chunk} | {vis} | {h1['accuracy']:.3f} | {r['accuracy']:.3f} | "
            f"{h2['accuracy']:.3f} | {r2['accuracy']:.3f} | {fmt(r2)} | {fmt(rl)} |"
        )
    subsets = list(dict.fromkeys(r["subset"] for r in records if r["turn"] == "1" and r["subset"] != "all"))
    lines += ["", "turn 1 by question: accuracy (n); Raincheck at each selector's first chunk / boundary; "
              "t2+ same: share of Raincheck's later answers equal to Full's (all; where every earlier answer was "
              "equal too)", "",
              "| selector | retention | subset | n | full | hard | raincheck | recovered | raincheck t2+ same |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        if r["policy"] != "hard" or r["turn"] != "1" or r["subset"] != "all":
            continue
        sel, ret = r["selector"], r["retention"]
        rain = [x for x in records if x["policy"] == "raincheck" and x["selector"] == sel and x["retention"] == ret
                and x["visibility"] == "boundary"]
        if not rain:
            continue
        chunk = rain[0]["chunk_size"]
        later = get("raincheck", sel, ret, chunk, "boundary", "2+")
        for subset in ["all", *subsets]:
            f, h = get("full", None, None, None, None, "1", subset), get("hard", sel, ret, None, None, "1", subset)
            rc = get("raincheck", sel, ret, chunk, "boundary", "1", subset)
            if f is None or h is None or rc is None:
                continue
            same = ""
            if later is not None and subset == "all" and "same_as_full" in later:
                same = f"{later['same_as_full']:.3f}"
                if "same_as_full_same_history" in later:
                    same += f"; {later['same_as_full_same_history']:.3f} (n {later['n_same_history']})"
            lines.append(f"| {sel} | {ret} | {subset} | {f['n']} | {f['accuracy']:.3f} | {h['accuracy']:.3f} | "
                         f"{rc['accuracy']:.3f} | {fmt(rc)} | {same} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------------
# results files: --save-results (append, resume) and --merge
# ------------------------------------------------------------------------------------------------------------------

# what a resumed run must share with its results file (the grid covers selectors, retentions, chunks, causal_* and
# policies); a merge needs all but the grid (parts of several grids merge into their union); torch / transformers /
# device may differ between machines (a merge reports every value)
MATCH_FIELDS = ("arch", "model", "grid", "guard_tokens", "completion", "max_new_tokens")
MERGE_FIELDS = tuple(f for f in MATCH_FIELDS if f != "grid")
# the arguments a merge rebuilds the grid and the summary from
HEADER_ARGS = ("selectors", "retentions", "chunks", "causal_retentions", "causal_chunks", "policies", "guard_tokens",
               "completion", "preempt_ms", "completion_chunk_size", "max_new_tokens", "bootstrap", "seed",
               "keep_answers", "quick", "start", "dialogues")
# the grid's arguments: parts of other grids (--policies, other chunks, ...) merge into the union of their grids
GRID_ARGS = ("selectors", "retentions", "chunks", "causal_retentions", "causal_chunks", "policies")


def _command(argv):
    return "python benchmarks/quality.py " + " ".join(argv if argv is not None else sys.argv[1:])


def _grid_keys(grid):
    """The grid's keys as they come back from JSON (lists, not tuples)."""
    return json.loads(json.dumps([k for k, _ in grid]))


def results_header(args, grid, command):
    """The first line of a ``--save-results`` file: ``MATCH_FIELDS``, versions, device, command and ``HEADER_ARGS``."""
    import transformers

    return {
        "arch": args.arch, "model": args.model, "grid": _grid_keys(grid), "guard_tokens": args.guard_tokens,
        "completion": args.completion, "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
        "transformers": transformers.__version__, "device": args.device, "gdn_kernels": gdn_kernels(args),
        "command": command,
        "args": {k: getattr(args, k) for k in HEADER_ARGS},
    }


def _mismatch(a, b, a_name, b_name, fields=MATCH_FIELDS):
    """None if headers ``a`` and ``b`` agree on ``fields``, else a sentence naming the first differing field."""
    for field in fields:
        x, y = a.get(field), b.get(field)
        if x == y:
            continue
        if field == "grid":
            only_a = [k for k in x if k not in y]
            only_b = [k for k in y if k not in x]
            what = "the same configurations, in another order"
            if only_a or only_b:
                what = (f"{len(only_a)} configurations only in {a_name} (e.g. {only_a[:3]}), {len(only_b)} only in "
                        f"{b_name} (e.g. {only_b[:3]})")
            return f"'grid' differs (selectors / retentions / chunks / causal_*): {what}"
        return f"'{field}' differs: {x!r} in {a_name}, {y!r} in {b_name}"
    return None


def read_results(path, repair=False):
    """``(header or None, [result, ...])`` of a ``--save-results`` file (``.gz``: gzip-compressed, read only, as
    the committed parts in ``benchmarks/results/quality_parts``). A last line cut off by a killed run is dropped;
    with ``repair`` also from the file, so that appending starts on a fresh line."""
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
        data = f.read()
    header, results, pos, end, number = None, [], 0, 0, 0
    while pos < len(data):
        number += 1
        newline = data.find(b"\n", pos)
        last = newline < 0
        line = data[pos:] if last else data[pos:newline]
        try:
            obj = json.loads(line) if line.strip() else None
        except ValueError:
            if not last:
                raise SystemExit(f"{path}: line {number} is not JSON") from None
            print(f"{path}: its last line is cut off (a killed run), dropped", flush=True)
            break
        pos = end = len(data) if last else newline + 1
        if obj is None:
            continue
        if header is None:
            if not (isinstance(obj, dict) and "header" in obj):
                raise SystemExit(f"{path}: the first line is not a header (not a --save-results file)")
            header = obj["header"]
        elif isinstance(obj, dict) and "index" in obj and "runs" in obj:
            results.append(obj)
        else:
            raise SystemExit(f"{path}: line {number} is not a dialogue result")
    if repair and (end < len(data) or (end and not data[:end].endswith(b"\n"))):
        with open(path, "r+b") as f:
            f.seek(end)
            f.truncate()
            if end and not data[:end].endswith(b"\n"):
                f.write(b"\n")
    return header, results


def open_results(path, header):
    """Opens ``path`` to append results under ``header``, after the results already there (checked to come from the
    same configuration); returns ``(file, {index: result already there})``."""
    done = {}
    if os.path.exists(path) and os.path.getsize(path) > 0:
        old, results = read_results(path, repair=True)
        if old is not None:
            problem = _mismatch(old, header, path, "this run")
            if problem:
                raise SystemExit(f"--save-results {path} holds another configuration: {problem} (its command: "
                                 f"{old.get('command')}); use another path")
            for field in ("torch", "transformers", "device", "gdn_kernels"):
                if old.get(field) != header[field]:
                    print(f"note: {path} was started with {field} {old.get(field)!r}, this run has {header[field]!r}",
                          flush=True)
            for r in results:
                done.setdefault(r["index"], r)
            return open(path, "a", encoding="utf-8"), done
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sink = open(path, "w", encoding="utf-8")
    sink.write(json.dumps({"header": header}) + "\n")
    sink.flush()
    return sink, done


def _same_run(a, b):
    """Two runs of one (dialogue, configuration): equal apart from the timing (and the answers, unless both kept
    them)."""
    answers = a.get("answers") is not None and b.get("answers") is not None
    return ({f: v for f, v in a.items() if f != "seconds" and (answers or f != "answers")}
            == {f: v for f, v in b.items() if f != "seconds" and (answers or f != "answers")})


def merge_results(files):
    """``(headers, results sorted by index, parts)`` of read ``--save-results`` files ``[(path, header, results)]``:
    their headers must agree on ``MERGE_FIELDS`` (their grids may differ); a dialogue's runs are the union of its
    runs in every file, and a (dialogue, configuration) in several files must have the same result in each (it is
    kept once)."""
    headers, by_index, where, parts = [], {}, {}, []
    paths = [path for path, _, _ in files]
    for path, header, results in files:
        if headers:
            problem = _mismatch(headers[0], header, paths[0], path, fields=MERGE_FIELDS)
            if problem:
                raise SystemExit(f"cannot merge {paths[0]} and {path}: {problem}")
        headers.append(header)
        for r in results:
            i = r["index"]
            if i not in by_index:
                by_index[i], where[i] = {**r, "runs": dict(r["runs"])}, path
                continue
            have = by_index[i]
            same = all(have.get(f) == r.get(f) for f in ("kinds", "gold_tokens"))
            for key, run in r["runs"].items():
                if key not in have["runs"]:
                    have["runs"][key] = run
                elif not _same_run(have["runs"][key], run):
                    same = False
            if not same:
                raise SystemExit(f"dialogue {i} is in {where[i]} and in {path} with different results")
        parts.append({"path": os.path.basename(path), "command": header.get("command"), "dialogues": len(results),
                      "configurations": len(header["grid"])})
    if not by_index:
        raise SystemExit(f"no dialogue results in {' '.join(paths)}")
    return headers, [by_index[i] for i in sorted(by_index)], parts


def _ranges(indices):
    """Sorted indices as ``[[first, last], ...]`` runs of consecutive ones."""
    out = []
    for i in sorted(indices):
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def _one_or_all(values):
    distinct = list(dict.fromkeys(values))
    return distinct[0] if len(distinct) == 1 else distinct


# ------------------------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------------------------


def _meta(args, results, command, wall, **extra):
    import transformers

    meta = {
        "command": command,
        "arch": args.arch, "model": args.model or f"hf_raincheck/assets (load_default('{args.arch}'))",
        "dialogues": len(results), "split": "test", "start": min(r["index"] for r in results),
        "indices": _ranges(r["index"] for r in results), "selectors": args.selectors,
        "retentions": args.retentions, "chunks": args.chunks, "causal_retentions": args.causal_retentions,
        "causal_chunks": args.causal_chunks, "guard_tokens": args.guard_tokens, "completion": args.completion,
        "max_new_tokens": args.max_new_tokens, "bootstrap": args.bootstrap, "device": args.device,
        "gdn_kernels": gdn_kernels(args), "torch": torch.__version__, "transformers": transformers.__version__,
        "wall_s": None if wall is None else round(wall, 1),
        # the time of every (dialogue, configuration) run, summed: comparable between whole, resumed and merged runs
        "cpu_s": round(sum(run["seconds"] for r in results for run in r["runs"].values()), 1),
        "jobs": args.jobs,
    }
    meta.update(extra)
    return meta


def write_outputs(results, grid, args, meta):
    """Summarises ``results`` (sorted by index) into ``args.out`` (this arch's part of it) and prints the table."""
    records, restore, timing = summarize(results, grid, args)
    payload = {"meta": meta, "records": records, "restored_mean": restore, "seconds_per_dialogue": timing}
    if args.keep_answers:
        payload["dialogues"] = results
    # several archs share one results file: replace this arch's part, keep the others'
    existing = {}
    if os.path.exists(args.out):
        try:
            with open(args.out, encoding="utf-8") as f:
                existing = json.load(f)
        except (OSError, ValueError):
            existing = {}
    if "runs" not in existing:
        existing = {"runs": {}}
    existing["runs"][args.arch] = payload
    existing["records"] = [r for run in existing["runs"].values() for r in run["records"]]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(existing, f, indent=1)
        f.write("\n")
    print(markdown(records, args.arch))
    took = f"in {meta['wall_s']:.0f}s" if meta["wall_s"] is not None else f"merged ({meta['cpu_s']:.0f}s of runs)"
    print(f"\n{len(results)} dialogues x {len(grid)} configurations {took} -> {args.out}")
    return payload


# ------------------------------------------------------------------------------------------------------------------


def default_out(args) -> str:
    """``benchmarks/results/quality.json`` (``quality_quick.json`` for ``--quick``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "results", "quality_quick.json" if args.quick else "quality.json")


def merge(args, argv):
    """``--merge``: no model runs; the parts' results summarised like one run of their grid, one summary per
    architecture (parts of both can be given at once: each arch's part of ``--out`` is written from its files)."""
    by_arch = {}
    for path in args.merge:
        header, results = read_results(path)
        if header is None:
            raise SystemExit(f"{path}: empty, no header line")
        by_arch.setdefault(header["arch"], []).append((path, header, results))
    for files in by_arch.values():
        merge_arch(argparse.Namespace(**{**vars(args), "merge": [path for path, _, _ in files]}), argv, files)
    return 0


def merge_arch(args, argv, files):
    """``--merge`` of one architecture's parts (``[(path, header, results)]``, as read)."""
    headers, results, parts = merge_results(files)
    head = headers[0]
    explicit = {"bootstrap": args.bootstrap, "seed": args.seed}
    args.arch, args.model = head["arch"], head["model"]
    for path, h in zip(args.merge, headers):
        part_args = argparse.Namespace(**{**vars(args), "policies": list(POLICIES), **h["args"]})
        if _grid_keys(config_grid(part_args)) != h["grid"]:
            raise SystemExit(f"the grid rebuilt from {path}'s arguments is not the grid it was run with "
                             "(config_grid changed since?)")
    for k, v in head["args"].items():
        setattr(args, k, v)
    for k, v in explicit.items():
        if v is not None:
            setattr(args, k, v)
        elif len({json.dumps(h["args"].get(k)) for h in headers}) > 1:
            print(f"note: the parts differ in --{k}; the first's ({getattr(args, k)}) is used", flush=True)
    args.keep_answers = all(h["args"].get("keep_answers") for h in headers)
    # the union of the parts' grids, in the order one run of the union's arguments would have
    for k in GRID_ARGS:
        values = [v for h in headers for v in (h["args"].get(k, list(POLICIES) if k == "policies" else []) or [])]
        setattr(args, k, list(dict.fromkeys(values)))
    union = {json.dumps(k) for h in headers for k in h["grid"]}
    grid = [(k, cfg) for k, cfg in config_grid(args) if json.dumps(k) in union]
    if len(grid) != len(union):
        raise SystemExit("the parts' grids together are not part of one grid (config_grid changed since?)")
    baselines = missing_baselines(grid)
    if baselines:
        raise SystemExit(f"the merged grid lacks the Full / Hard runs {baselines} that a summary needs: merge a part "
                         "that has them")
    complete = [r for r in results if set(r["runs"]) >= union]
    if len(complete) < len(results):
        lacking = [r["index"] for r in results if not set(r["runs"]) >= union]
        print(f"WARNING: {len(lacking)} dialogues lack a run of some configuration of the merged grid and are left "
              f"out: {_ranges(lacking)}; summarised over the {len(complete)} that have every one", flush=True)
    if not complete:
        raise SystemExit("no dialogue has a run of every configuration of the merged grid")
    results = [{**r, "runs": {json.dumps(k): r["runs"][json.dumps(k)] for k, _ in grid}} for r in complete]
    indices = [r["index"] for r in results]
    ranges = _ranges(indices)
    if len(ranges) > 1:
        gaps = [[a[1] + 1, b[0] - 1] for a, b in zip(ranges, ranges[1:])]
        print(f"WARNING: the merged dialogues are not one contiguous range: {ranges} (missing {gaps})", flush=True)
    args.out = args.out or default_out(args)
    args.device = _one_or_all(h["device"] for h in headers)
    print(f"{len(grid)} configurations x {len(results)} dialogues ({args.arch}) merged from {len(parts)} files",
          flush=True)
    meta = _meta(args, results, [_command(argv)] + [p["command"] for p in parts], None, jobs=None,
                 torch=_one_or_all(h["torch"] for h in headers),
                 gdn_kernels=_one_or_all(h.get("gdn_kernels", "torch" if h["device"] == "cpu" else None)
                                         for h in headers),
                 transformers=_one_or_all(h["transformers"] for h in headers), parts=parts)
    write_outputs(results, grid, args, meta)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3_vl", choices=["qwen3_vl", "qwen3_5"])
    parser.add_argument("--model", default=None, help="checkpoint path (default: the shipped one of --arch)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dialogues", type=int, default=500)
    parser.add_argument("--start", type=int, default=0, help="first held-out dialogue index")
    parser.add_argument("--selectors", nargs="+", default=list(ALL_SELECTORS))
    parser.add_argument("--retentions", nargs="+", type=float, default=[0.3, 0.5, 0.7])
    parser.add_argument("--chunks", nargs="+", type=int, default=[7, 15, 31])
    parser.add_argument("--causal-retentions", nargs="*", type=float, default=[0.3])
    parser.add_argument("--causal-chunks", nargs="*", type=int, default=[31])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES,
                        help="run only these policies' configurations: a part of a grid (with --save-results; "
                             "--merge it with a part that has the Full / Hard runs)")
    parser.add_argument("--guard-tokens", type=int, default=16)
    parser.add_argument("--completion", default="blocking", choices=["blocking", "next_turn", "background"],
                        help="what happens to deferred tokens pending when an answer ends; next_turn: the next "
                             "question arrives at once and its prefill folds them in; background: a worker restores "
                             "them and the next question preempts it at a random point (--preempt-ms)")
    parser.add_argument("--preempt-ms", type=float, default=20.0,
                        help="background: the next question arrives uniformly in [0, this) ms after the answer")
    parser.add_argument("--completion-chunk-size", type=int, default=8,
                        help="background: deferred tokens per worker step (small: many points to be preempted at)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--bootstrap", type=int, default=None,
                        help="bootstrap resamples (default 1000; --quick: 200; --merge: the first part's)")
    parser.add_argument("--seed", type=int, default=None, help="bootstrap seed (default 0; --merge: the first part's)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (dialogues in parallel)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--gdn-kernels", default="auto", choices=["auto", "torch"],
                        help="Qwen3.5's Gated DeltaNet kernels: auto = fla-core's on CUDA when installed, else "
                             "torch; torch = transformers' torch code everywhere (also on CUDA)")
    parser.add_argument("--keep-answers", action="store_true", help="store every answer in the JSON")
    parser.add_argument("--quick", action="store_true",
                        help="8 dialogues, selectors uniform + mmtok, retention 0.3, chunk 31, both visibilities")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/quality.json; "
                                                     "--quick: benchmarks/results/quality_quick.json)")
    parser.add_argument("--save-results", metavar="PATH", default=None,
                        help="JSON-lines file: a header, then every dialogue's results as soon as it finishes "
                             "(a killed run keeps them); if PATH exists (same configuration), its dialogues are "
                             "skipped: the run resumes")
    parser.add_argument("--merge", nargs="+", metavar="PATH", default=None,
                        help="run nothing: summarise --save-results files of one grid (parts run on several "
                             "machines) into --out like one run")
    args = parser.parse_args(argv)
    if args.merge:
        if args.save_results:
            parser.error("--merge and --save-results exclude each other")
        return merge(args, argv)
    if args.save_results and args.save_results.endswith(".gz"):
        parser.error(f"--save-results {args.save_results}: a run appends to a plain JSON-lines file; compress it "
                     "(gzip) after the run, --merge reads .gz")
    args.bootstrap = 1000 if args.bootstrap is None else args.bootstrap
    args.seed = 0 if args.seed is None else args.seed
    if args.quick:
        args.dialogues = min(args.dialogues, 8) if "--dialogues" in (argv or sys.argv) else 8
        args.selectors = ["uniform", "mmtok"] if "--selectors" not in (argv or sys.argv) else args.selectors
        args.retentions, args.chunks = [0.3], [31]
        args.causal_retentions, args.causal_chunks = [0.3], [31]
        args.bootstrap = min(args.bootstrap, 200)
    args.out = args.out or default_out(args)

    grid = config_grid(args)
    if not grid:
        parser.error(f"--policies {' '.join(args.policies)}: no configuration of the grid is left")
    baselines = missing_baselines(grid)
    if baselines and not args.save_results:
        parser.error(f"--policies {' '.join(args.policies)} leaves out runs that a summary needs ({baselines}): "
                     "give --save-results and --merge the file with a part that has them")
    indices = list(range(args.start, args.start + args.dialogues))
    command = _command(argv)
    sink, done = (None, {}) if not args.save_results else open_results(args.save_results,
                                                                        results_header(args, grid, command))
    todo = [i for i in indices if i not in done]
    if args.save_results:
        print(f"{args.save_results}: {len(indices) - len(todo)} of the {len(indices)} dialogues already there, "
              f"skipped", flush=True)
        others = len(set(done) - set(indices))
        if others:
            print(f"  ({others} more dialogues there, outside --start / --dialogues, are left out here)", flush=True)
    print(f"{len(grid)} configurations x {len(todo)} dialogues ({args.arch}, {args.jobs} jobs)", flush=True)
    t0 = time.perf_counter()
    results = [done[i] for i in indices if i in done]
    step = max(1, len(todo) // 10)

    def finished(k, r):
        results.append(r)
        if sink is not None:
            sink.write(json.dumps(r) + "\n")
            sink.flush()
        if (k + 1) % step == 0:
            print(f"  {k + 1}/{len(todo)} dialogues, {time.perf_counter() - t0:.0f}s", flush=True)

    restore_sigterm = _exit_on_sigterm()
    try:
        if todo and args.jobs > 1:
            import multiprocessing as mp

            jobs = min(args.jobs, len(todo))
            with mp.get_context("spawn").Pool(jobs, initializer=_init_worker, initargs=(args,)) as pool:
                for k, r in enumerate(pool.imap_unordered(_run_index, todo)):
                    finished(k, r)
        elif todo:
            _init_worker(args)
            for k, i in enumerate(todo):
                finished(k, _run_index(i))
    finally:
        if sink is not None:
            sink.close()
        restore_sigterm()
    wall = time.perf_counter() - t0
    results.sort(key=lambda r: r["index"])
    extra = {"save_results": args.save_results, "resumed": len(indices) - len(todo)} if args.save_results else {}
    if baselines:
        print(f"{len(results)} dialogues x {len(grid)} configurations in {wall:.0f}s -> {args.save_results} (a part "
              f"without {baselines}: no summary; --merge it with a part that has them)", flush=True)
        return 0
    write_outputs(results, grid, args, _meta(args, results, command, wall, **extra))
    return 0


def _exit_on_sigterm():
    """SIGTERM (``timeout``) -> SystemExit, so that the pool's workers are terminated too and the results file is
    closed; returns a function that puts the old handler back. A no-op outside the main thread."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)


if __name__ == "__main__":
    raise SystemExit(main())
