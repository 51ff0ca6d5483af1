"""Raincheck on the tiny random Qwen3.5 checkpoint (GDN + full attention), end to end through its real processor.

Expectations come from plain ``generate`` and from the independent hybrid reference (`tests/reference_qwen3_5.py`:
GDN layers simulated token by token, the live state recomputed from recorded tail factors).
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
import torch
from transformers import AutoConfig, Qwen3_5ForConditionalGeneration, TextIteratorStreamer, pipeline

sys.path.insert(0, os.path.dirname(__file__))

from helpers import generate, new_tokens, whole_conversation  # noqa: E402
from reference_qwen3_5 import build_schedule, reference_logits  # noqa: E402

from hf_raincheck import RaincheckChat, RaincheckConfig, enable_raincheck  # noqa: E402
from hf_raincheck.conversation import next_turn_inputs, output_cache  # noqa: E402
from hf_raincheck.testing import chat_inputs, load_tiny_qwen3_5, make_image, make_video  # noqa: E402

TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def vl(tiny_qwen3_5_path):
    model, processor = load_tiny_qwen3_5(tiny_qwen3_5_path, attn_implementation="eager")
    return enable_raincheck(model), processor


def _messages(*media, text="What is in the picture?"):
    content = [{"type": "video", "video": m} if isinstance(m, np.ndarray) else {"type": "image", "image": m} for m in media]
    return [{"role": "user", "content": content + [{"type": "text", "text": text}]}]


def logits(out):
    return torch.stack(out.logits)[:, 0]


def test_checkpoint_is_a_hybrid_qwen3_5(tiny_qwen3_5_path, vl):
    model, _ = vl
    assert AutoConfig.from_pretrained(tiny_qwen3_5_path).model_type == "qwen3_5"
    assert isinstance(model, Qwen3_5ForConditionalGeneration)
    types = model.config.text_config.layer_types
    assert "linear_attention" in types and "full_attention" in types


@pytest.mark.parametrize("media", ["two_images", "video"])
def test_retention_one_reproduces_plain_generate(vl, media):
    model, processor = vl
    items = [make_image(1, (256, 256)), make_image(2)] if media == "two_images" else [make_video(3)]
    inputs = chat_inputs(processor, _messages(*items))
    plain = generate(model, inputs, 10)
    rc = generate(model, inputs, 10, RaincheckConfig(retention=1.0))
    assert new_tokens(rc, inputs) == new_tokens(plain, inputs)
    torch.testing.assert_close(logits(rc), logits(plain), **TOL)


@pytest.mark.parametrize("completion", ["next_turn", "background"])
def test_new_image_in_turn_two_matches_reference(vl, completion):
    """Turn 1 (one image) leaves D pending; turn 2 brings a second image through `next_turn_inputs`: the leftover is
    folded into (or completed before) turn 2's prefill, which checkpoints the new image's boundary."""
    model, processor = vl
    cfg = RaincheckConfig(retention=0.3, chunk_size=4, guard_tokens=2, pruning="uniform", completion=completion)
    turn1 = chat_inputs(processor, _messages(make_image(1, (256, 256))))
    out1 = generate(model, turn1, 6, cfg)
    cache = output_cache(out1)
    plan1 = cache.plans[0]
    pending_at_end = plan1.total_deferred - plan1.restored
    turn2 = next_turn_inputs(processor, out1.sequences, _messages(make_image(2, (192, 192)), text="And this?"))
    out2 = generate(model, turn2, 5, cfg, past=cache)
    plan2 = cache.plans[1]
    if completion == "background":
        cache.wait()
        assert cache.pending == 0 and bool(cache.filled.all())
    length1 = turn1["input_ids"].shape[1]
    s1 = build_schedule(length1, plan1.deferred, 6, chunk_size=4, guard_tokens=2, completion="next_turn")
    assert len(s1.pending) == pending_at_end > 0
    # with `background`, the worker may have restored some (or all) of the leftover before turn 2: the cache must
    # not depend on that, so the reference folds it all into turn 2 in both cases
    s2 = build_schedule(turn2["input_ids"].shape[1], plan2.deferred, 5, chunk_size=4, guard_tokens=2,
                        completion="next_turn", new_start=length1 + 5, pending_before=s1.pending)
    if completion == "next_turn":
        assert cache.pending == len(s2.pending) > 0
    conv = whole_conversation([turn1, turn2], out2.sequences)
    plans = [(plan1.deferred, plan1.boundary), (plan2.deferred, plan2.boundary)]
    ref = reference_logits(model, conv, s1.forwards + s2.forwards, plans)
    torch.testing.assert_close(logits(out1), ref.at_many(s1.logit_rows), **TOL)
    torch.testing.assert_close(logits(out2), ref.at_many(s2.logit_rows), **TOL)


def test_pipeline_accepts_raincheck_config(vl):
    model, processor = vl
    pipe = pipeline("image-text-to-text", model=model, processor=processor)
    messages = _messages(make_image(1, (256, 256)))
    plain = pipe(text=messages, generate_kwargs={"max_new_tokens": 8, "do_sample": False})
    same = pipe(text=messages, generate_kwargs={"max_new_tokens": 8, "raincheck_config": RaincheckConfig(retention=1.0)})
    pruned = pipe(text=messages, generate_kwargs={"max_new_tokens": 8, "raincheck_config": RaincheckConfig()})
    assert same[0]["generated_text"][-1] == plain[0]["generated_text"][-1]
    assert pruned[0]["generated_text"][-1]["role"] == "assistant"


def test_text_iterator_streamer_yields_the_answer(vl):
    model, processor = vl
    inputs = chat_inputs(processor, _messages(make_image(1, (256, 256))))
    streamer = TextIteratorStreamer(processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = {}
    cfg = RaincheckConfig(retention=0.3, chunk_size=4, guard_tokens=2, completion="blocking")

    def work():
        result["out"] = model.generate(**inputs, raincheck_config=cfg, max_new_tokens=12, min_new_tokens=12,
                                       streamer=streamer, return_dict_in_generate=True)

    thread = threading.Thread(target=work)
    thread.start()
    text = "".join(piece for piece in streamer)
    thread.join()
    answer = result["out"].sequences[0, inputs["input_ids"].shape[1] :]
    assert output_cache(result["out"]).stats.during_decode > 0
    assert text == processor.decode(answer, skip_special_tokens=True)


def test_chat_helper_three_turns_background_equals_blocking(vl):
    """RaincheckChat over the hybrid model: background completion between turns gives the same answers as
    blocking completion, and each turn's restoration stats add up."""
    model, processor = vl
    answers = {}
    for completion in ("blocking", "background"):
        cfg = RaincheckConfig(retention=0.3, chunk_size=4, guard_tokens=2, completion=completion)
        with RaincheckChat(model, processor, cfg, max_new_tokens=6, min_new_tokens=6) as chat:
            replies = [
                chat.ask("Describe it.", images=[make_image(1, (256, 256))]),
                chat.ask("And this one?", images=[make_image(2)]),
                chat.ask("Which is brighter?"),
            ]
            chat.wait()
            stats = chat.stats
            assert stats[0].deferred > 0 and stats[1].deferred > 0 and stats[2].deferred == 0
            for k, turn in enumerate(stats[:2]):  # each turn's plan: decode + leftover; leftover: after + next prefill
                assert turn.deferred == turn.restored_during_decode + turn.pending_at_answer_end
                assert turn.pending_at_answer_end == turn.restored_after_answer + stats[k + 1].restored_in_prefill
            assert chat.cache.pending == 0
            answers[completion] = replies
    assert answers["background"] == answers["blocking"]
