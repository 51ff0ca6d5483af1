"""Raincheck on a model split over several GPUs with an accelerate device_map (issue 10): same results as one GPU.

    python benchmarks/multi_gpu.py --device cuda --save        # two GPUs: both 8B-class shapes
    python benchmarks/multi_gpu.py --quick                     # tiny shapes on the CPU ("cpu" repeated), seconds

Policies: ``plain`` (transformers' own generate), then Full, Hard and Raincheck. Per model shape (random weights, bf16 on CUDA), two copies with the same weights (same seed; checked): one on
``cuda:0``, one dispatched by accelerate over ``cuda:0 .. cuda:{N-1}`` with ``shapes.split_device_map`` (the
device_map ``from_pretrained(device_map=...)`` would give at layer granularity: vision tower and embeddings on the
first GPU, the decoder layers in contiguous groups, norm and ``lm_head`` on the last). For each policy (Full, Hard,
Raincheck with blocking completion, Raincheck with ``completion="next_turn"`` and chunk 7, so that tokens are still pending when the
answer ends and fold into the next prefill), both copies answer the same 1024-token-image prompt (``--new-tokens`` greedy tokens) and then a
text-only second turn on the returned cache. Recorded per policy:

* ``same_tokens_turn1`` / ``same_tokens_turn2``: greedy tokens identical (``first_divergence_turn1``: where not);
* ``max_abs_logit_diff_turn1`` / ``_turn2`` (every step's logits) and ``next_turn_logit_diff`` (the second turn's
  first logits, the ones that see the whole image), with ``logit_scale`` (max |logit|) for scale;
* ``same_restore_stats``: the cache's restoration counters are equal;
* ``misplaced_tensors``: tensors of the cache after each turn (KV slots, deferred rows, GDN states and tail maps, every
  per-layer buffer) that are not on their decoder layer's execution device (must be 0);
* ``copies_decode_step`` / ``copies_fused_step``: memory copies by kind (``Memcpy PtoP`` = between GPUs) in one
  decode-only step and one fused (restoring) step of Raincheck on the split model (torch.profiler, CUDA only): the
  fused step must not add cross-device copies beyond those of a plain decode step.

The same comparisons run for one-GPU controls (``controls``): the reference run again (``rerun``), a second build
on the same GPU (``same_gpu_copy``) and a build moved whole to the last GPU (``other_gpu``): bf16 kernels need not
give bit-identical results for different buffer addresses, and random-weight logits are nearly flat, so greedy
tokens can part on a near-tie; the split is judged against what the controls show without any split.

Results: ``benchmarks/results/multi_gpu.json`` with ``--save``; the latency of the split model is measured by
``latency.py --gpus 1,2``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from latency import QUICK_WORKLOADS, WORKLOADS, Timer, copy_counts, placement_devices  # noqa: E402
from shapes import SHAPES, build_model, dispatch  # noqa: E402

import hf_raincheck  # noqa: E402
from hf_raincheck import RaincheckConfig, enable_raincheck  # noqa: E402
from hf_raincheck.config import parse_chunk_size  # noqa: E402
from hf_raincheck.conversation import cache_argument, output_cache  # noqa: E402
from hf_raincheck.models import get_adapter  # noqa: E402
from hf_raincheck.models.base import execution_device  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "multi_gpu.json")
QUESTION_TOKENS = 24


def policies(args) -> dict[str, RaincheckConfig | None]:
    rc = dict(retention=args.retention, chunk_size=args.chunk_size, guard_tokens=args.guard_tokens,
              pruning=args.pruning)
    return {
        "plain": None,  # transformers' own generate: what the model does without Raincheck
        "full": RaincheckConfig(policy="full", completion="blocking"),
        "hard": RaincheckConfig(policy="hard", retention=args.retention, pruning=args.pruning, completion="blocking"),
        "raincheck": RaincheckConfig(**rc, completion="blocking"),
        # small chunks: the answer ends with deferred rows pending, which turn 2's prefill folds in
        "raincheck_next_turn": RaincheckConfig(**dict(rc, chunk_size=args.next_turn_chunk), completion="next_turn"),
    }


def sync_all(devices) -> None:
    for device in dict.fromkeys(devices):
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)


def generate(model, inputs, n, cfg, past=None):
    extra = {} if cfg is None else dict(raincheck_config=cfg)
    with torch.no_grad():
        return model.generate(**inputs, **extra, **cache_argument(past), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, output_logits=True, return_dict_in_generate=True)


def second_turn(out, question: torch.Tensor) -> dict:
    ids = torch.cat([out.sequences, question.to(out.sequences.device)], dim=1)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def conversation(model, inputs, question, n, cfg) -> dict:
    """Turn 1 and a text-only turn 2 on its cache: tokens, logits (on the CPU, fp32), the cache, stats."""
    out1 = generate(model, inputs, n, cfg)
    wrong, checked = misplaced_tensors(model, output_cache(out1))  # while deferred rows may still be pending
    turn2 = second_turn(out1, question)
    out2 = generate(model, turn2, max(n // 4, 4), cfg, past=output_cache(out1))
    prompt1, prompt2 = inputs["input_ids"].shape[1], turn2["input_ids"].shape[1]
    cache = output_cache(out2)
    wrong2, checked2 = misplaced_tensors(model, cache)
    return dict(misplaced=wrong + wrong2, checked=checked + checked2,
        tokens1=out1.sequences[0, prompt1:].tolist(), tokens2=out2.sequences[0, prompt2:].tolist(),
        logits1=torch.stack(out1.logits).float().cpu(), logits2=torch.stack(out2.logits).float().cpu(),
        stats=dataclasses.asdict(cache.stats) if hasattr(cache, "stats") else None,
    )


def tensors_in(obj, depth: int = 3):
    """Tensors reachable from `obj` through attributes, lists, tuples and dicts (`depth` levels)."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth == 0 or obj is None or isinstance(obj, (str, int, float, bool)):
        return
    if isinstance(obj, dict):
        children = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    elif hasattr(obj, "__dict__"):
        children = vars(obj).values()
    else:
        return
    for child in children:
        yield from tensors_in(child, depth - 1)


def misplaced_tensors(model, cache) -> tuple[list[str], int]:
    """(``"what: shape on device (expected d)"`` for every per-layer tensor the cache holds off its layer's device,
    how many tensors were checked): KV slots (``cache.layers[i]``), GDN states and prefix states
    (``cache.gdn_states[i]``), and the deferred rows' DeepStack features (``plan.store_deepstack[k]`` belongs to
    decoder layer k); the deferred embeddings (``plan.store_embeds``) belong to the input device."""
    layers = model.model.language_model.layers
    adapter = get_adapter(model)
    owned = [(f"kv layer {i}", layer, i) for i, layer in enumerate(cache.layers)]
    owned += [(f"gdn layer {i}", state, i) for i, state in getattr(cache, "gdn_states", {}).items()]
    plan = getattr(cache, "plan", None)
    for k, rows in enumerate(getattr(plan, "store_deepstack", None) or []):
        owned.append((f"deepstack rows of layer {k}", rows, k))
    wrong, checked = [], 0
    for what, obj, i in owned + [("deferred embeddings", getattr(plan, "store_embeds", None), None)]:
        expected = adapter.input_device if i is None else execution_device(layers[i])
        for t in tensors_in(obj):
            if t.numel():
                checked += 1
                if t.device != expected:
                    wrong.append(f"{what}: {tuple(t.shape)} on {t.device} (expected {expected})")
    return wrong, checked


def step_copies(model, inputs, cfg, devices) -> dict[str, dict[str, int]]:
    """Memory copies by kind in decode step `guard` (decode only) and step `guard + 2` (fused) of Raincheck."""
    from torch.profiler import ProfilerActivity, profile

    steps = {"decode": cfg.guard_tokens, "fused": cfg.guard_tokens + 2}
    profilers = {}

    def hook(k):
        for name, step in steps.items():
            if k == step:
                profilers[name] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                profilers[name].start()
            elif k == step + 1 and name in profilers:
                profilers[name].stop()

    n = cfg.guard_tokens + 4
    cfg = dataclasses.replace(cfg, completion="next_turn")
    with torch.no_grad():
        model.generate(**inputs, raincheck_config=cfg, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       streamer=Timer(lambda: sync_all(devices), hook))
    return {name: copy_counts(prof) for name, prof in profilers.items()}


def weights_equal(a, b) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def compare(ref: dict, split: dict) -> dict:
    scale = ref["logits2"].abs().max().item()
    same1 = ref["tokens1"] == split["tokens1"]
    same2 = ref["tokens2"] == split["tokens2"]

    def diff(key):
        a, b = ref[key], split[key]
        return (a - b).abs().max().item() if a.shape == b.shape else None

    return dict(
        same_tokens_turn1=same1, same_tokens_turn2=same2,
        first_divergence_turn1=None if same1 else next(
            (i for i, (x, y) in enumerate(zip(ref["tokens1"], split["tokens1"])) if x != y), None),
        max_abs_logit_diff_turn1=diff("logits1"), max_abs_logit_diff_turn2=diff("logits2"),
        next_turn_logit_diff=(ref["logits2"][0] - split["logits2"][0]).abs().max().item(),
        logit_scale=scale, same_restore_stats=ref["stats"] == split["stats"], restore_stats=split["stats"],
    )


def on_device(inputs: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def copies_of(name: str, args, dtype, devices) -> dict:
    """The reference on the first device and the copies compared with it, all with the same weights: ``rerun``
    (the reference itself, run again), ``same_gpu_copy`` (a second build on the same GPU), ``other_gpu`` (a build
    moved whole to the last GPU; CUDA only), ``split`` (a build dispatched over `devices`)."""
    models = {"reference": build_model(name, devices[0], dtype)}
    models["same_gpu_copy"] = build_model(name, devices[0], dtype)
    if not weights_equal(models["reference"], models["same_gpu_copy"]):
        raise RuntimeError("two builds of the same seed have different weights")
    if args.device.startswith("cuda") and devices[-1] != devices[0]:
        models["other_gpu"] = build_model(name, devices[0], dtype).to(devices[-1])
    models["split"] = dispatch(build_model(name, devices[0], dtype), devices)
    models = {key: enable_raincheck(model) for key, model in models.items()}
    models["rerun"] = models["reference"]
    return models


def run_model(name: str, args, dtype) -> list[dict]:
    devices = placement_devices(args, args.gpus)
    t0 = time.perf_counter()
    models = copies_of(name, args, dtype, devices)
    ref, split = models["reference"], models["split"]
    layer_devices = [str(execution_device(layer)) for layer in split.model.language_model.layers]
    print(f"\n== {name}: {len(models) - 1} copies built in {time.perf_counter() - t0:.1f} s; split decoder layers "
          "per device: " + ", ".join(f"{d} x{layer_devices.count(d)}" for d in dict.fromkeys(layer_devices)),
          flush=True)
    workload = (QUICK_WORKLOADS if args.quick else WORKLOADS)[args.workload]
    inputs = workload.inputs(devices[0], dtype)
    question = torch.randint(0, 1000, (1, QUESTION_TOKENS), generator=torch.Generator().manual_seed(1))
    records = []
    for policy, cfg in policies(args).items():
        if policy not in args.policies:
            continue
        t1 = time.perf_counter()
        a = conversation(ref, inputs, question, args.new_tokens, cfg)
        comparisons = {}
        for key in ("rerun", "same_gpu_copy", "other_gpu", "split"):
            if key in models:
                model = models[key]
                b = conversation(model, on_device(inputs, get_adapter(model).input_device), question,
                                 args.new_tokens, cfg)
                comparisons[key] = dict(compare(a, b), cache_tensors_checked=b["checked"],
                                        misplaced_tensors=len(b["misplaced"]), misplaced_examples=b["misplaced"][:5])
        # the split copy's numbers at the top level; the one-GPU controls show what differs without any split
        record = dict(model=name, gpus=args.gpus, devices=devices, workload=args.workload, policy=policy,
                      new_tokens=args.new_tokens, **comparisons["split"], controls={
                          k: v for k, v in comparisons.items() if k != "split"})
        records.append(record)
        print(f"  {policy:20s} " + "; ".join(
            f"{key}: tokens {'same' if c['same_tokens_turn1'] and c['same_tokens_turn2'] else 'DIFFER'}"
            f" (t1 from {c['first_divergence_turn1']}), next-turn logit diff {c['next_turn_logit_diff']:.3g}"
            for key, c in comparisons.items())
            + f"; split stats {'same' if record['same_restore_stats'] else 'DIFFER'}, misplaced "
            f"{record['misplaced_tensors']} of {record['cache_tensors_checked']} ({time.perf_counter() - t1:.0f} s)",
            flush=True)
    if args.device.startswith("cuda"):
        copies = step_copies(split, inputs, policies(args)["raincheck"], devices)
        single = step_copies(ref, inputs, policies(args)["raincheck"], devices[:1])
        for record in records:
            if record["policy"] == "raincheck":
                record.update(copies_decode_step=copies.get("decode"), copies_fused_step=copies.get("fused"),
                              copies_one_gpu_decode_step=single.get("decode"),
                              copies_one_gpu_fused_step=single.get("fused"))
        print(f"  copies per step, split: decode {copies.get('decode')}, fused {copies.get('fused')}; one GPU: "
              f"decode {single.get('decode')}, fused {single.get('fused')}", flush=True)
    del ref, split, models
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return records


def markdown_table(records: list[dict]) -> str:
    def cell(c):
        same = c["same_tokens_turn1"] and c["same_tokens_turn2"]
        where = "" if same else f" (t1 from {c['first_divergence_turn1']})" if c["first_divergence_turn1"] is not None \
            else " (t2)"
        return f"{'same' if same else 'differ'}{where}, {c['next_turn_logit_diff']:.3g}"

    keys = [k for k in ("rerun", "same_gpu_copy", "other_gpu") if any(k in r["controls"] for r in records)]
    lines = ["| model | policy | split: tokens, next-turn logit diff | " + " | ".join(keys)
             + " | logit scale | split restore stats | misplaced / checked |",
             "| " + " | ".join(["---"] * (6 + len(keys))) + " |"]
    for r in records:
        lines.append(f"| {r['model']} | {r['policy']} | {cell(r)} | "
                     + " | ".join(cell(r["controls"][k]) if k in r["controls"] else "" for k in keys)
                     + f" | {r['logit_scale']:.3g} | {'same' if r['same_restore_stats'] else 'differ'} | "
                     f"{r['misplaced_tensors']} / {r['cache_tensors_checked']} |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (cpu repeated), seconds")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--models", default=None, help=f"comma list of {sorted(SHAPES)}")
    parser.add_argument("--gpus", type=int, default=2, help="GPUs to split each model over (default 2)")
    parser.add_argument("--workload", default="image1024", choices=sorted(WORKLOADS))
    parser.add_argument("--new-tokens", type=int, default=None, help="greedy tokens of turn 1 (64; --quick 20)")
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--chunk-size", type=parse_chunk_size, default="auto",
                        help="Raincheck's chunk size (default auto: the package's, 31; 63 for qwen3.5)")
    parser.add_argument("--guard-tokens", type=int, default=16)
    parser.add_argument("--next-turn-chunk", type=int, default=7, help="chunk of the next_turn policy (pending rows)")
    parser.add_argument("--pruning", default="mmtok")
    parser.add_argument("--policies", default="plain,full,hard,raincheck,raincheck_next_turn",
                        help="comma list of plain, full, hard, raincheck, raincheck_next_turn")
    parser.add_argument("--save", action="store_true", help=f"write {os.path.relpath(RESULTS)} (after each model)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    args.models = (args.models or ("tiny,tiny-qwen3.5" if args.quick else "qwen3-vl-8b,qwen3.5-9b")).split(",")
    args.new_tokens = args.new_tokens or (20 if args.quick else 64)
    args.policies = [p for p in args.policies.split(",") if p]
    allowed = ("plain", "full", "hard", "raincheck", "raincheck_next_turn")
    if not args.policies or any(p not in allowed for p in args.policies):
        parser.error(f"--policies: a comma list of {', '.join(allowed)}, got {args.policies}")
    unknown = [m for m in args.models if m not in SHAPES]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {sorted(SHAPES)}")
    available = torch.cuda.device_count() if args.device.startswith("cuda") else None
    if args.gpus < 2 or (available is not None and args.gpus > available):
        parser.error(f"--gpus: 2 to {available if available is not None else 'any'} GPUs, got {args.gpus}")
    if args.new_tokens < args.guard_tokens + 4:
        parser.error(f"--new-tokens must be at least guard + 4 = {args.guard_tokens + 4}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.quick:
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if cuda else torch.float32
    started = time.perf_counter()
    records = []
    for name in args.models:
        records += run_model(name, args, dtype)
        write(args, records, cuda, dtype, started)
    ok = write(args, records, cuda, dtype, started)
    print("\n" + markdown_table(records))
    print(f"\nsplit as one GPU (tokens equal, or differing where a one-GPU control differs too; same restore stats; "
          f"every per-layer tensor on its layer's device): {ok}; {time.perf_counter() - started:.0f} s")
    if args.save:
        print(f"wrote {args.out}")
    return 0 if ok else 1


def write(args, records, cuda, dtype, started) -> bool:
    """The verdict over `records`; with ``--save`` also the JSON (so a run cut short keeps its finished models)."""
    ok = all(r["same_restore_stats"] and r["misplaced_tensors"] == 0 and (
        (r["same_tokens_turn1"] and r["same_tokens_turn2"]) or not all(
            c["same_tokens_turn1"] and c["same_tokens_turn2"] for c in r["controls"].values()))
        for r in records)
    if args.save:
        head = dict(torch=torch.__version__, transformers=transformers.__version__,
                    hf_raincheck=hf_raincheck.__version__, gpu=torch.cuda.get_device_name() if cuda else None,
                    gpu_count=torch.cuda.device_count() if cuda else 0, dtype=str(dtype).replace("torch.", ""),
                    command=" ".join(sys.argv), date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                        timespec="seconds"), elapsed_s=round(time.perf_counter() - started, 1), split_as_one_gpu=ok)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(header=head, records=records), f, indent=1)
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
