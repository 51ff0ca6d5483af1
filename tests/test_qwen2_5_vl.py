"""Raincheck on a hand-built tiny random Qwen2.5-VL: plain generate, hand-built hard prefill, the eager reference.

The reference (`tests/reference_qwen3_vl.py`: schedule, explicit mask, one language-model forward) is family
independent except for its encoder; `helpers.encode_qwen2_5_vl` is its Qwen2.5-VL counterpart (no DeepStack,
positions from `get_rope_index` with ``second_per_grid_ts``). Nothing here uses the package to build expectations.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

sys.path.insert(0, os.path.dirname(__file__))

from helpers import _extend, _text, encode_qwen2_5_vl, generate, new_tokens, plan_of  # noqa: E402
from reference_qwen3_vl import build_schedule, run_reference  # noqa: E402

from hf_raincheck import DeferredPrefillCache, RaincheckConfig, complete_deferred, enable_raincheck  # noqa: E402
from hf_raincheck.conversation import output_cache  # noqa: E402
from hf_raincheck.models import get_adapter  # noqa: E402
from hf_raincheck.models.qwen2_5_vl import Qwen2_5_VLAdapter, raster_to_window, window_to_raster  # noqa: E402

VOCAB = 256
IMG, VID, VS, VE = 250, 251, 248, 249
PATCH = 3 * 2 * 14 * 14  # channels * temporal_patch_size * patch_size**2
EXACT = dict(atol=1e-5, rtol=1e-5)
TOL = dict(atol=2e-5, rtol=1e-4)


def _tiny_model(attn="eager", seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            bos_token_id=None,
            eos_token_id=None,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]),  # head_dim 16
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=64,
            window_size=56,  # windows of 2x2 merged tokens: tiny grids hold several windows (and padded ones)
            fullatt_block_indexes=[1],  # block 0 windowed, block 1 full
            tokens_per_second=2,
        ),
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VS,
        vision_end_token_id=VE,
    )
    cfg._attn_implementation = attn
    model = Qwen2_5_VLForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():  # random init is flat: sharpen the logits so greedy decoding is well separated
        model.lm_head.weight.mul_(20.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def model():
    return enable_raincheck(_tiny_model("eager"))


def two_images(seed=0):
    """text, image [1,8,8] (16 tokens, 4 windows), text, image [1,6,8] (12 tokens, padded windows), text."""
    gen = torch.Generator().manual_seed(seed)
    parts = [_text(3, gen)]
    for n, text in ((16, 2), (12, 4)):
        parts += [torch.tensor([VS]), torch.full((n,), IMG), torch.tensor([VE]), _text(text, gen)]
    ids = torch.cat(parts)[None].long()
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == IMG).long(),
        pixel_values=torch.randn(64 + 48, PATCH, generator=gen),
        image_grid_thw=torch.tensor([[1, 8, 8], [1, 6, 8]]),
    )


def image_video(seed=0):
    """text, image [1,4,8], text, one video [3,4,4]: a single contiguous run of 3 frames x 4 tokens, text.

    ``second_per_grid_ts`` 2.5 (x tokens_per_second 2) spaces the frames' temporal positions by 5, so they run
    past the text after the video: the decode positions then differ from get_rope_index's returned delta.
    """
    gen = torch.Generator().manual_seed(seed)
    parts = [_text(3, gen), torch.tensor([VS]), torch.full((8,), IMG), torch.tensor([VE]), _text(4, gen)]
    parts += [torch.tensor([VS]), torch.full((12,), VID), torch.tensor([VE]), _text(5, gen)]
    ids = torch.cat(parts)[None].long()
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=((ids == IMG).long() + 2 * (ids == VID).long()),
        pixel_values=torch.randn(32, PATCH, generator=gen),
        image_grid_thw=torch.tensor([[1, 4, 8]]),
        pixel_values_videos=torch.randn(48, PATCH, generator=gen),
        video_grid_thw=torch.tensor([[3, 4, 4]]),
        second_per_grid_ts=torch.tensor([2.5]),
    )


def reference(model, conv_inputs, forwards, plans, visibility="boundary"):
    return run_reference(model, encode_qwen2_5_vl(model, conv_inputs), forwards, plans, visibility)


# ---------------------------------------------------------------- adapter
def test_adapter_spans_and_frames(model):
    adapter = get_adapter(model)
    assert isinstance(adapter, Qwen2_5_VLAdapter)
    assert adapter.media_token_counts(torch.tensor([[1, 8, 8]]), torch.tensor([[3, 4, 4], [2, 4, 8]])) == (
        [16],
        [[4, 4, 4], [8, 8]],
    )
    inputs = image_video()
    L = inputs["input_ids"].shape[1]
    positions, delta = adapter.logical_positions(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"], inputs["video_grid_thw"], None,
        model_inputs=inputs,
    )
    _, rope_index_delta = model.model.get_rope_index(**{k: v for k, v in inputs.items() if "pixel" not in k})
    assert positions[0, 26] == positions[0, 18] + 10  # frame 3: 2 temporal steps of 5
    assert delta == int(positions[0, -1]) + 1 - L != int(rope_index_delta)  # generate continues from the last token
    with pytest.raises(ValueError, match="second_per_grid_ts has 2 entries but the conversation holds 1 videos"):
        generate(model, dict(inputs, second_per_grid_ts=torch.tensor([1.0, 2.0])), 2, RaincheckConfig())
    out = generate(model, inputs, 2, RaincheckConfig(policy="hard", retention=0.5))
    plan = output_cache(out).plan
    # the image is one span; the video's single run of placeholders is one span per frame (4 tokens each)
    assert plan.spans == [(4, 12), (18, 22), (22, 26), (26, 30)]
    assert plan.modalities == ["image", "video", "video", "video"]
    assert plan.budgets == [4, 2, 2, 2]


def test_window_order_helpers_match_the_vision_tower(model):
    inputs = two_images()
    grid = inputs["image_grid_thw"]
    visual = model.model.visual
    with torch.no_grad():
        out = visual(inputs["pixel_values"], grid_thw=grid)  # last_hidden_state: patches in window order
        merged_window = visual.merger(out.last_hidden_state)
        raster_patches = window_to_raster(model.config.vision_config, grid, out.last_hidden_state, level="patch")
    assert not torch.equal(merged_window, out.pooler_output)  # the tiny grids really are reordered
    torch.testing.assert_close(window_to_raster(model.config.vision_config, grid, merged_window), out.pooler_output)
    torch.testing.assert_close(visual.merger(raster_patches), out.pooler_output)
    torch.testing.assert_close(raster_to_window(model.config.vision_config, grid, out.pooler_output), merged_window)
    order = get_adapter(model).window_order(grid)
    assert torch.equal(order.window_index[order.reverse_index], torch.arange(16 + 12))


# ---------------------------------------------------------------- equal to plain generate
@pytest.mark.parametrize("make_inputs", [two_images, image_video], ids=["two_images", "image_video"])
@pytest.mark.parametrize("cfg", [RaincheckConfig(retention=1.0), RaincheckConfig(policy="full", retention=0.3)],
                         ids=["retention1", "policy_full"])
def test_retention_one_and_full_reproduce_plain_generate(model, make_inputs, cfg):
    inputs = make_inputs()
    plain = generate(model, inputs, 8)
    rc = generate(model, inputs, 8, cfg)
    assert new_tokens(rc, inputs) == new_tokens(plain, inputs)
    torch.testing.assert_close(torch.stack(rc.logits), torch.stack(plain.logits), **EXACT)
    cache = output_cache(rc)
    assert isinstance(cache, DeferredPrefillCache)
    assert cache.total_deferred == 0 and cache.pending == 0 and bool(cache.filled.all())


# ---------------------------------------------------------------- hard pruning
def test_hard_equals_prefill_of_kept_tokens_with_logical_positions(model):
    inputs = two_images()
    out = generate(model, inputs, 5, RaincheckConfig(policy="hard", retention=0.3))
    cache = output_cache(out)
    deferred, boundary = plan_of(cache)
    assert cache.pending == 0 and cache.total_deferred == len(deferred) == 11 + 8
    L = inputs["input_ids"].shape[1]
    keep = torch.tensor([i for i in range(L) if i not in set(deferred)])
    core = model.model
    with torch.no_grad():
        pos, _ = core.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                     image_grid_thw=inputs["image_grid_thw"])
        feats = core.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
        embeds = core.get_input_embeddings()(inputs["input_ids"])[0]
        embeds[inputs["input_ids"][0] == IMG] = torch.cat(feats.pooler_output)
        hidden = core.language_model(
            inputs_embeds=embeds[keep][None],
            position_ids=pos[:, :, keep],
            attention_mask=torch.ones(1, keep.numel(), dtype=torch.long),
        ).last_hidden_state
        first = model.lm_head(hidden[:, -1])[0]
    torch.testing.assert_close(out.logits[0][0], first, **TOL)
    n = len(out.logits)
    sched = build_schedule(L, deferred, n, policy="hard")
    ref = reference(model, _extend(inputs, new_tokens(out, inputs)), sched.forwards, [(deferred, boundary)])
    torch.testing.assert_close(torch.stack(out.logits)[:, 0], ref.at_many(sched.logit_rows), **TOL)


# ---------------------------------------------------------------- raincheck against the reference
CASES = {
    "in_decode": dict(cfg=dict(retention=0.3, chunk_size=4, guard_tokens=2), n=10),
    "blocking": dict(cfg=dict(retention=0.3, chunk_size=2, guard_tokens=3, completion_chunk_size=5,
                             completion="blocking"), n=6),
    "next_turn": dict(cfg=dict(retention=0.3, chunk_size=2, guard_tokens=3, completion="next_turn"), n=6),
}


@pytest.mark.parametrize("make_inputs", [two_images, image_video], ids=["two_images", "image_video"])
@pytest.mark.parametrize("case", list(CASES))
def test_step_and_next_turn_logits_match_reference(model, make_inputs, case):
    spec = CASES[case]
    cfg = RaincheckConfig(**spec["cfg"])
    inputs = make_inputs()
    L = inputs["input_ids"].shape[1]
    out = generate(model, inputs, spec["n"], cfg)
    cache = output_cache(out)
    deferred, boundary = plan_of(cache)
    gen1 = new_tokens(out, inputs)
    t1 = build_schedule(L, deferred, spec["n"], completion=cfg.completion,
                        completion_chunk_size=cfg.completion_chunk_size,
                        chunk_size=cfg.chunk_size, guard_tokens=cfg.guard_tokens)
    assert cache.pending == len(t1.pending)
    if case == "in_decode":
        assert cache.pending == 0 and cache.stats.during_decode == len(deferred)
    else:
        assert cache.stats.during_decode > 0
    # next turn: a text question; a pending plan folds into its prefill
    conv2 = _extend(inputs, gen1 + _text(4, torch.Generator().manual_seed(7)).tolist())
    L2 = conv2["input_ids"].shape[1]
    out2 = generate(model, conv2, 3, cfg, past=cache)
    assert cache.pending == 0 and bool(cache.filled.all())
    t2 = build_schedule(L2, [], 3, new_start=L + spec["n"] - 1, pending_before=t1.pending)
    ref = reference(model, _extend(conv2, new_tokens(out2, conv2)), t1.forwards + t2.forwards, [(deferred, boundary)])
    torch.testing.assert_close(torch.stack(out.logits)[:, 0], ref.at_many(t1.logit_rows), **TOL)
    torch.testing.assert_close(torch.stack(out2.logits)[:, 0], ref.at_many(t2.logit_rows), **TOL)


def test_new_image_in_later_turn_with_next_turn_completion(model):
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, guard_tokens=3, completion="next_turn")
    inputs = two_images(seed=1)
    L = inputs["input_ids"].shape[1]
    out = generate(model, inputs, 5, cfg)
    cache = output_cache(out)
    d1, b1 = plan_of(cache)
    assert cache.pending == len(d1) - 2
    gen1 = new_tokens(out, inputs)
    gen = torch.Generator().manual_seed(5)
    turn2 = torch.cat([_text(2, gen), torch.tensor([VS]), torch.full((8,), IMG), torch.tensor([VE]), _text(3, gen)])
    conv2 = dict(
        input_ids=torch.cat([inputs["input_ids"], torch.tensor([gen1]), turn2[None]], 1),
        pixel_values=torch.cat([inputs["pixel_values"], torch.randn(32, PATCH, generator=gen)]),
        image_grid_thw=torch.cat([inputs["image_grid_thw"], torch.tensor([[1, 4, 8]])]),
    )
    conv2["mm_token_type_ids"] = (conv2["input_ids"] == IMG).long()
    conv2["attention_mask"] = torch.ones_like(conv2["input_ids"])
    L2 = conv2["input_ids"].shape[1]
    out2 = generate(model, conv2, 6, cfg, past=cache)
    assert len(cache.plans) == 2 and cache.plans[0].pending == 0
    d2, b2 = plan_of(cache, 1)
    assert min(d2) >= L + len(gen1) - 1 and b2 < L2 and len(d2) == 8 - 3
    assert cache.stats.during_prefill == len(d1) - 2
    pending = cache.pending
    assert pending == len(d2) - 2 * 2
    assert complete_deferred(model, cache) == pending and cache.pending == 0 and bool(cache.filled.all())
    t1 = build_schedule(L, d1, 5, chunk_size=2, guard_tokens=3, completion="next_turn")
    t2 = build_schedule(L2, d2, 6, chunk_size=2, guard_tokens=3, completion="blocking", completion_chunk_size=256,
                        new_start=L + 4, pending_before=t1.pending)
    ref = reference(model, _extend(conv2, new_tokens(out2, conv2)), t1.forwards + t2.forwards, [(d1, b1), (d2, b2)])
    torch.testing.assert_close(torch.stack(out.logits)[:, 0], ref.at_many(t1.logit_rows), **TOL)
    torch.testing.assert_close(torch.stack(out2.logits)[:, 0], ref.at_many(t2.logit_rows), **TOL)


# ---------------------------------------------------------------- final cache, backends, static cache
@pytest.mark.parametrize("make_inputs", [two_images, image_video], ids=["two_images", "image_video"])
def test_restored_cache_does_not_depend_on_chunk_size(model, make_inputs):
    inputs = make_inputs()
    L = inputs["input_ids"].shape[1]
    caches = []
    for chunk, guard, cchunk in [(4, 2, 256), (1, 0, 3), (7, 5, 2)]:
        cfg = RaincheckConfig(retention=0.3, chunk_size=chunk, guard_tokens=guard, completion_chunk_size=cchunk,
                              completion="blocking")
        cache = output_cache(generate(model, inputs, 4, cfg))
        assert cache.pending == 0 and bool(cache.filled.all())
        caches.append(cache)
    # prompt slots (prefix, restored D, tail): generated tokens' entries legitimately depend on what was restored
    for cache in caches[1:]:
        for a, b in zip(cache.layers, caches[0].layers):
            torch.testing.assert_close(a.keys[:, :, :L], b.keys[:, :, :L], **TOL)
            torch.testing.assert_close(a.values[:, :, :L], b.values[:, :, :L], **TOL)


def test_sdpa_eager_and_static_agree(model):
    inputs = image_video()
    cfg = dict(retention=0.3, chunk_size=4, guard_tokens=2)
    outs = [generate(model, inputs, 8, RaincheckConfig(**cfg, attn_backend=b)) for b in ("eager", "sdpa")]
    outs.append(generate(model, inputs, 8, RaincheckConfig(**cfg), cache_implementation="static"))
    for out in outs[1:]:
        assert out.sequences.tolist() == outs[0].sequences.tolist()
        torch.testing.assert_close(torch.stack(out.logits), torch.stack(outs[0].logits), **TOL)


def test_later_turn_video_with_only_its_new_media(model):
    """A new video in turn 2, passed either with the whole conversation's processor outputs or only its own
    (then ``second_per_grid_ts`` covers the new video only and must not be applied to the cached one)."""
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, guard_tokens=1, completion="next_turn")
    inputs = image_video()
    L = inputs["input_ids"].shape[1]
    gen = torch.Generator().manual_seed(9)
    turn2 = torch.cat([_text(2, gen), torch.tensor([VS]), torch.full((8,), VID), torch.tensor([VE]), _text(3, gen)])
    video2 = dict(pixel_values_videos=torch.randn(32, PATCH, generator=gen), video_grid_thw=torch.tensor([[2, 4, 4]]),
                  second_per_grid_ts=torch.tensor([3.0]))
    runs = []
    for whole in (True, False):
        out = generate(model, inputs, 4, cfg)
        conv2 = dict(input_ids=torch.cat([out.sequences, turn2[None]], 1), **video2)
        conv2["mm_token_type_ids"] = 2 * (conv2["input_ids"] == VID).long() + (conv2["input_ids"] == IMG).long()
        if whole:
            for key in ("pixel_values", "image_grid_thw"):
                conv2[key] = inputs[key]
            for key in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
                conv2[key] = torch.cat([inputs[key], video2[key]])
        out2 = generate(model, conv2, 4, cfg, past=output_cache(out))
        runs.append((out, conv2, out2))
    torch.testing.assert_close(torch.stack(runs[1][2].logits), torch.stack(runs[0][2].logits), **TOL)
    out, conv2, out2 = runs[0]
    cache = output_cache(out)
    d1, b1 = plan_of(cache)
    d2, b2 = plan_of(cache, 1)
    assert cache.plans[1].spans == [(b2 - 8, b2 - 4), (b2 - 4, b2)]  # two frames of the new video
    L2 = conv2["input_ids"].shape[1]
    t1 = build_schedule(L, d1, 4, chunk_size=2, guard_tokens=1, completion="next_turn")
    t2 = build_schedule(L2, d2, 4, chunk_size=2, guard_tokens=1, completion="next_turn",
                        new_start=L + 3, pending_before=t1.pending)
    ref = reference(model, _extend(conv2, new_tokens(out2, conv2)), t1.forwards + t2.forwards, [(d1, b1), (d2, b2)])
    torch.testing.assert_close(torch.stack(out2.logits)[:, 0], ref.at_many(t2.logit_rows), **TOL)
