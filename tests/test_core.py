"""Raincheck core on a hand-built tiny Qwen3-VL, checked against plain generate and the independent reference."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from handmade import IMG, VID, _conv, _extend, _text, _tiny_model, _video_conv  # noqa: E402
from helpers import generate, new_tokens, plan_of  # noqa: E402
from reference_qwen3_vl import build_schedule, plan_boundary, reference_logits  # noqa: E402

from hf_raincheck import DeferredPrefillCache, RaincheckConfig, complete_deferred, enable_raincheck  # noqa: E402
from hf_raincheck import transformers_coupling as hf  # noqa: E402
from hf_raincheck.conversation import output_cache  # noqa: E402

TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def model():
    return enable_raincheck(_tiny_model("eager"))


def two_images(seed=0):
    return _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4], seed=seed)


# ---------------------------------------------------------------- equal to plain generate
@pytest.mark.parametrize("make_inputs", [two_images, _video_conv], ids=["two_images", "image_video"])
@pytest.mark.parametrize("cfg", [RaincheckConfig(retention=1.0), RaincheckConfig(policy="full", retention=0.3)],
                         ids=["retention1", "policy_full"])
def test_retention_one_and_full_reproduce_plain_generate(model, make_inputs, cfg):
    inputs = make_inputs()
    plain = generate(model, inputs, 10)
    rc = generate(model, inputs, 10, cfg)
    assert new_tokens(rc, inputs) == new_tokens(plain, inputs)
    torch.testing.assert_close(torch.stack(rc.logits), torch.stack(plain.logits), **TOL)
    cache = output_cache(rc)
    assert isinstance(cache, DeferredPrefillCache)
    assert cache.total_deferred == 0 and cache.pending == 0 and bool(cache.filled.all())


def test_prompt_without_images_runs_as_plain_generation(model):
    ids = _text(12, torch.Generator().manual_seed(3))[None]
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    plain = generate(model, inputs, 8)
    rc = generate(model, inputs, 8, RaincheckConfig())
    assert new_tokens(rc, inputs) == new_tokens(plain, inputs)
    assert output_cache(rc).plan is None


# ---------------------------------------------------------------- hard pruning
def test_hard_equals_prefill_of_kept_tokens_with_logical_positions(model):
    inputs = two_images()
    out = generate(model, inputs, 6, RaincheckConfig(policy="hard", retention=0.3))
    cache = output_cache(out)
    deferred, boundary = plan_of(cache)
    assert cache.pending == 0 and cache.total_deferred == len(deferred) == 22
    # hand-built prefill of I_0 with logical positions: embeddings, DeepStack, M-RoPE ids of the full input
    L = inputs["input_ids"].shape[1]
    keep = torch.tensor([i for i in range(L) if i not in set(deferred)])
    core = model.model
    with torch.no_grad():
        pos, _ = core.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                     image_grid_thw=inputs["image_grid_thw"])
        feats = core.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
        embeds = core.get_input_embeddings()(inputs["input_ids"])[0]
        image_rows = (inputs["input_ids"][0] == IMG).nonzero().squeeze(1)
        embeds[image_rows] = torch.cat(feats.pooler_output)
        deepstack = [torch.cat(f) for f in feats.deepstack_features]
        visual = torch.zeros(L, dtype=torch.bool)
        visual[image_rows] = True
        kept_visual = visual[keep]
        ds_full = [torch.zeros(L, f.shape[-1]).index_copy(0, image_rows, f) for f in deepstack]
        hidden = core.language_model(
            inputs_embeds=embeds[keep][None], position_ids=pos[:, :, keep],
            attention_mask=torch.ones(1, keep.numel(), dtype=torch.long),
            visual_pos_masks=kept_visual[None], deepstack_visual_embeds=[f[keep][kept_visual] for f in ds_full],
        ).last_hidden_state
        first = model.lm_head(hidden[:, -1])[0]
    torch.testing.assert_close(out.logits[0][0], first, **TOL)
    # every step against the reference's hard schedule
    n = len(out.logits)
    conv = _extend(inputs, new_tokens(out, inputs))
    sched = build_schedule(L, deferred, n, policy="hard")
    ref = reference_logits(model, conv, sched.forwards, [(deferred, boundary)])
    torch.testing.assert_close(torch.stack(out.logits)[:, 0], ref.at_many(sched.logit_rows), **TOL)


# ---------------------------------------------------------------- against the independent reference
CASES = {
    # restoration finishes inside decoding
    "in_decode": dict(cfg=dict(retention=0.3, chunk_size=3, guard_tokens=2), n=12),
    # the answer ends first, blocking completion
    "blocking": dict(cfg=dict(retention=0.3, chunk_size=2, guard_tokens=4, completion_chunk_size=5,
                             completion="blocking"), n=7),
    # the answer ends first, the rest folds into the next turn's prefill
    "next_turn": dict(cfg=dict(retention=0.3, chunk_size=2, guard_tokens=4, completion="next_turn"), n=7),
    "causal_visibility": dict(cfg=dict(retention=0.5, chunk_size=3, guard_tokens=1, visibility="causal",
                                      completion="blocking"), n=6),
    "random_selector": dict(cfg=dict(retention=0.4, chunk_size=5, guard_tokens=0, pruning="random", seed=3), n=5),
}


@pytest.mark.parametrize("make_inputs", [two_images, _video_conv], ids=["two_images", "image_video"])
@pytest.mark.parametrize("case", list(CASES))
def test_step_and_next_turn_logits_match_reference(model, make_inputs, case):
    spec = CASES[case]
    cfg = RaincheckConfig(**spec["cfg"])
    inputs = make_inputs()
    L = inputs["input_ids"].shape[1]
    n = spec["n"]
    out = generate(model, inputs, n, cfg)
    cache = output_cache(out)
    deferred, boundary = plan_of(cache)
    assert deferred and boundary == max(e for s, e in cache.plan.spans)
    gen1 = new_tokens(out, inputs)

    # turn 2: the whole conversation so far plus a new question, on the returned cache
    question = _text(5, torch.Generator().manual_seed(11)).tolist()
    conv2 = _extend(inputs, gen1 + question)
    out2 = generate(model, conv2, 3, cfg, past=cache)
    assert cache.pending == 0 and bool(cache.filled.all())
    gen2 = new_tokens(out2, conv2)

    t1 = build_schedule(L, deferred, n, chunk_size=cfg.chunk_size, guard_tokens=cfg.guard_tokens,
                        completion=cfg.completion, completion_chunk_size=cfg.completion_chunk_size)
    L2 = conv2["input_ids"].shape[1]
    t2 = build_schedule(L2, [], 3, new_start=L + n - 1, pending_before=t1.pending)
    full = _extend(conv2, gen2)
    ref = reference_logits(model, full, t1.forwards + t2.forwards, [(deferred, boundary)], visibility=cfg.visibility)
    torch.testing.assert_close(torch.stack(out.logits)[:, 0], ref.at_many(t1.logit_rows), **TOL)
    torch.testing.assert_close(torch.stack(out2.logits)[:, 0], ref.at_many(t2.logit_rows), **TOL)


def test_new_image_in_later_turn_gets_its_own_plan(model):
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, guard_tokens=3, completion="next_turn")
    inputs = _conv([(1, 8, 8)], [3, 4], seed=1)
    L = inputs["input_ids"].shape[1]
    out = generate(model, inputs, 6, cfg)
    cache = output_cache(out)
    d1, b1 = plan_of(cache)
    assert cache.pending > 0
    gen1 = new_tokens(out, inputs)
    # turn 2 adds a new image: the old plan's rest folds into the prefill, the new image is deferred in turn
    img2 = _conv([(1, 4, 8)], [2, 3], seed=5)
    conv2 = dict(
        input_ids=torch.cat([inputs["input_ids"], torch.tensor([gen1]), img2["input_ids"]], 1),
        pixel_values=torch.cat([inputs["pixel_values"], img2["pixel_values"]]),
        image_grid_thw=torch.cat([inputs["image_grid_thw"], img2["image_grid_thw"]]),
    )
    conv2["mm_token_type_ids"] = (conv2["input_ids"] == IMG).long()
    conv2["attention_mask"] = torch.ones_like(conv2["input_ids"])
    L2 = conv2["input_ids"].shape[1]
    out2 = generate(model, conv2, 8, cfg, past=cache)
    assert len(cache.plans) == 2 and cache.plans[0].pending == 0
    d2, b2 = plan_of(cache, 1)
    assert min(d2) >= L + len(gen1) - 1 and b2 < L2
    gen2 = new_tokens(out2, conv2)
    pending = cache.pending
    assert pending == max(0, len(d2) - 2 * (8 - 1 - 3))
    assert complete_deferred(model, cache) == pending and cache.pending == 0 and bool(cache.filled.all())
    t1 = build_schedule(L, d1, 6, chunk_size=2, guard_tokens=3, completion="next_turn")
    t2 = build_schedule(L2, d2, 8, chunk_size=2, guard_tokens=3, completion="next_turn",
                        new_start=L + 5, pending_before=t1.pending)
    ref = reference_logits(model, _extend(conv2, gen2), t1.forwards + t2.forwards, [(d1, b1), (d2, b2)])
    torch.testing.assert_close(torch.stack(out.logits)[:, 0], ref.at_many(t1.logit_rows), **TOL)
    torch.testing.assert_close(torch.stack(out2.logits)[:, 0], ref.at_many(t2.logit_rows), **TOL)


# ---------------------------------------------------------------- exactly once, chunk independence
def _spy_writes(cache):
    writes = []
    update = cache.update

    def spy(key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            writes.extend(cache.forward_context.write_slots.tolist())
        return update(key_states, value_states, layer_idx, *args, **kwargs)

    cache.update = spy
    return writes


@pytest.mark.parametrize("completion", ["blocking", "next_turn"])
def test_every_deferred_token_is_prefilled_exactly_once(model, completion):
    inputs = two_images()
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion=completion, completion_chunk_size=4)
    cache = DeferredPrefillCache(len(model.model.language_model.layers))
    writes = _spy_writes(cache)
    out = generate(model, inputs, 6, cfg, past=cache)
    deferred = cache.plan.deferred.tolist()
    if completion == "next_turn":
        assert cache.pending == len(deferred) - 3 * 3  # decode steps 3, 4, 5 carried 3 each
        assert complete_deferred(model, cache, max_tokens=5) == 5
        assert complete_deferred(model, cache) == len(deferred) - 9 - 5
    assert cache.pending == 0 and complete_deferred(model, cache) == 0
    L = inputs["input_ids"].shape[1]
    assert sorted(writes) == list(range(L + 5))  # every slot once: prompt, deferred, y_1..y_5
    assert cache.stats.during_decode == 9
    assert cache.stats.during_decode + cache.stats.after_answer == len(deferred)
    del out


def test_deferred_entries_and_next_turn_do_not_depend_on_completion_chunks(model):
    inputs = two_images()
    question = _text(4, torch.Generator().manual_seed(2)).tolist()
    results = []
    for completion, cchunk in [("blocking", 256), ("blocking", 3), ("next_turn", 256)]:
        cfg = RaincheckConfig(retention=0.3, chunk_size=2, guard_tokens=3, completion=completion,
                              completion_chunk_size=cchunk)
        out = generate(model, inputs, 6, cfg)
        conv2 = _extend(inputs, new_tokens(out, inputs) + question)
        out2 = generate(model, conv2, 2, cfg, past=output_cache(out))
        cache = output_cache(out)
        deferred = cache.plan.deferred
        results.append((torch.stack(out2.logits), [layer.keys[:, :, deferred] for layer in cache.layers]))
    for logits, keys in results[1:]:
        torch.testing.assert_close(logits, results[0][0], **TOL)
        for a, b in zip(keys, results[0][1]):
            torch.testing.assert_close(a, b, **TOL)
    # deferred entries do not depend on chunk_size / guard either (they see only the prefix)
    other = generate(model, inputs, 6, RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=0, completion="blocking"))
    deferred = output_cache(other).plan.deferred
    for a, b in zip([layer.keys[:, :, deferred] for layer in output_cache(other).layers], results[0][1]):
        torch.testing.assert_close(a, b, **TOL)


# ---------------------------------------------------------------- backends, caches, sampling
def test_sdpa_and_eager_backends_agree(model):
    inputs = _video_conv()
    outs = [generate(model, inputs, 8, RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=1, attn_backend=b))
            for b in ("eager", "sdpa", "auto")]
    for out in outs[1:]:
        assert out.sequences.tolist() == outs[0].sequences.tolist()
        torch.testing.assert_close(torch.stack(out.logits), torch.stack(outs[0].logits), **TOL)


def test_static_cache_matches_dynamic(model):
    inputs = two_images()
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="next_turn")
    dyn = generate(model, inputs, 8, cfg)
    sta = generate(model, inputs, 8, cfg, cache_implementation="static")
    assert output_cache(sta).static
    assert sta.sequences.tolist() == dyn.sequences.tolist()
    torch.testing.assert_close(torch.stack(sta.logits), torch.stack(dyn.logits), **TOL)
    question = [5, 6, 7]
    conv2 = _extend(inputs, new_tokens(dyn, inputs) + question)
    a = generate(model, conv2, 3, cfg, past=output_cache(dyn))
    b = generate(model, conv2, 3, cfg, past=output_cache(sta))
    torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), **TOL)


def test_sampling_with_seed_is_reproducible(model):
    inputs = two_images()
    cfg = RaincheckConfig(retention=0.3, chunk_size=4, guard_tokens=2)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        out = generate(model, inputs, 10, cfg, do_sample=True, temperature=0.9, top_p=0.9, top_k=50,
                       repetition_penalty=1.1, output_logits=False)
        runs.append(out.sequences.tolist())
    assert runs[0] == runs[1]


def test_plain_generate_still_works_after_enable(model):
    inputs = two_images()
    ref = _tiny_model("eager")
    a = generate(model, inputs, 5)
    b = generate(ref, inputs, 5)
    assert a.sequences.tolist() == b.sequences.tolist()
    assert enable_raincheck(model) is model  # idempotent
    assert not hasattr(ref, "_raincheck_state")  # instance-level patching only


def test_later_turn_may_pass_only_its_new_media(model):
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, guard_tokens=1, completion="next_turn")
    inputs = _conv([(1, 8, 8)], [3, 4], seed=1)
    img2 = _conv([(1, 4, 8)], [2, 3], seed=5)
    logits = []
    for whole in (True, False):
        out = generate(model, inputs, 4, cfg)
        ids2 = torch.cat([out.sequences, img2["input_ids"]], 1)
        conv2 = dict(input_ids=ids2, pixel_values=img2["pixel_values"], image_grid_thw=img2["image_grid_thw"])
        if whole:
            conv2["pixel_values"] = torch.cat([inputs["pixel_values"], img2["pixel_values"]])
            conv2["image_grid_thw"] = torch.cat([inputs["image_grid_thw"], img2["image_grid_thw"]])
        logits.append(torch.stack(generate(model, conv2, 4, cfg, past=output_cache(out)).logits))
    torch.testing.assert_close(logits[0], logits[1], **TOL)


def test_the_cache_under_either_name(model):
    """generate takes the cache under the names the installed transformers takes (coupling point 17):
    ``past_key_values`` in 5.23; ``cache`` from 5.24, where ``past_key_values`` still works with a `FutureWarning`
    and the two at once are refused. The next turn is the same whichever name carried the cache."""
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, guard_tokens=1, completion="next_turn")
    inputs = two_images()
    names = ["past_key_values", "cache"] if hf.CACHE_NAMES_CHANGED else ["past_key_values"]
    logits = []
    for name in names:
        out = generate(model, inputs, 4, cfg)
        cache = hf.output_cache(out)
        assert isinstance(cache, DeferredPrefillCache) and cache.pending > 0
        conv2 = _extend(_extend(inputs, out.sequences[0, inputs["input_ids"].shape[1]:]), [5, 6, 7])
        warns = pytest.warns(FutureWarning, match="`past_key_values` is deprecated") if (
            hf.CACHE_NAMES_CHANGED and name == "past_key_values") else contextlib.nullcontext()
        with warns, torch.no_grad():
            out2 = model.generate(**conv2, raincheck_config=cfg, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True, **{name: cache})
        assert hf.output_cache(out2) is cache and cache.plans[0].deferred.numel() > 0
        logits.append(torch.stack(out2.logits))
    for other in logits[1:]:
        torch.testing.assert_close(other, logits[0], rtol=0, atol=0)
    if hf.CACHE_NAMES_CHANGED:
        with pytest.raises(ValueError, match="generate: cache and past_key_values are both set"):
            model.generate(**conv2, raincheck_config=cfg, max_new_tokens=2, cache=cache,
                           past_key_values=DeferredPrefillCache(1))


def test_cache_argument_and_output_cache_work_on_either_version(model):
    """`conversation.cache_argument` passes a returned cache back under the installed transformers' name and
    `conversation.output_cache` reads it from an output, neither with a deprecation warning (the examples' way)."""
    import warnings

    from hf_raincheck.conversation import cache_argument, output_cache

    cfg = RaincheckConfig(retention=0.3, chunk_size=2, guard_tokens=1, completion="next_turn")
    inputs = two_images()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = generate(model, inputs, 4, cfg)
        cache = output_cache(out)
        assert cache_argument(cache) == {hf.CACHE_ARGUMENT: cache} and cache.pending > 0
        conv2 = _extend(_extend(inputs, out.sequences[0, inputs["input_ids"].shape[1]:]), [5, 6, 7])
        with torch.no_grad():
            out2 = model.generate(**conv2, **cache_argument(cache), raincheck_config=cfg, max_new_tokens=2,
                                  do_sample=False, return_dict_in_generate=True)
    assert output_cache(out2) is cache and cache.length == conv2["input_ids"].shape[1] + 1


def test_prompt_longer_than_the_initial_slot_buffer(model):
    """A prompt past the bookkeeping's initial 256 slots: decode steps grow it before using the next slot."""
    inputs = _conv([(1, 8, 8)], [290, 5])
    plain = generate(model, inputs, 4)
    rc = generate(model, inputs, 4, RaincheckConfig(retention=0.5, guard_tokens=0, chunk_size=3, completion="blocking"))
    assert inputs["input_ids"].shape[1] > 256
    assert output_cache(rc).stats.during_decode == output_cache(rc).total_deferred == 8
    assert new_tokens(rc, inputs)[:1] == new_tokens(plain, inputs)[:1]
