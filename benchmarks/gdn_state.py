"""Cost and accuracy of Raincheck's Gated DeltaNet state mapping (docs/design.md rule 3) at a real shape.

    python benchmarks/gdn_state.py --device cuda --save           # Qwen3.5-9B shape on a GPU (fla when installed)
    python benchmarks/gdn_state.py --device cpu --shape tiny      # smoke run

1. Per generated token, all GDN layers together: the online P_tail update (the decode row's kernel run on
   ``[S | P]`` with values ``[v | 0]`` minus the same kernel on ``S`` alone) and one join
   (``S += P (S'_prefix - S_prefix)``), next to a plain decode step of the model of that shape (transformers'
   own generate, random weights, dynamic cache).
2. Relative error of the joined live state against recomputing the tail from the new prefix state in float64,
   for tails of 64/256/1024/4096 tokens (P built online, one token per call, as decode steps do).
3. End to end: Raincheck generate with ``gdn_backend="fla"`` vs ``"torch"`` on the full model (tokens, logits).

Paper (SGLang): increment 2.1 us/token, join 10.7 us, error 0.07%. Targets: update + joins < 2% of TPOT;
error < 0.1%.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from shapes import SHAPES, build_inputs, build_model  # noqa: E402

from hf_raincheck import RaincheckConfig, enable_raincheck  # noqa: E402
from hf_raincheck.conversation import output_cache  # noqa: E402
from hf_raincheck.gdn_state import GDNLayerState, PrefixCheckpoint, advance, resolve  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gdn_state.json")


def timed(fn, sync, iters):
    for _ in range(3):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def factors(t, hk, hv, dk, dv, device, dtype, gen, slow=True):
    q = torch.randn(1, t, hk, dk, generator=gen).to(device, dtype)
    k = torch.randn(1, t, hk, dk, generator=gen).to(device, dtype)
    v = torch.randn(1, t, hv, dv, generator=gen).to(device, dtype)
    # slow decay (per-token factor 0.87..0.999) so that P_tail stays far from 0 over long tails: the hard case
    g = -torch.exp(torch.empty(1, t, hv).uniform_(-7.0, -2.0, generator=gen)).to(device)
    beta = torch.rand(1, t, hv, generator=gen).to(device, dtype)
    return q, k, v, g, beta


def per_token_costs(text, backend, device, dtype, sync, layers, iters):
    hk, hv, dk, dv = (text["linear_num_key_heads"], text["linear_num_value_heads"], text["linear_key_head_dim"],
                      text["linear_value_head_dim"])
    gen = torch.Generator().manual_seed(0)
    row = factors(1, hk, hv, dk, dv, device, dtype, gen)
    s = torch.randn(1, hv, dk, dv, generator=gen).to(device)
    stacked = torch.cat([s, torch.randn(1, hv, dk, dk, generator=gen).to(device)], dim=-1)
    ds = torch.randn(1, hv, dk, dv, generator=gen).to(device)
    layer = GDNLayerState()
    layer.set_state(stacked.clone(), dv)
    layer.prefix = PrefixCheckpoint(plan_id=0, recurrent=s.clone(), conv=None)
    plain = timed(lambda: advance(backend, *row, s), sync, iters)
    with_p = timed(lambda: advance(backend, *row, stacked, carry=dk), sync, iters)
    join = timed(lambda: layer.join(layer.prefix.recurrent + ds), sync, iters)
    return dict(
        decode_row_kernel_us=1e6 * plain * layers,
        decode_row_kernel_with_p_us=1e6 * with_p * layers,
        p_update_us=1e6 * (with_p - plain) * layers,
        join_us=1e6 * join * layers,
        gdn_layers=layers,
    )


def f64_step(state, k, v, decay, beta):
    kv = torch.einsum("hk,hkv->hv", k, decay[:, None, None] * state)
    return decay[:, None, None] * state + beta[:, None, None] * k[:, :, None] * (v - kv)[:, None, :]


def recompute_f64(prefix, tail):
    q, k, v, g, beta = tail
    hv = v.shape[2]
    k = k.double().repeat_interleave(hv // k.shape[2], dim=2)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    state = prefix.double()[0]
    for t in range(v.shape[1]):
        state = f64_step(state, k[0, t], v[0, t].double(), g[0, t].double().exp(), beta[0, t].double())
    return state


def join_error(text, backend, device, dtype, tail_len, chunk=31):
    hk, hv, dk, dv = (text["linear_num_key_heads"], text["linear_num_value_heads"], text["linear_key_head_dim"],
                      text["linear_value_head_dim"])
    gen = torch.Generator().manual_seed(tail_len)
    prefix_old = torch.randn(1, hv, dk, dv, generator=gen).to(device)
    tail = factors(tail_len, hk, hv, dk, dv, device, dtype, gen)
    layer = GDNLayerState()
    layer.set_state(prefix_old.clone(), dv)
    layer.conv = torch.zeros(1, 1, 4, device=device)
    layer.checkpoint(0, hv, dk, dv, (1, 1, 4), device, dtype)
    for t in range(tail_len):  # online: one token per call, as decode steps do
        _, stacked = advance(backend, *[x[:, t : t + 1] for x in tail], layer.state, carry=layer.carry)
        layer.set_state(stacked, dv)
    live = layer.recurrent.clone()
    deferred = factors(chunk, hk, hv, dk, dv, device, dtype, gen)
    _, prefix_new = advance(backend, *deferred, prefix_old)
    layer.join(prefix_new)
    joined = layer.recurrent
    expected = recompute_f64(prefix_new, tail)
    scale = expected.abs().max()
    return dict(
        tail=tail_len,
        rel_error=float((joined[0].double() - expected).abs().max() / scale),
        rel_change_by_join=float((joined[0].double() - live[0].double()).abs().max() / scale),
    )


def decode_step_ms(model, inputs, n, sync):
    """Plain transformers generate (dynamic cache): TPOT over `n` tokens after the prompt."""
    from transformers.generation.streamers import BaseStreamer

    class Times(BaseStreamer):
        def __init__(self):
            self.t = []

        def put(self, value):
            sync()
            self.t.append(time.perf_counter())

        def end(self):
            pass

    model.generate(**inputs, max_new_tokens=4, min_new_tokens=4)
    times = Times()
    model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, streamer=times)
    gen = times.t[1:]
    return 1e3 * (gen[-1] - gen[0]) / (len(gen) - 1)


def end_to_end(model, inputs, n):
    """Raincheck with each kernel backend, and Full with each (the kernels' own bf16 disagreement, for scale)."""
    report = {}
    for policy in ("full", "raincheck"):
        out = {}
        for backend in ("torch", "fla"):
            cfg = RaincheckConfig(policy=policy, retention=0.3, pruning="uniform", gdn_backend=backend,
                                  completion="blocking")
            out[backend] = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                          output_logits=True, return_dict_in_generate=True, raincheck_config=cfg)
        a, b = torch.stack(out["torch"].logits).float(), torch.stack(out["fla"].logits).float()
        seq_a, seq_b = out["torch"].sequences[0].tolist(), out["fla"].sequences[0].tolist()
        report[policy] = dict(
            same_tokens=seq_a == seq_b,
            first_differing_index=next((i for i, (x, y) in enumerate(zip(seq_a, seq_b)) if x != y), None),
            prompt_length=inputs["input_ids"].shape[1],
            first_logits_max_abs_diff=float((a[0] - b[0]).abs().max()),
            logits_scale=float(a[0].abs().max()),
            restored_during_decode=output_cache(out["fla"]).stats.during_decode,
        )
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3.5-9b", choices=["qwen3.5-9b", "tiny"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "fla"])
    parser.add_argument("--tails", default="64,256,1024,4096")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--skip-model", action="store_true", help="only the kernel-level measurements")
    parser.add_argument("--save", action="store_true", help=f"write {RESULTS}")
    args = parser.parse_args(argv)
    shape = "qwen3.5-9b" if args.shape == "qwen3.5-9b" else "tiny-qwen3.5"
    text = SHAPES[shape]["text"]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    backend = resolve(args.backend, device)
    layers = 3 * text["num_hidden_layers"] // 4
    report = dict(shape=shape, backend=backend, dtype=str(dtype), torch=torch.__version__,
                  gpu=torch.cuda.get_device_name() if cuda else platform.processor())
    with torch.no_grad():
        report["per_token"] = per_token_costs(text, backend, device, dtype, sync, layers, args.iters)
        report["join_error"] = [join_error(text, backend, device, dtype, int(t)) for t in args.tails.split(",")]
        if not args.skip_model:
            model = enable_raincheck(build_model(shape, args.device, dtype))
            inputs = build_inputs(1024 if cuda else 64, 30, 30, args.device, dtype)
            report["decode_step_ms"] = decode_step_ms(model, inputs, 64 if cuda else 8, sync)
            if cuda and backend == "fla":
                report["end_to_end_fla_vs_torch"] = end_to_end(model, inputs, 48)
    pt = report["per_token"]
    print(json.dumps(report, indent=2))
    if "decode_step_ms" in report:
        share = (pt["p_update_us"] + pt["join_us"]) / (1e3 * report["decode_step_ms"])
        report["update_plus_join_share_of_tpot"] = share
        print(f"P update {pt['p_update_us']:.1f} us + join {pt['join_us']:.1f} us per token over {layers} GDN layers "
              f"= {100 * share:.2f}% of a {report['decode_step_ms']:.2f} ms decode step")
    for row in report["join_error"]:
        print(f"tail {row['tail']:5d}: relative error {100 * row['rel_error']:.4f}% "
              f"(the join itself moved the state by {100 * row['rel_change_by_join']:.2f}%)")
    if args.save:
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
