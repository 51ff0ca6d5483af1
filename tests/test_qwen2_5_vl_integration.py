"""Raincheck on the tiny random Qwen2.5-VL checkpoint, end to end through its real processor.

The checkpoint (`hf_raincheck.testing.build_tiny_qwen2_5_vl`) loads through ``AutoModelForImageTextToText`` /
``AutoProcessor``; its vision tower runs window attention with windows (2x2 merged tokens) smaller than every test
image's merged grid, so the tower's window order differs from the placeholders' raster order. Expectations come from
plain ``generate``, from the eager reference (`tests/reference_qwen3_vl.py` with `helpers.encode_qwen2_5_vl`), and,
for the selectors, from the plain-loop references fed with ViT attention recorded by an attention function of the
test's own (window order undone with transformers' ``get_vision_window_index``).
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
import torch
from transformers import (
    AttentionInterface,
    AutoConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    TextIteratorStreamer,
    pipeline,
)
from transformers.video_utils import VideoMetadata
from transformers.vision_utils import get_vision_window_index

sys.path.insert(0, os.path.dirname(__file__))

from helpers import encode_qwen2_5_vl, generate, new_tokens, plan_of, whole_conversation  # noqa: E402
from reference_qwen3_vl import build_schedule, run_reference  # noqa: E402

from hf_raincheck import transformers_coupling as hf  # noqa: E402
from hf_raincheck import DeferredPrefillCache, RaincheckConfig, complete_deferred, enable_raincheck  # noqa: E402
from hf_raincheck.conversation import next_turn_inputs, output_cache  # noqa: E402
from hf_raincheck.pruning import SelectionContext  # noqa: E402
from hf_raincheck.pruning.base import VISION_ATTENTION, VISION_DEPTH, VISION_HIDDEN  # noqa: E402
from hf_raincheck.pruning.naive import NAIVE  # noqa: E402
from hf_raincheck.testing import chat_inputs, load_tiny_qwen2_5_vl, make_image, make_video  # noqa: E402

TOL = dict(atol=2e-5, rtol=1e-4)
QUESTION = "What is in the picture?"
#: 4 frames at 0.25 fps: ``second_per_grid_ts`` 8 s, i.e. the two temporal steps' positions 16 apart
#: (tokens_per_second 2), which run past the text after the video (it continues after ``max(h, w)`` of the 4x4
#: merged frame) and past the whole prompt.
VIDEO_FPS = 0.25


@pytest.fixture(scope="module")
def vl(tiny_qwen2_5_vl_path):
    model, processor = load_tiny_qwen2_5_vl(tiny_qwen2_5_vl_path)
    return enable_raincheck(model), processor


def _image_messages(*images, text=QUESTION):
    content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def two_images(processor):
    """A 128x128 image (5x5 merged grid: 3x3 windows, padded) and a 256x192 one (7x9: 4x5 windows, padded)."""
    return chat_inputs(processor, _image_messages(make_image(0), make_image(1, (256, 192))))


def video(processor, seed=5, text="What happens?"):
    messages = [{"role": "user", "content": [{"type": "video", "video": make_video(seed)}, {"type": "text", "text": text}]}]
    meta = VideoMetadata(total_num_frames=4, fps=VIDEO_FPS)
    return chat_inputs(processor, messages, processor_kwargs={"video_metadata": [meta]})


# ---------------------------------------------------------------------------------------------------- checkpoint
def test_checkpoint_is_a_qwen2_5_vl_with_a_real_processor(tiny_qwen2_5_vl_path, tiny_qwen2_5_vl):
    model, processor = tiny_qwen2_5_vl
    assert AutoConfig.from_pretrained(tiny_qwen2_5_vl_path).model_type == "qwen2_5_vl"
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration) and isinstance(processor, Qwen2_5_VLProcessor)
    assert type(processor.tokenizer).__name__ == "Qwen2Tokenizer"
    assert type(processor.video_processor).__name__ == "Qwen2VLVideoProcessor"
    assert model.config.image_token_id == processor.image_token_id
    assert model.config.video_token_id == processor.video_token_id
    vision = model.config.vision_config
    assert (vision.patch_size, vision.spatial_merge_size, vision.window_size, list(vision.fullatt_block_indexes)) == (
        14, 2, 56, [1]
    )
    # Qwen2.5-VL's template: a default system prompt
    assert processor.apply_chat_template(_image_messages(make_image(0)), add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{QUESTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    inputs = two_images(processor)
    grid = inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 10, 10], [1, 14, 18]]  # 128x128 -> 140x140, 256 wide x 192 high -> 252x196
    assert int((inputs["input_ids"] == processor.image_token_id).sum()) == 25 + 63
    # windows smaller than the merged grids: 3x3 + 5x4 windows, and a window order that is not the raster order
    window_index, cu_windows = get_vision_window_index(
        grid, spatial_merge_size=2, window_size=vision.window_size, patch_size=vision.patch_size
    )
    assert torch.unique_consecutive(cu_windows).numel() - 1 == 9 + 20
    assert not torch.equal(window_index, torch.arange(25 + 63))
    v = video(processor)
    assert v["video_grid_thw"].tolist() == [[2, 8, 8]] and v["second_per_grid_ts"].tolist() == [2 / VIDEO_FPS]
    # the video processor (torch-only without torchvision) and the PIL image processor agree on a still video at a
    # size that needs no resampling
    image = make_image(6, (112, 112))
    img = processor.image_processor(images=[image], return_tensors="pt")
    vid = processor.video_processor(videos=[np.stack([np.asarray(image)] * 2)], return_tensors="pt")
    assert vid["video_grid_thw"].tolist() == img["image_grid_thw"].tolist() == [[1, 8, 8]]
    torch.testing.assert_close(vid["pixel_values_videos"], img["pixel_values"], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------- plain generate
@pytest.mark.parametrize("make_inputs", [two_images, video], ids=["two_images", "video"])
@pytest.mark.parametrize(
    "cfg", [RaincheckConfig(retention=1.0), RaincheckConfig(policy="full", retention=0.3)], ids=["retention1", "full"]
)
def test_retention_one_and_full_reproduce_plain_generate(vl, make_inputs, cfg):
    model, processor = vl
    inputs = make_inputs(processor)
    plain = generate(model, inputs, 8)
    rc = generate(model, inputs, 8, cfg)
    assert new_tokens(rc, inputs) == new_tokens(plain, inputs)
    torch.testing.assert_close(torch.stack(rc.logits), torch.stack(plain.logits), **TOL)
    cache = output_cache(rc)
    assert isinstance(cache, DeferredPrefillCache)
    assert cache.total_deferred == 0 and cache.pending == 0 and bool(cache.filled.all())


# ---------------------------------------------------------------------------------------------------- selectors
SELECTORS = {"mmtok": {}, "hiprune": {"alpha": 2.0}, "divprune": {}, "visionzip": {}}  # hiprune: anchors from block 0


@pytest.mark.parametrize("policy", ["hard", "raincheck"])
@pytest.mark.parametrize("make_inputs", [two_images, video], ids=["two_images", "video"])
def test_policies_with_every_selector(vl, policy, make_inputs):
    model, processor = vl
    inputs = make_inputs(processor)
    L = inputs["input_ids"].shape[1]
    for name, options in SELECTORS.items():
        cfg = RaincheckConfig(policy=policy, retention=0.3, pruning=name, pruning_options=options, chunk_size=4,
                              guard_tokens=2, completion="blocking")
        out = generate(model, inputs, 6, cfg)
        cache = output_cache(out)
        plan = cache.plan
        assert len(plan.spans) == 2, name  # two images, or the video's two temporal steps
        for (start, stop), budget in zip(plan.spans, plan.budgets):
            assert budget == cfg.kept_budget(stop - start)
            assert int(((plan.kept >= start) & (plan.kept < stop)).sum()) == budget
        deferred = plan.deferred
        assert cache.total_deferred == deferred.numel() == sum(b - a for a, b in plan.spans) - sum(plan.budgets)
        if policy == "hard":  # the deferred slots stay empty for good
            assert cache.pending == 0 and cache.dropped == deferred.numel()
            assert (~cache.filled).nonzero().squeeze(1).tolist() == deferred.tolist()
        else:  # restored during decoding (steps 3..5 carry 4 each), the rest before generate returns (blocking)
            assert cache.pending == 0 and bool(cache.filled.all())
            assert cache.stats.during_decode == min(12, deferred.numel())
        assert cache.filled.numel() == L + 5


def _recorded_vit_features(model, inputs):
    """ViT features for the selectors, computed without the package: the attention each patch receives in each
    block (an attention function of this test records the eager weights of every window / image segment, in the
    tower's window order) and the last block's output, both mean-pooled per merged token and put in raster order
    with transformers' own ``get_vision_window_index``; plus the merger outputs (raster order already)."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    records = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        out, weights = modeling_qwen2_5_vl.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
        records.setdefault(id(module), []).append(weights[0])  # [heads, n, n] of one segment
        return out, weights

    AttentionInterface.register("raincheck_test_recording", record)
    visual, vision = model.model.visual, model.config.vision_config
    grid = inputs["image_grid_thw"]
    implementation = visual.config._attn_implementation
    visual.config._attn_implementation = "raincheck_test_recording"
    try:
        with torch.no_grad():
            out = visual(inputs["pixel_values"], grid_thw=grid, return_dict=True)
    finally:
        visual.config._attn_implementation = implementation
    window_index, _ = get_vision_window_index(
        grid, spatial_merge_size=vision.spatial_merge_size, window_size=vision.window_size, patch_size=vision.patch_size
    )
    unit = vision.spatial_merge_size**2

    def raster(per_patch, reorder=True):
        merged = per_patch.reshape(-1, unit, *per_patch.shape[1:]).mean(dim=1)
        if not reorder:
            return merged
        result = torch.empty_like(merged)
        result[window_index] = merged  # window position i holds raster token window_index[i]
        return result

    received = [torch.cat([w.sum(dim=-2).mean(dim=0) for w in records[id(block.attn)]]) for block in visual.blocks]
    return {
        "embeddings": out.pooler_output,
        VISION_ATTENTION: {b: raster(r) for b, r in enumerate(received)},
        VISION_HIDDEN: raster(out.last_hidden_state),
        "window_ordered": {b: raster(r, reorder=False) for b, r in enumerate(received)},
    }


def test_selectors_see_vit_features_in_placeholder_order(tiny_qwen2_5_vl_path):
    """hiprune (anchors from windowed block 0, registers from full block 1), visionzip (block 1) and mmtok (last
    block's output) keep exactly what their plain-loop references keep on independently recorded ViT features; the
    same references on features left in window order keep something else (the check has teeth)."""
    model, processor = load_tiny_qwen2_5_vl(tiny_qwen2_5_vl_path)  # its own: the test switches the ViT attention
    enable_raincheck(model)
    inputs = two_images(processor)
    ids = inputs["input_ids"][0]
    feats = _recorded_vit_features(model, inputs)
    question = torch.tensor(processor.tokenizer(QUESTION)["input_ids"])
    with torch.no_grad():
        query_embeds = model.model.get_input_embeddings()(question)
    for name, options in SELECTORS.items():
        if name == "divprune":
            continue  # merger outputs only: no window order involved
        out = generate(model, inputs, 1, RaincheckConfig(policy="hard", retention=0.3, pruning=name,
                                                         pruning_options=options))
        plan = output_cache(out).plan

        def expected(attention):
            ctx = SelectionContext(
                input_ids=ids, spans=plan.spans, budgets=plan.budgets, modalities=plan.modalities,
                grids=[(1, h // 2, w // 2) for _, h, w in inputs["image_grid_thw"].tolist()],
                embeddings=feats["embeddings"], query_ids=question, query_embeds=query_embeds, options=dict(options),
                extras={VISION_ATTENTION: attention, VISION_HIDDEN: feats[VISION_HIDDEN], VISION_DEPTH: 2},
            )
            return NAIVE[name](ctx, **options).tolist()

        assert plan.kept.tolist() == expected(feats[VISION_ATTENTION]), name
        if name != "mmtok":
            assert plan.kept.tolist() != expected(feats["window_ordered"]), name


# ---------------------------------------------------------------------------------------------------- multi-turn
def test_new_image_in_turn_two_matches_the_eager_reference(vl):
    """Turn 1 defers most of an image and folds the rest into turn 2 (``next_turn``); turn 2, built with
    `next_turn_inputs`, adds a new image with its own plan. Every step's logits of both turns equal the reference's."""
    model, processor = vl
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="next_turn", pruning="hiprune",
                          pruning_options={"alpha": 2.0})
    turn1 = chat_inputs(processor, _image_messages(make_image(3, (256, 256))))
    L1 = turn1["input_ids"].shape[1]
    out1 = generate(model, turn1, 6, cfg)
    cache = output_cache(out1)
    d1, b1 = plan_of(cache)
    assert len(d1) == 81 - 25 and cache.pending == len(d1) - 3 * 3
    turn2 = next_turn_inputs(processor, out1.sequences, _image_messages(make_image(4), text="And this one?"))
    L2 = turn2["input_ids"].shape[1]
    assert turn2["image_grid_thw"].tolist() == [[1, 10, 10]]  # only the new image is processed
    pending1 = cache.pending
    out2 = generate(model, turn2, 6, cfg, past=cache)
    assert len(cache.plans) == 2 and cache.plans[0].pending == 0 and cache.stats.during_prefill == pending1
    d2, b2 = plan_of(cache, 1)
    assert len(d2) == 25 - 8 and min(d2) >= L1 + 5 and b2 < L2
    t1 = build_schedule(L1, d1, 6, chunk_size=3, guard_tokens=2, completion="next_turn")
    t2 = build_schedule(L2, d2, 6, chunk_size=3, guard_tokens=2, completion="next_turn", new_start=L1 + 5,
                        pending_before=t1.pending)
    assert cache.pending == len(t2.pending)
    conv = whole_conversation([turn1, turn2], out2.sequences)
    ref = run_reference(model, encode_qwen2_5_vl(model, conv), t1.forwards + t2.forwards, [(d1, b1), (d2, b2)])
    torch.testing.assert_close(torch.stack(out1.logits)[:, 0], ref.at_many(t1.logit_rows), **TOL)
    torch.testing.assert_close(torch.stack(out2.logits)[:, 0], ref.at_many(t2.logit_rows), **TOL)
    # a third, text-only turn folds turn 2's rest in; then nothing is left
    turn3 = next_turn_inputs(processor, out2.sequences, [{"role": "user", "content": "Thanks!"}])
    generate(model, turn3, 2, cfg, past=cache)
    assert cache.pending == 0 and bool(cache.filled.all()) and complete_deferred(model, cache) == 0


def test_blocking_and_next_turn_give_the_same_next_turn(vl):
    """The answer is the same either way; the next turn's logits too, whether the rest was prefilled before
    `generate` returned (``blocking``) or in the next turn's prefill (``next_turn``)."""
    model, processor = vl
    inputs = two_images(processor)
    runs = {}
    for completion in ("blocking", "next_turn"):
        cfg = RaincheckConfig(retention=0.3, chunk_size=2, guard_tokens=3, completion=completion,
                              completion_chunk_size=7)
        out = generate(model, inputs, 6, cfg)
        cache = output_cache(out)
        deferred = cache.plan.total_deferred
        assert cache.stats.during_decode == 2 * 2
        if completion == "blocking":
            assert cache.pending == 0 and cache.stats.after_answer == deferred - 4
        else:
            assert cache.pending == deferred - 4 and cache.stats.after_answer == 0
        turn2 = next_turn_inputs(processor, out.sequences, [{"role": "user", "content": "Which one is brighter?"}])
        out2 = generate(model, turn2, 3, cfg, past=cache)
        assert cache.pending == 0 and bool(cache.filled.all())
        runs[completion] = (new_tokens(out, inputs), torch.stack(out2.logits))
    assert runs["blocking"][0] == runs["next_turn"][0]
    torch.testing.assert_close(runs["blocking"][1], runs["next_turn"][1], **TOL)


# ---------------------------------------------------------------------------------------------------- video
def test_video_steps_match_the_eager_reference(vl):
    """One run of video placeholders, one span per temporal step; positions spaced by ``second_per_grid_ts``, decode
    positions continuing from the last prompt token (not get_rope_index's ``max + 1``)."""
    model, processor = vl
    inputs = video(processor)
    L = inputs["input_ids"].shape[1]
    cfg = RaincheckConfig(retention=0.3, chunk_size=4, guard_tokens=1, completion="next_turn")
    out = generate(model, inputs, 6, cfg)
    cache = output_cache(out)
    plan = cache.plan
    start = int((inputs["input_ids"][0] == processor.video_token_id).nonzero()[0])
    assert plan.spans == [(start, start + 16), (start + 16, start + 32)] and plan.modalities == ["video", "video"]
    _, rope_index_delta = model.model.get_rope_index(
        inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"], video_grid_thw=inputs["video_grid_thw"],
        second_per_grid_ts=inputs["second_per_grid_ts"],
    )
    assert cache.rope_delta != int(rope_index_delta)  # the temporal positions outrun the text after the video
    d, b = plan_of(cache)
    turn2 = next_turn_inputs(processor, out.sequences, [{"role": "user", "content": "And then?"}])
    out2 = generate(model, turn2, 3, cfg, past=cache)
    assert cache.pending == 0 and bool(cache.filled.all())
    t1 = build_schedule(L, d, 6, chunk_size=4, guard_tokens=1, completion="next_turn")
    t2 = build_schedule(turn2["input_ids"].shape[1], [], 3, new_start=L + 5, pending_before=t1.pending)
    conv = whole_conversation([inputs], out2.sequences)
    ref = run_reference(model, encode_qwen2_5_vl(model, conv), t1.forwards + t2.forwards, [(d, b)])
    torch.testing.assert_close(torch.stack(out.logits)[:, 0], ref.at_many(t1.logit_rows), **TOL)
    torch.testing.assert_close(torch.stack(out2.logits)[:, 0], ref.at_many(t2.logit_rows), **TOL)


# ---------------------------------------------------------------------------------------------------- pipeline, streamer
def test_pipeline_accepts_raincheck_config(vl):
    model, processor = vl
    pipe = pipeline("image-text-to-text", model=model, processor=processor)
    messages = _image_messages(make_image(1, (256, 256)))
    plain = pipe(text=messages, generate_kwargs={"max_new_tokens": 8, "do_sample": False})
    same = pipe(text=messages, generate_kwargs={"max_new_tokens": 8, "raincheck_config": RaincheckConfig(retention=1.0)})
    pruned = pipe(text=messages, generate_kwargs={"max_new_tokens": 8, "raincheck_config": RaincheckConfig(retention=0.3)})
    assert same[0]["generated_text"][-1] == plain[0]["generated_text"][-1]
    assert pruned[0]["generated_text"][-1]["role"] == "assistant"


def test_text_iterator_streamer_yields_the_answer(vl):
    model, processor = vl
    inputs = two_images(processor)
    streamer = TextIteratorStreamer(processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = {}

    def work():
        result["out"] = model.generate(**inputs, raincheck_config=RaincheckConfig(retention=0.3, chunk_size=4,
                                                                                  guard_tokens=2),
                                       max_new_tokens=12, min_new_tokens=12, streamer=streamer,
                                       return_dict_in_generate=True)

    thread = threading.Thread(target=work)
    thread.start()
    text = "".join(piece for piece in streamer)
    thread.join()
    answer = result["out"].sequences[0, inputs["input_ids"].shape[1]:]
    assert output_cache(result["out"]).stats.during_decode > 0
    assert text.strip() and text == processor.decode(answer, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------------- errors
def test_errors_through_the_processor(vl, tiny_qwen2_5_vl_path):
    model, processor = vl
    cfg = RaincheckConfig(retention=0.3, completion="next_turn")
    inputs = two_images(processor)
    batch = chat_inputs(processor, [_image_messages(make_image(0)), _image_messages(make_image(1))])
    batched = generate(model, batch, 2, cfg)  # a batch, with its per-step logits (shared steps)
    assert len(batched.logits) == 2 and batched.logits[0].shape[0] == 2
    out = generate(model, inputs, 3, cfg)
    turn2 = next_turn_inputs(processor, out.sequences, [{"role": "user", "content": "Why?"}])
    other = enable_raincheck(load_tiny_qwen2_5_vl(tiny_qwen2_5_vl_path)[0])
    with pytest.raises(ValueError, match="built by a different model"):
        generate(other, turn2, 2, cfg, past=output_cache(out))
    # a turn 2 built on another answer does not extend the cached conversation
    forked = out.sequences.clone()
    forked[0, -2] = (forked[0, -2] + 1) % processor.tokenizer.vocab_size  # y_2: cached (y_3 is not)
    turn2_forked = next_turn_inputs(processor, forked, [{"role": "user", "content": "Why?"}])
    with pytest.raises(ValueError, match=f"{hf.CACHE_ARGUMENT} does not extend this conversation"):
        generate(model, turn2_forked, 2, cfg, past=output_cache(out))
    generate(model, turn2, 2, cfg, past=output_cache(out))  # the right conversation still works
