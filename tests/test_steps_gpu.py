"""GPU-only (run on the H200): decode steps add no host-device synchronisation, and compiled static steps
(inductor, CUDA graphs: transformers' default ``CompileConfig``) equal eager ones.

    python -m pytest -q -s tests/test_steps_gpu.py
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from handmade import _conv, _tiny_model  # noqa: E402
from handmade_qwen3_5 import tiny_qwen3_5  # noqa: E402
from helpers import _extend, generate, new_tokens  # noqa: E402
from test_compiled_steps import _with_new_image  # noqa: E402

import hf_raincheck.generation.decode as decode  # noqa: E402
from hf_raincheck import RaincheckConfig, enable_raincheck  # noqa: E402
from hf_raincheck.conversation import output_cache  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cuda(inputs):
    return {k: v.cuda() for k, v in inputs.items()}


def _inputs():
    return _cuda(_conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4]))


def _model(family):
    if family == "qwen3_vl":
        return enable_raincheck(_tiny_model("eager").cuda())
    return enable_raincheck(tiny_qwen3_5("eager").cuda())


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_decode_steps_do_not_synchronize(monkeypatch, family, static):
    model = _model(family)
    inputs = _inputs()
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking")
    kw = dict(cache_implementation="static") if static else {}
    generate(model, inputs, 12, cfg, **kw)  # warm-up: compile / autotune outside the checked region
    original = decode.decode_step
    steps = []

    def checked(*args, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            steps.append(1)

    monkeypatch.setattr(decode, "decode_step", checked)
    import hf_raincheck.generation.enable as enable

    monkeypatch.setattr(enable, "decode_step", checked)
    out = generate(model, inputs, 12, cfg, **kw)
    assert len(steps) == 11 and output_cache(out).stats.during_decode > 0


class _CudagraphSkips(logging.Handler):
    """Inductor's "skipping cudagraphs due to ..." messages (its ``perf_hints`` log) while active."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "cudagraph" in message:
            self.messages.append(message)

    def __enter__(self):
        torch._logging.set_logs(perf_hints=True)
        self.logger = logging.getLogger("torch._inductor")
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        torch._logging.set_logs()


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_compiled_static_steps_equal_eager_on_cuda(family):
    """Same tokens as eager, two graphs, and both replay as CUDA graphs (``reduce-overhead``: a step Inductor
    would not put in a CUDA graph launches every kernel from the host, which the benchmark's steps showed)."""
    from transformers.generation.configuration_utils import CompileConfig

    model = _model(family)
    inputs = _inputs()
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking")
    eager = generate(model, inputs, 16, cfg)
    torch._dynamo.reset()  # (other tests compiled the same step function for models of the same shapes)
    torch._dynamo.utils.counters.clear()
    kw = dict(cache_implementation="static", compile_config=CompileConfig())  # (GDN models: compile when asked)
    with _CudagraphSkips() as skips:
        compiled = generate(model, inputs, 16, cfg, **kw)
        compiled_again = generate(model, inputs, 16, cfg, **kw)
    diff = float((torch.stack(compiled.logits) - torch.stack(eager.logits)).abs().max())
    print(f"\ncompiled (inductor) vs eager logits: max abs diff {diff:.2e}; "
          f"graphs {torch._dynamo.utils.counters['stats']['unique_graphs']}")
    assert new_tokens(compiled, inputs) == new_tokens(eager, inputs)
    assert new_tokens(compiled_again, inputs) == new_tokens(eager, inputs)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), atol=2e-3, rtol=2e-3)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0, skips.messages


def test_compiled_bf16_fused_steps_take_the_split_keys_kernel(monkeypatch):
    """A bf16 model's compiled fused steps trace their masked rows into `split_keys_triton` (head dim 16 <= 128),
    and give the logits the grouped path gives (the same compiled steps with the kernel taken away), up to bf16
    rounding, on every step until the greedy tokens first differ (a near tie of a random tiny model may flip)."""
    from transformers.generation.configuration_utils import CompileConfig

    from hf_raincheck.attention import sdpa

    model = enable_raincheck(_tiny_model("eager").cuda().to(torch.bfloat16))
    inputs = _inputs()
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking")
    kw = dict(cache_implementation="static", compile_config=CompileConfig())
    calls = []
    kernel = sdpa._split_keys
    assert kernel is not None
    monkeypatch.setattr(sdpa, "_split_keys", lambda *a: calls.append(tuple(a[0].shape)) or kernel(*a))
    torch._dynamo.reset()
    split = generate(model, inputs, 16, cfg, **kw)
    assert calls and all(shape[2] == 6 for shape in calls), calls  # the fused graph's 5 + 1 rows, per layer
    monkeypatch.setattr(sdpa, "_split_keys", None)
    torch._dynamo.reset()
    grouped = generate(model, inputs, 16, cfg, **kw)
    a, b = new_tokens(split, inputs), new_tokens(grouped, inputs)
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    steps = min(same + 1, len(a))
    diff = float((torch.stack(split.logits[:steps]).float() - torch.stack(grouped.logits[:steps]).float()).abs().max())
    print(f"\nsplit keys vs grouped path, compiled bf16: tokens equal for {same} of {len(a)}; max abs logit diff "
          f"{diff:.2e} over {steps} steps")
    assert same >= 4  # past the guard's 2 tokens: fused steps compared
    torch.testing.assert_close(torch.stack(split.logits[:steps]).float(), torch.stack(grouped.logits[:steps]).float(),
                               atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_compiled_fused_steps_copy_only_the_step_indices(family, monkeypatch):
    """A CUDA-graph replay copies every input that is not a static address. The store, scratch slots and cache
    are static, so a fused step copies only the fed token and three 0-d indices (slot, window start and length)
    where it copied every window view before (17 device-to-device copies per fused step of Qwen3-VL-8B): at most
    as many as a decode-only step (which copies the token and slot) and two more. (H200: tiny Qwen3-VL 0-1 copies
    per fused step against 4 per decode-only step; tiny Qwen3.5 0-1 against 2.)"""
    from transformers.generation.configuration_utils import CompileConfig

    model = _model(family)
    inputs = _inputs()
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking")
    torch._dynamo.reset()
    kw = dict(cache_implementation="static", compile_config=CompileConfig())
    generate(model, inputs, 16, cfg, **kw)  # compile and record
    generate(model, inputs, 16, cfg, **kw)  # a new plan: graphs recorded again for its store's addresses
    original = decode.StaticStep._run
    copies = {"fused": [], "decode": []}

    def profiled(self, cache, turn, count, token, slot, chunk):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            result = original(self, cache, turn, count, token, slot, chunk)
            torch.cuda.synchronize()
        n = sum(e.count for e in prof.key_averages() if e.key.startswith("Memcpy DtoD"))
        copies["fused" if chunk is not None else "decode"].append(n)
        return result

    monkeypatch.setattr(decode.StaticStep, "_run", profiled)
    generate(model, inputs, 16, cfg, **kw)
    print(f"\n{family}: device-to-device copies per compiled call: {copies}")
    assert copies["fused"] and copies["decode"]
    assert max(copies["fused"]) <= max(copies["decode"]) + 2, copies


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_new_conversations_and_turns_replay_the_recorded_cuda_graphs(family, monkeypatch):
    """A finished conversation's static buffers go to the next one (`hf_raincheck.cache.buffer_pool`) and every
    plan's store (and, on Qwen3.5, every prefill's GDN states) is copied into the cache's persistent buffers, so
    after the first conversations a new conversation, and its second turn with a new image, record no CUDA graph:
    they replay (before, each conversation's first decode step and first fused step recorded again, ~35 ms each on
    Qwen3-VL-8B; on Qwen3.5-9B 81 and 157 ms, every turn)."""
    from torch._inductor import cudagraph_trees
    from transformers.generation.configuration_utils import CompileConfig

    from hf_raincheck import release_static_buffers

    model = _model(family)
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="next_turn")
    torch._dynamo.reset()
    release_static_buffers()
    kw = dict(cache_implementation="static", compile_config=CompileConfig())

    def conversation():
        inputs = _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4])
        out = generate(model, _cuda(inputs), 12, cfg, **kw)
        turn2 = _with_new_image(_extend(inputs, new_tokens(out, inputs)))
        generate(model, _cuda(turn2), 12, cfg, past=output_cache(out), **kw)

    conversation()  # compiles, warms up and records
    conversation()
    records = []
    original = cudagraph_trees.CUDAGraphTreeManager.record_function

    def counting(self, *args, **kwargs):
        records.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", counting)
    conversation()
    conversation()
    print(f"\nCUDA graph recordings in two more conversations of two turns: {len(records)}")
    assert not records


def test_eager_decode_attention_builds_no_cudnn_plan_per_step():
    """Decode-shaped bf16 attention over a key length that grows by one per call (an eager decode step), inside
    `eager_sdpa_backends`: no cuDNN attention runs (it builds a plan per new shape: ~1 ms of host time per call on
    the H200), another SDPA backend does, and the results match SDPA's own choice."""
    from torch.profiler import ProfilerActivity, profile

    from hf_raincheck.attention import sdpa

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, 8, 4200, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, 8, 4200, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    lengths = range(4096, 4104)
    want = [sdpa.sdpa_attention(q, k[:, :, :n], v[:, :, :n], None, 128 ** -0.5, causal_lower_right=True)
            for n in lengths]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with sdpa.eager_sdpa_backends(q.device, 1):
            got = [sdpa.sdpa_attention(q, k[:, :, :n], v[:, :, :n], None, 128 ** -0.5, causal_lower_right=True)
                   for n in lengths]
    names = {e.name for e in prof.events()}
    attention = sorted(name for name in names if name.startswith("aten::_scaled_dot_product"))
    print("eager decode attention ran:", attention)
    assert attention and not any("cudnn" in name for name in names), sorted(names)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl", "qwen3_5"])
def test_compiled_static_batch_equals_eager_on_cuda(family, tiny_vl_path, tiny_qwen2_5_vl_path, tiny_qwen3_5_path):
    """A mixed left-padded batch of 4 rows on a static cache (inductor, CUDA graphs: transformers' default
    ``CompileConfig``; Qwen3.5: its GDN kernels resolved as everywhere, fla when installed): the same tokens as the
    eager shared engine on a dynamic cache, step logits within the CUDA tolerance, two graphs (decode-only and fused
    at B = 4) that a second batch of other conversations reuses, and every compiled step replays as a CUDA graph.

    Qwen3.5's reference is the eager engine with transformers' torch GDN code (fp32 throughout): fla's kernels round
    through TF32 tensor cores, and the compiled steps run other fla kernels than eager ones (chunked windows, batched
    decode rows), so fla-vs-fla differs by fla's own rounding (H200: 7e-3, while eager fla is 9e-3 from the fp32
    reference and compiled vs eager with torch kernels on both sides is 7e-6). So on Qwen3.5 the compiled batch
    with torch kernels must equal that reference within the tolerance (the batching logic), and with fla it must
    stay within twice eager fla's own distance from it (fla's rounding, not an error: a wrong window or state
    is off by orders of magnitude more)."""
    from test_batch import CONVERSATIONS, _inputs, _messages
    from transformers.generation.configuration_utils import CompileConfig

    from hf_raincheck.testing import load_tiny_qwen2_5_vl, load_tiny_qwen3_5, load_tiny_qwen3_vl, make_image

    load, path = dict(qwen3_vl=(load_tiny_qwen3_vl, tiny_vl_path),
                      qwen2_5_vl=(load_tiny_qwen2_5_vl, tiny_qwen2_5_vl_path),
                      qwen3_5=(load_tiny_qwen3_5, tiny_qwen3_5_path))[family]
    model, processor = load(path)
    model = enable_raincheck(model.cuda())
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking")
    others = [_messages([make_image(5, (96, 64))], "Shapes?"), _messages([], "Hello there"),
              _messages([make_image(6), make_image(7, (64, 64))], "Which is brighter?"),
              _messages([make_image(8)], "Count the colours, please")]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    exact_cfg = dataclasses.replace(cfg, gdn_backend="torch")

    def run(conversations, config=cfg, **kw):
        batch = _cuda(_inputs(processor, conversations))
        with torch.no_grad():
            out = model.generate(**batch, raincheck_config=config, max_new_tokens=16, do_sample=False,
                                 return_dict_in_generate=True, output_logits=True, **kw)
        return out

    def max_diff(a, b):
        return float((torch.stack(a.logits) - torch.stack(b.logits)).abs().max())

    static = dict(cache_implementation="static", compile_config=CompileConfig())
    with _CudagraphSkips() as skips:
        for conversations in (CONVERSATIONS, others):
            eager = run(conversations)
            compiled = run(conversations, **static)
            reference, bound = eager, 2e-3
            if family == "qwen3_5":
                reference = run(conversations, config=exact_cfg)
                bound = max(bound, 2 * max_diff(eager, reference))
            diff = max_diff(compiled, reference)
            print(f"\n{family}: compiled static batch vs eager shared engine: max abs logit diff "
                  f"{max_diff(compiled, eager):.2e}, vs the reference {diff:.2e} (bound {bound:.1e}); "
                  f"graphs {torch._dynamo.utils.counters['stats']['unique_graphs']}")
            assert torch.equal(compiled.sequences, eager.sequences)
            assert torch.equal(reference.sequences, eager.sequences)
            torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(reference.logits),
                                       atol=bound, rtol=2e-3)
            assert output_cache(compiled).static
            assert output_cache(compiled).row_turn_stats == output_cache(eager).row_turn_stats
            assert output_cache(compiled).row_pending == [0] * len(conversations)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0, skips.messages
    if family == "qwen3_5":  # the batching logic, without fla's rounding: torch GDN code on both sides
        torch._dynamo.reset()
        compiled = run(CONVERSATIONS, config=exact_cfg, **static)
        reference = run(CONVERSATIONS, config=exact_cfg)
        print(f"qwen3_5, torch GDN code: compiled static batch vs eager {max_diff(compiled, reference):.2e}")
        assert torch.equal(compiled.sequences, reference.sequences)
        torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(reference.logits), atol=2e-3, rtol=2e-3)


def test_compiled_row_writes_store_only_the_written_entries_on_cuda():
    """A batch's KV writes (`cache.batched.write_rows_`) compiled by Inductor for CUDA: the reference values, and the
    Triton code holds no kernel over the whole buffer (``scatter_`` compiled to two: a copy of the buffer and a
    scatter into it, 27-29 us each per attention layer and K / V in a B = 16 step of the Qwen3.5-9B shape)."""
    from torch._inductor.utils import run_and_get_code

    from hf_raincheck.cache.batched import write_rows_

    from test_batch_compiled import row_write_case

    buffer, slots, states, expected = row_write_case("cuda")
    compiled = buffer.clone()
    _, (code, *_) = run_and_get_code(torch.compile(write_rows_, fullgraph=True), compiled, slots, states)
    assert torch.equal(compiled, expected)
    assert f"xnumel = {buffer.numel()}" not in code, "a compiled kernel runs over the whole buffer"
