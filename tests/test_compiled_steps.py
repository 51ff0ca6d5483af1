"""Compiled decode / fused steps on a static cache (CPU: dynamo with the eager backend, ``fullgraph=True``, so a
graph break fails the test; the H200 run uses inductor with CUDA graphs, see benchmarks/latency.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch._dynamo
from transformers.generation.configuration_utils import CompileConfig

sys.path.insert(0, os.path.dirname(__file__))

from handmade import _conv, _extend, _tiny_model, _video_conv  # noqa: E402
from helpers import generate, new_tokens  # noqa: E402

from hf_raincheck import RaincheckConfig, enable_raincheck  # noqa: E402
from hf_raincheck.conversation import output_cache  # noqa: E402

TOL = dict(atol=2e-5, rtol=1e-4)


def compile_config():
    config = CompileConfig(backend="eager", fullgraph=True, dynamic=False)
    config._compile_all_devices = True  # compile on the CPU too (transformers' own switch)
    return config


@pytest.fixture(scope="module")
def model():
    return enable_raincheck(_tiny_model("eager"))


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def two_images(seed=0):
    return _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4], seed=seed)


def graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def run(model, inputs, n, cfg, past=None, static=True):
    kw = dict(cache_implementation="static", compile_config=compile_config()) if static else {}
    return generate(model, inputs, n, cfg, past=past, **kw)


@pytest.mark.parametrize(
    "cfg",
    [
        RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking"),
        RaincheckConfig(retention=0.5, chunk_size=4, guard_tokens=0, completion="next_turn"),
        RaincheckConfig(policy="hard", retention=0.3, pruning="uniform"),
        RaincheckConfig(retention=0.3, chunk_size=6, guard_tokens=1, pruning="uniform", completion="blocking",
                        schedule=lambda step, pending: 2 if step % 2 else 0),  # partial chunks
    ],
    ids=["blocking", "next_turn", "hard", "partial_chunks"],
)
@pytest.mark.parametrize("make_inputs", [two_images, _video_conv], ids=["images", "video"])
def test_compiled_static_equals_eager_dynamic(model, cfg, make_inputs):
    inputs = make_inputs()
    eager = run(model, inputs, 12, cfg, static=False)
    compiled = run(model, inputs, 12, cfg)
    assert new_tokens(compiled, inputs) == new_tokens(eager, inputs)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), **TOL)
    a, b = output_cache(compiled), output_cache(eager)
    assert a.stats == b.stats and a.pending == b.pending
    assert torch.equal(a.filled, b.filled)  # padding rows never mark a slot
    # the next turn continues from either cache alike
    nxt = _extend(_extend(inputs, new_tokens(eager, inputs)), [7, 8, 9])
    eager2 = run(model, nxt, 3, cfg, past=b, static=False)
    compiled2 = run(model, nxt, 3, cfg, past=a)
    torch.testing.assert_close(torch.stack(compiled2.logits), torch.stack(eager2.logits), **TOL)


def test_two_graphs_and_no_recompilation_across_steps_and_conversations(model):
    """One graph for plain decode steps, one for fused steps; a new conversation of the same capacity reuses them."""
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking")
    run(model, two_images(seed=0), 12, cfg)
    assert graphs() == 2
    run(model, two_images(seed=1), 12, cfg)  # other pixels, other plan, same shapes
    assert graphs() == 2


def test_decode_and_fused_steps_each_check_only_their_own_graph(model):
    """Decode-only and fused steps compile as two functions (`decode.CompiledByStepKind`), each with one dynamo
    cache entry: a decode-only step after a fused step no longer tries (and fails) the fused graph's guards first.
    The batch steps (`shared_static`) are built the same way (`test_batch_compiled`)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from hf_raincheck.generation import decode

    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking")
    out = run(model, two_images(seed=0), 12, cfg)
    assert output_cache(out).stats.during_decode > 0  # fused steps ran (decode-only steps before them)
    for body in (decode._decode_step_graph, decode._fused_step_graph):
        assert len(_debug_get_cache_entry_list(body.__code__)) == 1, body.__name__
    assert _debug_get_cache_entry_list(decode._step_graph.__code__) == []  # traced inside them, never on its own


def test_later_turns_reuse_the_graphs_while_capacity_lasts(model):
    """Static capacity grows geometrically in multiples of 256, so short follow-up turns keep the same graphs."""
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="next_turn")
    inputs = two_images()
    out = run(model, inputs, 8, cfg)
    cache = output_cache(out)
    capacity = cache.layers[0].capacity
    assert capacity % 256 == 0
    conv = _extend(inputs, new_tokens(out, inputs))
    for turn in range(3):
        conv = _extend(conv, [5 + turn, 6])
        out = run(model, conv, 4, cfg, past=cache)
        conv = _extend(conv, new_tokens(out, conv))
    assert cache.layers[0].capacity == capacity and graphs() == 2


def test_a_grown_capacity_compiles_once_more_under_transformers_default_dynamic(model):
    """Every other test here compiles with ``dynamic=False``; transformers' default `CompileConfig` leaves
    ``dynamic=None``. Under it a conversation whose static capacity grows (256 -> 512) compiles its decode step once
    more, with dynamic shapes, and that graph serves the next capacity (768) without compiling again; every turn's
    tokens equal the eager steps'."""
    config = CompileConfig(backend="eager", fullgraph=True)  # dynamic=None, transformers' default
    config._compile_all_devices = True
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="next_turn")
    runs = {}
    for kind, kw in (("compiled", dict(cache_implementation="static", compile_config=config)), ("eager", {})):
        conv = two_images()
        cache, turns = None, []
        for turn, filler in enumerate((None, [5, 6], [7, 8])):
            if filler is not None:
                conv = _extend(conv, filler * 150)  # 300 text tokens: the static capacity grows by 256
            out = generate(model, conv, 6, cfg, past=cache, **kw)
            cache = output_cache(out)
            new = new_tokens(out, conv)
            conv = _extend(conv, new)
            turns.append((new, cache.layers[0].capacity if kind == "compiled" else None, graphs()))
        runs[kind] = turns
    assert [t[0] for t in runs["compiled"]] == [t[0] for t in runs["eager"]]
    capacities, counts = [t[1] for t in runs["compiled"]], [t[2] for t in runs["compiled"]]
    assert capacities == [256, 512, 768]
    assert counts[1] == counts[0] + 1 and counts[2] == counts[1]  # one recompile (the decode step), then none


@pytest.fixture(scope="module")
def hybrid():
    from handmade_qwen3_5 import tiny_qwen3_5

    return enable_raincheck(tiny_qwen3_5("eager"))


# building the default step imports Inductor (transformers' default backend), whose import warns inside torch itself
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_static_caches_compile_steps_by_default_on_accelerators_for_both_families(model, hybrid):
    """As transformers does for its own static caches: on CUDA both families get a compiled step without a
    `compile_config` (transformers' default one; Qwen3.5's GDN steps were opt-in until measured on the H200),
    `disable_compile=True` keeps the steps eager, and on the CPU nothing compiles unless the config asks for it."""
    from transformers.generation.configuration_utils import GenerationConfig

    from hf_raincheck.generation.decode import StaticStep
    from hf_raincheck.generation.enable import _static_step, raincheck_state

    for m in (model, hybrid):
        state = raincheck_state(m, "test")
        step = _static_step(m, state, GenerationConfig(), torch.device("cuda"))  # builds the step, compiles nothing
        assert isinstance(step, StaticStep)
        assert _static_step(m, state, GenerationConfig(disable_compile=True), torch.device("cuda")) is None
        assert _static_step(m, state, GenerationConfig(), torch.device("cpu")) is None
        assert isinstance(_static_step(m, state, GenerationConfig(compile_config=compile_config()),
                                       torch.device("cpu")), StaticStep)


@pytest.mark.parametrize(
    "cfg",
    [
        RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking"),
        RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=1, pruning="uniform", completion="next_turn"),
        RaincheckConfig(retention=0.3, chunk_size=6, guard_tokens=1, pruning="uniform", completion="blocking",
                        schedule=lambda step, pending: 2 if step % 2 else 0),
    ],
    ids=["blocking", "next_turn", "partial_chunks"],
)
def test_compiled_gdn_steps_equal_eager(hybrid, cfg):
    """Qwen3.5: compiled steps update the GDN states in place; padding rows leave them alone (beta = g = 0, the
    conv window taken at the last real row)."""
    inputs = two_images()
    eager = run(hybrid, inputs, 12, cfg, static=False)
    compiled = run(hybrid, inputs, 12, cfg)
    assert new_tokens(compiled, inputs) == new_tokens(eager, inputs)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), **TOL)
    a, b = output_cache(compiled), output_cache(eager)
    assert a.stats == b.stats and a.pending == b.pending and graphs() == 2
    for i, state in b.gdn_states.items():
        torch.testing.assert_close(a.gdn_states[i].recurrent, state.recurrent, **TOL)
        torch.testing.assert_close(a.gdn_states[i].conv, state.conv, **TOL)
    nxt = _extend(_extend(inputs, new_tokens(eager, inputs)), [7, 8, 9])
    eager2 = run(hybrid, nxt, 4, cfg, past=b, static=False)
    compiled2 = run(hybrid, nxt, 4, cfg, past=a)
    torch.testing.assert_close(torch.stack(compiled2.logits), torch.stack(eager2.logits), **TOL)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_compiled_unfused_control_equals_eager(model, hybrid, family):
    """``fused=False`` on a static cache: the chunk as a compiled forward of its own (a third graph), then the step."""
    net = model if family == "qwen3_vl" else hybrid
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking",
                          fused=False)
    inputs = two_images()
    eager = run(net, inputs, 12, cfg, static=False)
    compiled = run(net, inputs, 12, cfg)
    assert new_tokens(compiled, inputs) == new_tokens(eager, inputs)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), **TOL)
    assert output_cache(compiled).stats == output_cache(eager).stats and graphs() == 2  # chunk-only + decode


def test_compiled_gdn_kernels_resolve_outside_the_trace(hybrid, monkeypatch):
    """GDN kernels inside compiled steps resolve as everywhere else (``auto``: fla-core on CUDA when it imports,
    else torch; they are one opaque op in the graph), an explicit choice is kept; and the traced step never imports them (torch 2.11's dynamo broke the
    graph at an import of transformers' lazy module, 11 graphs instead of 2 on the H200): with the import
    functions made to fail, a compiled run still works once the kernels were resolved."""
    import hf_raincheck.gdn_state.kernels as kernels
    from hf_raincheck.generation.decode import compiled_gdn_backend

    assert compiled_gdn_backend("auto", torch.device("cuda")) == ("fla" if kernels.fla_available() else "torch")
    assert compiled_gdn_backend("auto", torch.device("cpu")) == "torch"
    assert compiled_gdn_backend("torch", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="gdn backend"):
        compiled_gdn_backend("triton", torch.device("cpu"))

    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking")
    inputs = two_images()
    eager = run(hybrid, inputs, 8, cfg, static=False)  # resolves the torch kernels once
    assert "torch" in kernels._FUNCTIONS

    def no_import():
        raise AssertionError("GDN kernels imported again (inside a traced step?)")

    monkeypatch.setattr(kernels, "_torch_functions", no_import)
    monkeypatch.setattr(kernels, "_fla_functions", no_import)
    compiled = run(hybrid, inputs, 8, cfg)
    assert new_tokens(compiled, inputs) == new_tokens(eager, inputs) and graphs() == 2


def _with_new_image(conv):
    """The conversation followed by a new image (grid 1x8x8) and some text."""
    new = _conv([(1, 8, 8)], [2, 3], seed=12)
    return dict(
        input_ids=torch.cat([conv["input_ids"], new["input_ids"]], dim=1),
        attention_mask=torch.ones(1, conv["input_ids"].shape[1] + new["input_ids"].shape[1], dtype=torch.long),
        mm_token_type_ids=torch.cat([conv["mm_token_type_ids"], new["mm_token_type_ids"]], dim=1),
        pixel_values=torch.cat([conv["pixel_values"], new["pixel_values"]]),
        image_grid_thw=torch.cat([conv["image_grid_thw"], new["image_grid_thw"]]),
    )


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_fused_steps_pass_the_same_static_store(model, hybrid, family, monkeypatch):
    """Every fused step of a conversation, across its turns' plans, hands the compiled graph the same store
    buffers (the cache's, marked as unguarded static addresses: CUDA graphs read them in place and are not
    recorded again per plan); what changes per step is only 0-d views of the persistent slot index (the window's
    start and length) besides the fed token and slot. The results equal eager steps' (the buffers are
    refilled, never stale)."""
    from hf_raincheck.generation.decode import StaticStep

    net = model if family == "qwen3_vl" else hybrid
    calls = []
    original = StaticStep._run

    def recording(self, cache, turn, count, token, slot, chunk):
        if chunk is not None:
            calls.append((chunk, cache.slot_index, cache.scratch_slots, count, cache.plan))
        return original(self, cache, turn, count, token, slot, chunk)

    monkeypatch.setattr(StaticStep, "_run", recording)
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="next_turn")
    inputs = two_images()
    out = run(net, inputs, 12, cfg)
    cache = output_cache(out)
    # a second turn with a new image: a second plan, whose chunks come from the same buffers
    nxt = _extend(_extend(inputs, new_tokens(out, inputs)), [7, 8])
    out2 = run(net, _with_new_image(nxt), 12, cfg, past=cache)
    eager = run(net, inputs, 12, cfg, static=False)
    eager2 = run(net, _with_new_image(_extend(_extend(inputs, new_tokens(eager, inputs)), [7, 8])), 12, cfg,
                 past=output_cache(eager), static=False)
    torch.testing.assert_close(torch.stack(out2.logits), torch.stack(eager2.logits), **TOL)
    plans = {id(c[4]) for c in calls}
    assert len(calls) >= 4 and len(plans) == 2
    store = calls[0][0][:7]
    restored = {}
    for chunk, index, scratch, count, plan in calls:
        assert all(a is b for a, b in zip(chunk[:4] + chunk[5:7], store[:4] + store[5:7]))
        assert chunk[4] is None or all(a is b for a, b in zip(chunk[4], store[4]))
        start, limit = chunk[7], chunk[8]
        assert start.dim() == limit.dim() == 0 and start.untyped_storage().data_ptr() == index.data_ptr()
        assert (int(start), int(limit)) == (restored.get(id(plan), 0), count)
        assert getattr(scratch, "_dynamo_static_input_type", None) == "unguarded"
        restored[id(plan)] = restored.get(id(plan), 0) + count
    tensors = [t for t in store[:4] + store[5:7]] + (list(store[4]) if store[4] is not None else [])
    assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in tensors)
    capacity = cache.layers[0].capacity
    assert store[0].shape[0] == store[2].shape[0] == store[3].shape[0] == capacity


def test_gdn_states_stay_in_the_same_buffers_across_turns(hybrid, monkeypatch):
    """Qwen3.5: eager forwards (each turn's prefill) build new GDN state tensors; the cache copies them into its
    persistent buffers before the compiled steps run, so every compiled step of every turn updates the same
    tensors in place (no CUDA-graph recording per turn) and the results still equal eager steps'."""
    from hf_raincheck.generation.decode import StaticStep

    seen = []
    original = StaticStep._run

    def recording(self, cache, turn, count, token, slot, chunk):
        states = {i: (s.state, s.conv) + ((s.prefix.recurrent, s.prefix.conv) if s.prefix is not None else ())
                  for i, s in cache.gdn_states.items()}
        seen.append((chunk is not None, states))
        return original(self, cache, turn, count, token, slot, chunk)

    monkeypatch.setattr(StaticStep, "_run", recording)
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="next_turn")
    inputs = two_images()
    out = run(hybrid, inputs, 12, cfg)
    first_turn = len(seen)
    nxt = _with_new_image(_extend(_extend(inputs, new_tokens(out, inputs)), [7, 8]))
    out2 = run(hybrid, nxt, 12, cfg, past=output_cache(out))
    eager = run(hybrid, inputs, 12, cfg, static=False)
    eager2 = run(hybrid, _with_new_image(_extend(_extend(inputs, new_tokens(eager, inputs)), [7, 8])), 12, cfg,
                 past=output_cache(eager), static=False)
    torch.testing.assert_close(torch.stack(out2.logits), torch.stack(eager2.logits), **TOL)
    assert 0 < first_turn < len(seen) and any(fused for fused, _ in seen[first_turn:])
    reference = seen[0][1]
    assert reference
    for fused, states in seen:
        for idx, tensors in states.items():
            assert all(a is b for a, b in zip(tensors[:2], reference[idx][:2])), "a GDN state moved"
    prefixes = {idx: tensors[2:] for fused, states in seen if fused for idx, tensors in states.items()}
    for fused, states in seen:
        if fused:
            for idx, tensors in states.items():
                assert len(tensors) == 4 and all(a is b for a, b in zip(tensors[2:], prefixes[idx]))
