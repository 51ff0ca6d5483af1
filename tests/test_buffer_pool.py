"""Static caches' buffers pass from a finished conversation to the next (`hf_raincheck.cache.buffer_pool`), so the
CUDA graphs recorded for their addresses replay instead of recording again; a cache that is still alive keeps its
own, and a reused buffer starts from zeros."""

from __future__ import annotations

import dataclasses
import gc
import os
import sys

import pytest
import torch
import torch._dynamo

sys.path.insert(0, os.path.dirname(__file__))

from handmade import _conv, _tiny_model  # noqa: E402
from helpers import generate, new_tokens  # noqa: E402
from test_compiled_steps import compile_config  # noqa: E402

from hf_raincheck import RaincheckConfig, enable_raincheck, release_static_buffers  # noqa: E402
from hf_raincheck.cache.buffer_pool import POOL, StaticBufferPool  # noqa: E402
from hf_raincheck.conversation import output_cache  # noqa: E402

CFG = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking")


@pytest.fixture(scope="module")
def model():
    return enable_raincheck(_tiny_model("eager"))


@pytest.fixture(autouse=True)
def fresh(model):
    """Compiled steps traced once first: dynamo's tracing keeps the traced conversation's cache in reference
    cycles (freed by the next garbage collection); later conversations are freed by reference counting."""
    torch._dynamo.reset()
    static_run(model, images(5))
    gc.collect()
    release_static_buffers()
    yield
    torch._dynamo.reset()
    release_static_buffers()


def images(seed):
    return _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4], seed=seed)


def static_run(model, inputs, n=10):
    return generate(model, inputs, n, CFG, cache_implementation="static", compile_config=compile_config())


def addresses(cache) -> dict:
    """Every pooled buffer's role -> data pointer (KV layers, filled mask, scratch slots, deferred store)."""
    return {name: t.data_ptr() for name, t in cache.pooled_buffers.items()}


def test_pool_keeps_the_latest_buffer_per_role_and_zeroes_it():
    pool = StaticBufferPool()
    a, b = torch.ones(4), torch.full((4,), 2.0)
    pool.give({"x": a})
    pool.give({"x": b})  # the latest replaces the older one
    assert pool.nbytes() == 16
    got = pool.take("x", (4,), torch.float32, "cpu")
    assert got is b and torch.equal(got, torch.zeros(4)) and pool.nbytes() == 0
    pool.give({"x": torch.ones(4)})
    assert pool.take("x", (5,), torch.float32, "cpu") is None  # another layout: dropped, not handed out
    assert pool.take("x", (4,), torch.float32, "cpu") is None and pool.nbytes() == 0
    pool.give({"y": torch.ones(3, dtype=torch.long)})
    assert pool.take("y", (3,), torch.float32, "cpu") is None


def test_next_conversation_reuses_a_freed_caches_buffers_and_equals_a_fresh_run(model):
    first = static_run(model, images(0))
    used = addresses(output_cache(first))
    assert {"filled", "scratch_slots.5", "store.embeds", "store.valid", "layer0.keys", "layer0.values"} <= set(used)
    del first
    assert POOL.nbytes() > 0  # freed by reference counting: given back at once
    second = static_run(model, images(1))
    assert addresses(output_cache(second)) == used
    # reused buffers start from zeros: the same tokens and logits as a run on new buffers
    reference_inputs = images(1)
    del second
    release_static_buffers()
    fresh = static_run(model, reference_inputs)
    fresh_used, fresh_tokens = addresses(output_cache(fresh)), new_tokens(fresh, reference_inputs)
    fresh_logits = torch.stack(fresh.logits)
    del fresh
    static_run(model, images(0))  # a conversation in between, on the freed buffers; freed in turn
    reused = static_run(model, reference_inputs)
    assert addresses(output_cache(reused)) == fresh_used
    assert new_tokens(reused, reference_inputs) == fresh_tokens
    torch.testing.assert_close(torch.stack(reused.logits), fresh_logits, atol=0, rtol=0)


def test_a_conversation_with_another_chunk_size_leaves_this_ones_buffers(model):
    """The scratch slots have a chunk's length: a conversation with another chunk size in between keeps its own,
    so the next one with this chunk size takes the same buffers (the fused step's CUDA graph reads them at
    static addresses: a new buffer there recorded that graph again, 40-90 ms in the first fused step)."""
    first = static_run(model, images(0))
    used, scratch = addresses(output_cache(first)), output_cache(first).scratch_slots
    del first
    other = dataclasses.replace(CFG, chunk_size=3)
    between = generate(model, images(1), 10, other, cache_implementation="static", compile_config=compile_config())
    assert output_cache(between).scratch_slots.shape == (3,)
    del between
    gc.collect()  # (its steps were traced for chunk 3: the trace keeps the cache in reference cycles, see `fresh`)
    again = static_run(model, images(2))
    cache = output_cache(again)
    assert cache.scratch_slots is scratch and addresses(cache) == used


def test_a_live_cache_keeps_its_buffers(model):
    first = static_run(model, images(0))
    second = static_run(model, images(1))
    a, b = addresses(output_cache(first)), addresses(output_cache(second))
    assert not set(a.values()) & set(b.values())
    assert POOL.nbytes() == 0  # nothing was freed


def test_release_static_buffers_empties_the_pool(model):
    out = static_run(model, images(0))
    cache = output_cache(out)
    expected = sum(t.numel() * t.element_size() for t in cache.pooled_buffers.values())
    del out, cache
    assert POOL.nbytes() == expected
    assert release_static_buffers() == expected and POOL.nbytes() == 0


def test_dynamic_caches_are_not_pooled(model):
    out = generate(model, images(0), 6, CFG)
    assert output_cache(out).pooled_buffers is None
    del out
    assert POOL.nbytes() == 0


def test_copy_pairs_copies_each_pair_in_few_launches_and_keeps_order_when_memory_is_shared(monkeypatch):
    from hf_raincheck.cache.buffer_pool import copy_pairs

    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: (calls.append(len(dst)), real(dst, src)))
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(2, 3, 6, generator=gen)
    sources = [torch.randn(2, 3, generator=gen), torch.randn(4, generator=gen).to(torch.bfloat16),
               torch.randn(5, generator=gen), wide[..., :4], torch.randn(3, generator=gen).to(torch.bfloat16)]
    targets = [torch.empty_like(s, memory_format=torch.contiguous_format) for s in sources]
    copy_pairs(list(zip(targets, sources)))
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))
    assert sorted(calls) == [2, 2]  # float32 and bfloat16 contiguous pairs; the strided view on its own
    # a source that is a destination's memory: the pairs in order, one by one
    calls.clear()
    a, b, x = torch.zeros(3), torch.zeros(3), torch.ones(3)
    copy_pairs([(a, x), (b, a)])
    assert torch.equal(b, x) and calls == []
