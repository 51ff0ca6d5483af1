"""Answer quality of Full / Hard / Raincheck on held-out GridQA dialogues with the shipped tiny trained models.

    python benchmarks/quality.py --quick                              # small subset, < 1 minute on CPU
    python benchmarks/quality.py --arch qwen3_vl --dialogues 500 --jobs 16   # the whole grid (many cores)
    python benchmarks/quality.py --selectors mmtok uniform --retentions 0.3 --chunks 7 31 --dialogues 100

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
"""

from __future__ import annotations

import argparse
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


def play(model, processor, dialogue, config, max_new_tokens, image=None):
    """Plays a dialogue; returns per turn ``(answer, correct, answer_tokens)`` and restoration stats."""
    from hf_raincheck import complete_deferred
    from hf_raincheck.conversation import next_turn_inputs
    from hf_raincheck.gridqa import task

    image = image if image is not None else dialogue.image()
    out = cache = None
    turns = []
    for j, turn in enumerate(dialogue.turns):
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
            kwargs["past_key_values"] = cache
        if config is not None:
            kwargs["raincheck_config"] = config
        out = model.generate(**inputs, **kwargs)
        cache = out.past_key_values
        new = out.sequences[0, inputs["input_ids"].shape[1] :]
        answer = processor.decode(new, skip_special_tokens=True).strip()
        turns.append((answer, task.is_correct(answer, turn.answer), int(new.numel())))
    stats = None
    if config is not None and config.policy == "raincheck":
        if config.completion == "next_turn":
            complete_deferred(model, cache)  # the dialogue is over: count what was still pending
        s = cache.stats
        stats = {"during_decode": s.during_decode, "after_answer": s.after_answer, "during_prefill": s.during_prefill}
    return turns, stats


# ------------------------------------------------------------------------------------------------------------------
# the grid of configurations
# ------------------------------------------------------------------------------------------------------------------


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
                              guard_tokens=args.guard_tokens, completion=args.completion, visibility=vis)
        grid.append((("raincheck", sel, ret, chunk, vis), cfg))
    return grid


# ------------------------------------------------------------------------------------------------------------------
# workers
# ------------------------------------------------------------------------------------------------------------------

_WORKER = {}


def _load(args):
    from hf_raincheck import enable_raincheck
    from hf_raincheck.gridqa import load_default

    torch.set_num_threads(args.threads)
    model, processor = load_default(args.arch, path=args.model, device=args.device)
    if any(k[0] != "full" for k, _ in config_grid(args)):
        enable_raincheck(model)
    return model, processor


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
            turns, stats = play(model, processor, dialogue, cfg, args.max_new_tokens, image=image)
            result["runs"][json.dumps(key)] = {
                "correct": [c for _, c, _ in turns],
                "tokens": [n for _, _, n in turns],
                "answers": [a for a, _, _ in turns] if args.keep_answers else None,
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
    long_first = np.array([r["gold_tokens"][0] > args.guard_tokens for r in results])
    rng = np.random.default_rng(args.seed)
    records = []
    turn_sets = [(str(t + 1), [t], None) for t in range(4)] + [("2+", [1, 2, 3], None)]
    if long_first.any():
        turn_sets.append(("1", [0], "long"))
    full = ("full", None, None, None, None)
    for label, cols, subset in turn_sets:
        rows = np.flatnonzero(long_first) if subset == "long" else np.arange(n)
        if not np.isfinite(mats[full][np.ix_(rows, cols)]).any():
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
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------------


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
    parser.add_argument("--guard-tokens", type=int, default=16)
    parser.add_argument("--completion", default="blocking", choices=["blocking", "next_turn"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (dialogues in parallel)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--keep-answers", action="store_true", help="store every answer in the JSON")
    parser.add_argument("--quick", action="store_true",
                        help="8 dialogues, selectors uniform + mmtok, retention 0.3, chunk 31, both visibilities")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/quality.json; "
                                                     "--quick: benchmarks/results/quality_quick.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.dialogues = min(args.dialogues, 8) if "--dialogues" in (argv or sys.argv) else 8
        args.selectors = ["uniform", "mmtok"] if "--selectors" not in (argv or sys.argv) else args.selectors
        args.retentions, args.chunks = [0.3], [31]
        args.causal_retentions, args.causal_chunks = [0.3], [31]
        args.bootstrap = min(args.bootstrap, 200)
    here = os.path.dirname(os.path.abspath(__file__))
    if args.out is None:
        args.out = os.path.join(here, "results", "quality_quick.json" if args.quick else "quality.json")

    grid = config_grid(args)
    indices = list(range(args.start, args.start + args.dialogues))
    print(f"{len(grid)} configurations x {len(indices)} dialogues ({args.arch}, {args.jobs} jobs)", flush=True)
    t0 = time.perf_counter()
    results = []
    if args.jobs > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(args.jobs, initializer=_init_worker, initargs=(args,)) as pool:
            for k, r in enumerate(pool.imap(_run_index, indices)):
                results.append(r)
                if (k + 1) % max(1, len(indices) // 10) == 0:
                    print(f"  {k + 1}/{len(indices)} dialogues, {time.perf_counter() - t0:.0f}s", flush=True)
    else:
        _init_worker(args)
        for k, i in enumerate(indices):
            results.append(_run_index(i))
            if (k + 1) % max(1, len(indices) // 10) == 0:
                print(f"  {k + 1}/{len(indices)} dialogues, {time.perf_counter() - t0:.0f}s", flush=True)
    wall = time.perf_counter() - t0
    records, restore, timing = summarize(results, grid, args)
    import transformers

    meta = {
        "command": "python benchmarks/quality.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "arch": args.arch, "model": args.model or f"hf_raincheck/assets (load_default('{args.arch}'))",
        "dialogues": len(indices), "split": "test", "start": args.start, "selectors": args.selectors,
        "retentions": args.retentions, "chunks": args.chunks, "causal_retentions": args.causal_retentions,
        "causal_chunks": args.causal_chunks, "guard_tokens": args.guard_tokens, "completion": args.completion,
        "max_new_tokens": args.max_new_tokens, "bootstrap": args.bootstrap, "device": args.device,
        "torch": torch.__version__, "transformers": transformers.__version__, "wall_s": round(wall, 1),
        "jobs": args.jobs,
    }
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
    print(f"\n{len(indices)} dialogues x {len(grid)} configurations in {wall:.0f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
