"""Operators per eager step: what a decode step and a fused step of Raincheck run next to Full's and plain generate's.

    python benchmarks/step_ops.py                        # tiny Qwen3-VL and Qwen3.5 on the CPU, ~1 min
    python benchmarks/step_ops.py --save                 # also results/step_ops.json
    python benchmarks/step_ops.py --ops fused            # the operators of one fused step, by name
    python benchmarks/step_ops.py --batch-size 8 --save --out benchmarks/results/step_ops_b8.json   # a batch's steps

Eager (dynamic-cache) steps are host-bound on a GPU: each operator costs the host its dispatch (and, on a GPU,
most of them a kernel launch), whatever the rows. This counts, per model forward of a whole answer, the aten
operators that launch a kernel (torch.profiler on the CPU: the innermost aten operators that are not views,
shape queries or allocations; a matrix product or convolution counts as one, as on a GPU), the aten operators called
from Python, and the host-device synchronisations
(``_local_scalar_dense``: ``.item()``, ``int(tensor)``). Steps are classed as

* ``plain``: transformers' own generate (no ``raincheck_config``);
* ``full`` / ``hard``: the package's decode step with nothing deferred;
* ``raincheck, pending``: a decode-only step while deferred slots are still empty (before and between chunks);
* ``raincheck, fused``: a decode step carrying a deferred chunk;
* ``raincheck, restored``: a decode step after everything is restored.

``--batch-size B`` (> 1): one left-padded batch of B rows (each its own image and question length) in the shared
engine (`hf_raincheck.generation.shared_batch`); a step is one forward of the whole batch (fused: some row carries
deferred rows; pending / restored: a decode-only step while some row's plan is pending / after all are restored).

Tiny random models of `benchmarks/shapes.py` (``tiny``, ``tiny-qwen3.5``), bf16 as on a GPU (``--dtype``), a
256-token image; the counts
do not depend on the model's width, only on its layer count and kinds (4 layers: Qwen3.5's 3 GDN + 1 attention).
A call of the GDN kernel (`hf_raincheck.gdn_state.kernels.gated_delta`; in plain generate transformers'
`torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`) counts as one operator, among the kernel
operators and the calls from Python alike: on the CPU it is transformers' torch loop, on a GPU fla-core's kernel
(the recurrent one, one launch, for eager steps' rows).
Grouped attention runs its CUDA branch (`attention.sdpa.eager_sdpa_backends` entered as on a GPU), so the counts
are those of an eager GPU step.
Also the median host time per step (CPU wall time, no dispatch mode), which on a CPU includes the tiny model's
arithmetic.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import platform
import statistics
import sys
import time

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.dirname(os.path.abspath(__file__))]

import shapes  # noqa: E402

from hf_raincheck import RaincheckConfig, enable_raincheck  # noqa: E402
from hf_raincheck.gdn_state import kernels as gdn_kernels  # noqa: E402
from hf_raincheck.attention import sdpa  # noqa: E402
from hf_raincheck.generation import enable as enable_module  # noqa: E402
from hf_raincheck.generation import rows as rows_module  # noqa: E402
from hf_raincheck.generation import shared_batch  # noqa: E402
from hf_raincheck.conversation import batch_inputs  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5_modeling  # noqa: E402

POLICIES = ("plain", "full", "hard", "raincheck")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


#: aten operators that launch no kernel: views, shape queries and allocations
NO_KERNEL = {
    "aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::slice", "aten::select", "aten::expand",
    "aten::unsqueeze", "aten::squeeze", "aten::transpose", "aten::t", "aten::permute", "aten::alias", "aten::detach",
    "aten::_reshape_alias", "aten::unflatten", "aten::split", "aten::split_with_sizes", "aten::unbind",
    "aten::narrow", "aten::chunk", "aten::movedim", "aten::view_as", "aten::expand_as", "aten::lift_fresh",
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resolve_conj", "aten::resolve_neg",
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::result_type", "aten::set_",
    "aten::unfold", "aten::diagonal", "aten::flatten", "aten::reshape", "aten::contiguous", "aten::numpy_T",
    "aten::to", "aten::type_as", "aten::_has_compatible_shallow_copy_type", "aten::new_empty",
    "aten::new_empty_strided", "aten::scalar_tensor",
}
SYNCS = {"aten::_local_scalar_dense"}
#: matrix products and convolutions: one kernel each on a GPU (cuBLAS, cuDNN), counted as one operator whatever ATen's
#: CPU path runs below them (where oneDNN has no bf16 support, no AVX-512, the CPU's bf16 `baddbmm` runs one `addmm_`
#: per matrix and a grouped convolution one small convolution per group), so the counts do not depend on the CPU
ONE_KERNEL = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::convolution",
              "aten::_convolution"}
GDN_KERNEL = "gdn_state.kernels.gated_delta"
HF_GDN_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")  # plain generate's


def as_gdn_kernel(fn):
    """`fn` inside a ``GDN_KERNEL`` profiler range: counted as one operator."""
    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        with torch.profiler.record_function(GDN_KERNEL):
            return fn(*args, **kwargs)

    return kernel


def _is_aten(event) -> bool:
    return event.name.startswith("aten::")


def _kernel_events(events) -> list:
    """The aten operators of a profiled step that launch a kernel: the innermost ones that are not views, shape
    queries, allocations or no-op conversions (an ``aten::to`` that copies has an ``aten::copy_`` below it); a matrix
    product or a convolution (``ONE_KERNEL``) and a GDN kernel call count as one, whatever they call."""
    kernels = []

    def visit(event) -> bool:  # True if `event` or an operator below it launches a kernel
        if event.name == GDN_KERNEL or event.name in ONE_KERNEL:  # one operator (GDN: see the module docstring)
            kernels.append(event)
            return True
        below = False
        for child in event.cpu_children:
            below |= visit(child)
        if below:
            return True
        if _is_aten(event) and event.name not in NO_KERNEL:
            kernels.append(event)
            return True
        return False

    for event in events:
        if event.cpu_parent is None:
            visit(event)
    return kernels


def _leaves(events) -> collections.Counter:
    """The kernel-launching aten operators of a profiled step, by name (syncs included)."""
    ops = collections.Counter(e.name for e in _kernel_events(events))
    ops.update(e.name for e in events if e.name in SYNCS)
    return ops


def _where(event) -> str:
    """The innermost frame of this package (or of transformers) that called `event`."""
    frames = []
    parent = event.cpu_parent
    while parent is not None:
        frames.append(parent.name)
        parent = parent.cpu_parent
    for frame in frames:
        if "hf_raincheck/" in frame:
            return frame.split("hf_raincheck/")[-1]
    for frame in frames:
        if "transformers/" in frame:
            return frame.split("site-packages/")[-1]
    return "?"


def _top(events) -> int:
    """aten operators called from Python (no aten operator above them), a GDN kernel call counting as one (the
    operators of the CPU's torch loop inside it are one fla-core call on a GPU)."""
    count = 0
    for event in events:
        if not (_is_aten(event) or event.name == GDN_KERNEL):
            continue
        parent = event.cpu_parent
        while parent is not None and not _is_aten(parent) and parent.name != GDN_KERNEL:
            parent = parent.cpu_parent
        count += parent is None
    return count


def _summary(ops: collections.Counter, top: int) -> dict:
    kernels = sum(n for name, n in ops.items() if name not in NO_KERNEL)
    syncs = sum(n for name, n in ops.items() if name in SYNCS)
    return dict(calls=top, kernels=kernels, syncs=syncs)


def _step_kind(policy: str, plan, restored_before, pending_before) -> str:
    if policy != "raincheck":
        return policy
    if plan is not None and restored_before is not None and plan.restored != restored_before:
        return "raincheck, fused"
    if pending_before:
        return "raincheck, pending"
    return "raincheck, restored"


def _batch(image_tokens: int, batch_size: int, dtype: torch.dtype) -> dict:
    """A left-padded batch of `batch_size` rows (row i: seed i, a question 3 * (i % 4) tokens longer), as
    ``batch.py`` builds one."""
    rows = [shapes.build_inputs(image_tokens, 8, 8 + 3 * (i % 4), "cpu", dtype, seed=i)
            for i in range(batch_size)]
    return dict(batch_inputs(rows, 0))  # (shapes.build_model's pad_token_id)


def run(shape: str, policy: str, image_tokens: int, new_tokens: int, count: bool, where: bool = False,
        batch_size: int = 1, dtype: torch.dtype = torch.bfloat16):
    """Per forward of one answer: (kind, summary or host seconds, Counter or None). ``batch_size > 1``: one answer
    of a batch in the shared engine (`generation.shared_batch`), its steps counted for the whole batch."""
    model = enable_raincheck(shapes.build_model(shape, "cpu", dtype))
    inputs = shapes.build_inputs(image_tokens, 8, 8, "cpu", dtype) if batch_size == 1 else _batch(
        image_tokens, batch_size, dtype)
    records = []
    state = model._raincheck_state
    original_turn_step = enable_module._turn_step
    original_forward = state.original_forward
    original_shared = (shared_batch.run_shared_step, shared_batch.run_shared_decode)

    def measured(fn, kind_of):
        def call(*args, **kwargs):
            before = kind_of(None, args, kwargs)
            ops = None
            t0 = time.perf_counter()
            if count:
                # (stacks of decode steps only: torch 2.13's profiler now and then fails to decode a prefill's)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                            with_stack=where and is_step(kind_of, before)) as prof:
                    out = fn(*args, **kwargs)
                events = prof.events()
                places = collections.Counter(_where(e) for e in _kernel_events(events)) if prof.with_stack else None
                ops = (_leaves(events), _top(events), places)
            else:
                out = fn(*args, **kwargs)
            elapsed = time.perf_counter() - t0
            kind = kind_of(before, args, kwargs)
            if kind is not None:
                records.append((kind, elapsed, ops))
            return out
        return call

    def turn_kind(before, args, kwargs):
        cache, turn = args[1], args[2]
        if before is None:  # called before the forward: what to compare after it
            plan = cache.plan
            return (turn.prefill_done, plan, plan.restored if plan is not None else None,
                    plan.pending if plan is not None else 0)
        prefill_done, plan, restored, pending = before
        if not prefill_done:
            return None
        return _step_kind(policy, plan, restored, pending)

    def shared_fused_kind(before, args, kwargs):  # a shared step carrying deferred rows (Raincheck only)
        return True if before is None else "raincheck, fused"

    def shared_decode_kind(before, args, kwargs):  # a shared decode-only step
        if before is None:
            return any(c.plan is not None and c.plan.pending for c in args[1].rows)
        return policy if policy != "raincheck" else ("raincheck, pending" if before else "raincheck, restored")

    plain_calls = []

    def is_step(kind_of, before) -> bool:  # a decode step (not a prefill), from what `kind_of` saw before it
        if kind_of is turn_kind:
            return before[0]
        return bool(plain_calls) if kind_of is plain_kind else True

    def plain_kind(before, args, kwargs):
        if before is None:
            return True
        plain_calls.append(1)
        return None if len(plain_calls) == 1 else "plain"  # the first call is the prefill

    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if policy != "plain":
        kwargs["raincheck_config"] = RaincheckConfig(policy=policy, retention=0.3, pruning="uniform",
                                                     completion="blocking")
    original_kernel = gdn_kernels.gated_delta
    gdn_kernel = as_gdn_kernel(original_kernel)
    # plain generate calls transformers' GDN functions by their module names: the same one-operator count
    hf_gdn = {name: getattr(qwen3_5_modeling, name) for name in HF_GDN_FUNCTIONS}
    enable_module._turn_step = measured(original_turn_step, turn_kind)
    shared_batch.run_shared_step = measured(original_shared[0], shared_fused_kind)
    shared_batch.run_shared_decode = measured(original_shared[1], shared_decode_kind)
    state.original_forward = measured(original_forward, plain_kind)
    gdn_kernels.gated_delta = gdn_kernel
    for name, fn in hf_gdn.items():
        setattr(qwen3_5_modeling, name, as_gdn_kernel(fn))
    original_backends = rows_module.eager_sdpa_backends
    # the attention branch of an eager GPU step (short forwards: the grouped path with the torch softmax)
    rows_module.eager_sdpa_backends = lambda device, rows: (
        sdpa._EAGER_SHORT if rows <= sdpa.SHAPE_CHANGING_ROWS else original_backends(device, rows))
    try:
        with torch.no_grad():
            model.generate(**inputs, **kwargs)
    finally:
        enable_module._turn_step = original_turn_step
        shared_batch.run_shared_step, shared_batch.run_shared_decode = original_shared
        state.original_forward = original_forward
        gdn_kernels.gated_delta = original_kernel
        for name, fn in hf_gdn.items():
            setattr(qwen3_5_modeling, name, fn)
        rows_module.eager_sdpa_backends = original_backends
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,tiny-qwen3.5", help="comma list of shapes.py's tiny shapes")
    parser.add_argument("--image-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=1,
                        help="rows of one left-padded batch (> 1: the shared engine's steps, counted per batch step)")
    parser.add_argument("--ops", default="", help="print the operators of one step of this kind by name "
                                                  "(plain, full, pending, fused, restored)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                        help="the model's dtype (bfloat16: the GPU runs'; some operators, casts, exist only there)")
    parser.add_argument("--save", action="store_true", help="write results/step_ops.json")
    parser.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results", "step_ops.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    table = []
    for shape in args.models.split(","):
        for policy in POLICIES:
            counted = run(shape, policy, args.image_tokens, args.new_tokens, count=True, where=bool(args.ops),
                          batch_size=args.batch_size, dtype=DTYPES[args.dtype])
            timed = run(shape, policy, args.image_tokens, args.new_tokens, count=False, batch_size=args.batch_size,
                        dtype=DTYPES[args.dtype])
            by_kind = collections.defaultdict(list)
            for kind, _, ops in counted:
                by_kind[kind].append(ops)
            times = collections.defaultdict(list)
            for kind, seconds, _ in timed:
                times[kind].append(seconds)
            for kind, steps in by_kind.items():
                summaries = [_summary(*ops[:2]) for ops in steps]
                row = dict(model=shape, batch_size=args.batch_size, step=kind, steps=len(steps),
                           host_us=round(1e6 * statistics.median(times[kind]), 1) if times[kind] else None)
                for key in ("calls", "kernels", "syncs"):
                    row[key] = statistics.median(s[key] for s in summaries)
                table.append(row)
                if args.ops and kind.endswith(args.ops):
                    ops, _, places = steps[len(steps) // 2]
                    print(f"\n{shape} {kind}: kernel operators of one step, by name and by caller")
                    for name, n in sorted(ops.items(), key=lambda x: -x[1]):
                        print(f"  {n:5d}  {name}{'' if name not in NO_KERNEL else '  (sync)'}")
                    for place, n in sorted(places.items(), key=lambda x: -x[1]):
                        print(f"  {n:5d}  {place}")

    full = {r["model"]: r for r in table if r["step"] == "full"}
    print("\n| model | step | steps | aten calls from Python | kernel ops | syncs | kernel ops / Full's | host us (CPU) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        ref = full.get(r["model"])
        ratio = f"{r['kernels'] / ref['kernels']:.2f}" if ref else "-"
        print(f"| {r['model']} | {r['step']} | {r['steps']} | {r['calls']:.0f} | {r['kernels']:.0f} "
              f"| {r['syncs']:.0f} | {ratio} | {r['host_us']} |")
    if args.save:
        header = dict(command="python benchmarks/" + " ".join([os.path.basename(__file__)] + sys.argv[1:]),
                      torch=torch.__version__, python=platform.python_version(),
                      transformers=__import__("transformers").__version__, machine=platform.machine())
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(header=header, rows=table), f, indent=1)
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
