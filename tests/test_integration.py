"""Raincheck through the real processor, from_pretrained, streamers, the pipeline and the next-turn helper."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import TextIteratorStreamer, pipeline

from hf_raincheck import RaincheckConfig, complete_deferred, enable_raincheck
from hf_raincheck.conversation import cache_argument, next_turn_inputs, output_cache
from hf_raincheck.testing import make_image, tiny_qwen3_vl


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    model, processor = tiny_qwen3_vl(tmp_path_factory.mktemp("tiny"), seed=0)
    return enable_raincheck(model), processor


def _messages(image, text="What is in the picture?"):
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def _inputs(processor, messages):
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt")


CFG = RaincheckConfig(retention=0.3, chunk_size=4, guard_tokens=2, completion="blocking")
TOL = dict(atol=2e-5, rtol=1e-4)  # Raincheck's forwards against transformers' (as tests/test_core.py)


def test_pipeline_accepts_raincheck_config(vl):
    model, processor = vl
    pipe = pipeline("image-text-to-text", model=model, processor=processor)
    messages = _messages(make_image(1, (256, 256)))
    plain = pipe(text=messages, generate_kwargs={"max_new_tokens": 8, "do_sample": False})
    same = pipe(text=messages, generate_kwargs={"max_new_tokens": 8, "raincheck_config": RaincheckConfig(retention=1.0)})
    pruned = pipe(text=messages, generate_kwargs={"max_new_tokens": 8, "raincheck_config": CFG})
    assert same[0]["generated_text"][-1] == plain[0]["generated_text"][-1]
    assert pruned[0]["generated_text"][-1]["role"] == "assistant"


def test_text_iterator_streamer_yields_the_answer(vl):
    model, processor = vl
    inputs = _inputs(processor, _messages(make_image(2, (256, 256))))
    streamer = TextIteratorStreamer(processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = {}

    def work():
        result["out"] = model.generate(**inputs, raincheck_config=CFG, max_new_tokens=12, min_new_tokens=12,
                                       streamer=streamer, return_dict_in_generate=True)

    thread = threading.Thread(target=work)
    thread.start()
    text = "".join(piece for piece in streamer)
    thread.join()
    answer = result["out"].sequences[0, inputs["input_ids"].shape[1]:]
    assert text.strip() and text == processor.decode(answer, skip_special_tokens=True)


def _three_turns(model, processor, cfg):
    """Turn 1 an image, turn 2 a new image, turn 3 text, on one cache: ``(turn 1 inputs, turn 2 inputs, the turn 3
    output, the cache)``."""
    inputs = _inputs(processor, _messages(make_image(3, (256, 256))))
    out = model.generate(**inputs, raincheck_config=cfg, max_new_tokens=6, min_new_tokens=6,
                         return_dict_in_generate=True)
    cache = output_cache(out)
    turn2 = next_turn_inputs(processor, out.sequences, _messages(make_image(4, (128, 128)), "And this one?"))
    out = model.generate(**turn2, **cache_argument(cache), raincheck_config=cfg, max_new_tokens=6, min_new_tokens=6,
                         return_dict_in_generate=True)
    turn3 = next_turn_inputs(processor, out.sequences, [{"role": "user", "content": "Thanks!"}])
    out = model.generate(**turn3, **cache_argument(cache), raincheck_config=cfg, max_new_tokens=4,
                         return_dict_in_generate=True)
    return inputs, turn2, out, cache


def test_three_turn_chat_with_a_new_image_in_turn_two(vl):
    model, processor = vl
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="next_turn")
    inputs = _inputs(processor, _messages(make_image(3, (256, 256))))
    out = model.generate(**inputs, raincheck_config=cfg, max_new_tokens=6, min_new_tokens=6,
                         return_dict_in_generate=True)
    cache = output_cache(out)
    first_plan = cache.plan
    assert first_plan.total_deferred == 64 - 20 and cache.pending == 44 - 3 * 3
    turn2 = next_turn_inputs(processor, out.sequences, _messages(make_image(4, (128, 128)), "And this one?"))
    out = model.generate(**turn2, **cache_argument(cache), raincheck_config=cfg, max_new_tokens=6, min_new_tokens=6,
                         return_dict_in_generate=True)
    assert first_plan.pending == 0 and cache.plan is not first_plan and cache.plan.total_deferred == 16 - 5
    turn3 = next_turn_inputs(processor, out.sequences, [{"role": "user", "content": "Thanks!"}])
    out = model.generate(**turn3, **cache_argument(cache), raincheck_config=cfg, max_new_tokens=4,
                         return_dict_in_generate=True)
    assert cache.pending == 0 and bool(cache.filled.all())
    assert complete_deferred(model, cache) == 0
    # the fully restored cache holds the whole conversation (DESIGN rule 6): one more turn prefills only its own
    # tokens, defers nothing, and the cache then covers every token of the conversation, each slot filled
    turn4 = next_turn_inputs(processor, out.sequences, [{"role": "user", "content": "Bye"}])
    before = cache.length
    assert 0 < before < turn4["input_ids"].shape[1] and cache.token_ids == turn4["input_ids"][0, :before].tolist()
    resumed = model.generate(**turn4, **cache_argument(cache), raincheck_config=cfg, max_new_tokens=4,
                             min_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert cache.turn_stats[-1].deferred == 0 and cache.pending == 0 and bool(cache.filled.all())
    assert cache.token_ids == resumed.sequences[0, : cache.length].tolist()
    assert cache.length == resumed.sequences.shape[1] - 1  # every token but the last answer token, not yet fed


def test_next_turn_through_the_cache_matches_a_fresh_full_prefill_at_retention_one(vl):
    """Retention 1.0 through the same three turns (a new image in turn 2) on one cache: a fourth turn's logits
    match a fresh full prefill of the whole conversation (both images) by the plain model (no raincheck_config:
    transformers' own forward and generate), and its greedy tokens equal plain `generate`'s (DESIGN rule 7).
    With retention < 1 they cannot: the entries after a deferred image were computed without it."""
    model, processor = vl
    cfg = RaincheckConfig(retention=1.0, chunk_size=3, guard_tokens=2, completion="next_turn")
    inputs, turn2, out, cache = _three_turns(model, processor, cfg)
    turn4 = next_turn_inputs(processor, out.sequences, [{"role": "user", "content": "Bye"}])
    assert "pixel_values" not in turn4
    resumed = model.generate(**turn4, **cache_argument(cache), raincheck_config=cfg, max_new_tokens=4,
                             min_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    whole = dict(turn4, pixel_values=torch.cat([inputs["pixel_values"], turn2["pixel_values"]]),
                 image_grid_thw=torch.cat([inputs["image_grid_thw"], turn2["image_grid_thw"]]))
    assert int((whole["input_ids"] == processor.image_token_id).sum()) == 64 + 16  # both images' placeholders
    with torch.no_grad():
        fresh = model(**whole).logits[:, -1]
    torch.testing.assert_close(resumed.logits[0], fresh, **TOL)
    plain = model.generate(**whole, max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)
    assert resumed.sequences.tolist() == plain.sequences.tolist()
    torch.testing.assert_close(torch.stack(resumed.logits), torch.stack(plain.logits), **TOL)


def test_video_through_the_processor(vl):
    model, processor = vl
    from hf_raincheck.testing import make_video

    messages = [{"role": "user", "content": [{"type": "video", "video": make_video(5, num_frames=4)},
                                             {"type": "text", "text": "What happens?"}]}]
    inputs = _inputs(processor, messages)
    if "pixel_values_videos" not in inputs:
        pytest.fail("the tiny processor did not produce video inputs")
    plain = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    same = model.generate(**inputs, max_new_tokens=6, raincheck_config=RaincheckConfig(retention=1.0))
    assert same.tolist() == plain.tolist()
    out = model.generate(**inputs, max_new_tokens=6, raincheck_config=CFG, return_dict_in_generate=True)
    plan = output_cache(out).plan
    assert set(plan.modalities) == {"video"} and len(plan.spans) == int(inputs["video_grid_thw"][0, 0])
    assert output_cache(out).pending == 0
