"""`RaincheckChat` on the tiny random Qwen3-VL with its real processor: turns, images, streaming, stats, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import StoppingCriteriaList

from hf_raincheck import RaincheckChat, RaincheckConfig, TurnStats
from hf_raincheck.testing import load_tiny_qwen3_vl, make_image, make_video

CFG = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion_chunk_size=8)


@pytest.fixture(scope="module")
def vl(tiny_vl_path):
    """A model of its own (the chat enables Raincheck on it), shared by this module."""
    return load_tiny_qwen3_vl(tiny_vl_path)


def check_accounting(stats: list[TurnStats], pending_now: int) -> None:
    """Per plan: deferred = decode + after answer + folded into the next prefill (+ pending, last turn)."""
    for t, turn in enumerate(stats):
        folded_next = stats[t + 1].restored_in_prefill if t + 1 < len(stats) else pending_now
        assert turn.deferred == turn.restored_during_decode + turn.pending_at_answer_end, (t, turn)
        assert turn.pending_at_answer_end == turn.restored_after_answer + folded_next, (t, turn)


def test_three_turns_with_a_new_image_in_turn_two(vl, tmp_path):
    model, processor = vl
    second = tmp_path / "second.png"
    make_image(7, (128, 128)).save(second)
    chat = RaincheckChat(model, processor, CFG, max_new_tokens=6, min_new_tokens=6)
    first = chat.ask("What is in the picture?", images=make_image(3, (256, 256)))
    assert isinstance(first, str) and chat.cache.plan.total_deferred == 64 - 20
    assert chat.stats[0].pending_at_answer_end == 44 - 9  # decode steps 3..5 carried 3 each
    second_answer = chat.ask("And in this one?", images=str(second))  # preempts turn 1's worker
    pieces = list(chat.stream("Which one is brighter?"))
    assert chat.wait(timeout=60) is True and not chat.completion_running
    assert len(pieces) >= 1 and "".join(pieces) == chat.messages[-1]["content"][0]["text"]

    stats = chat.stats
    assert [s.deferred for s in stats] == [44, 16 - 5, 0]
    assert [s.restored_during_decode for s in stats] == [9, 9, 0]
    assert [s.pending_at_answer_end for s in stats] == [35, 2, 0]
    assert stats[0].restored_in_prefill == 0 and stats[2].restored_after_answer == 0
    assert stats[1].restored_after_answer + stats[2].restored_in_prefill == 2  # turn 2's rest: worker or turn 3
    check_accounting(stats, chat.cache.pending)
    for s in stats:
        assert s.new_tokens == 6 and s.ttft_s > 0 and s.tpot_s > 0
    cache = chat.cache
    assert cache.pending == 0 and bool(cache.filled.all())
    assert sum(s.restored_in_prefill + s.restored_during_decode + s.restored_after_answer for s in stats) == 44 + 11
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 3
    assert chat.messages[2]["content"][0] == {"type": "image", "image": str(second)}
    assert chat.messages[1]["content"][0]["text"] == first and chat.messages[3]["content"][0]["text"] == second_answer
    # the conversation's exact tokens: two images, three questions, three answers of 6 tokens
    ids = cache.token_ids
    assert ids.count(processor.image_token_id) == 64 + 16 and ids.count(processor.tokenizer.convert_tokens_to_ids(
        "<|im_start|>")) == 6
    chat.close()
    assert chat.closed and chat.cache is None
    with pytest.raises(ValueError, match=r"RaincheckChat\.ask: this chat session is closed"):
        chat.ask("Still there?")
    with pytest.raises(ValueError, match=r"RaincheckChat\.stream: this chat session is closed"):
        chat.stream("Still there?")
    chat.close()  # idempotent


class StopAfter:
    """A stopping criterion that raises KeyboardInterrupt once `n` tokens were generated in this turn."""

    def __init__(self, n):
        self.n, self.start = n, None

    def __call__(self, input_ids, scores, **kwargs):
        self.start = input_ids.shape[1] - 1 if self.start is None else self.start
        if input_ids.shape[1] - self.start >= self.n:
            raise KeyboardInterrupt
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_video_turn_interrupted_turn_and_generate_kwargs(vl):
    model, processor = vl
    with RaincheckChat(model, processor, CFG, system="Be brief.", max_new_tokens=5) as chat:
        chat.ask("What happens?", videos=make_video(5, num_frames=4), min_new_tokens=5)
        assert set(chat.cache.plan.modalities) == {"video"} and chat.stats[0].new_tokens == 5
        assert processor.decode(chat.cache.token_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
        # turn 2 is interrupted by a stopping criterion (passed through generate kwargs) after 3 tokens
        with pytest.raises(KeyboardInterrupt):
            chat.ask("And then?", max_new_tokens=20, min_new_tokens=20,
                     stopping_criteria=StoppingCriteriaList([StopAfter(3)]))
        assert chat.stats[1].new_tokens == 2  # y_3 was sampled but never fed: the cache holds y_1, y_2
        assert chat.messages[-1]["role"] == "assistant" and len(chat.messages) == 4
        # the session goes on from what the cache holds
        chat.ask("Thanks.", min_new_tokens=5)
        assert chat.wait(60) and chat.cache.pending == 0 and bool(chat.cache.filled.all())
        check_accounting(chat.stats, chat.cache.pending)
        assert chat.stats[2].new_tokens == 5
    assert chat.closed


def test_invalid_arguments_name_what_is_wrong(vl, tmp_path):
    model, processor = vl
    with pytest.raises(ValueError, match="RaincheckChat: config must be a RaincheckConfig or None, got dict"):
        RaincheckChat(model, processor, {"retention": 0.3})
    with pytest.raises(ValueError, match="RaincheckChat: processor must be the model's processor"):
        RaincheckChat(model, processor.tokenizer)
    with pytest.raises(ValueError, match="RaincheckChat: generate argument 'past_key_values' is set by the chat"):
        RaincheckChat(model, processor, past_key_values=None)
    chat = RaincheckChat(model, processor, CFG)
    image = make_image(1)
    cases = [
        (dict(text=""), r"RaincheckChat\.ask: text is empty"),
        (dict(text="   "), r"RaincheckChat\.ask: text is empty"),
        (dict(text=None), r"RaincheckChat\.ask: text must be a str, got NoneType"),
        (dict(text="hi", images=3), r"RaincheckChat\.ask: images must be a PIL\.Image\.Image or a path .*got int"),
        (dict(text="hi", images=[image, b"x"]), r"images\[1\] must be a PIL\.Image\.Image or a path .*got bytes"),
        (dict(text="hi", images=str(tmp_path / "missing.png")), r"images is not an existing image file"),
        (dict(text="hi", videos=np.zeros((4, 4))), r"videos must be an array / tensor of frames .* of shape \(4, 4\)"),
        (dict(text="hi", videos=[image]), r"videos\[0\] must be an array / tensor of frames"),
        (dict(text="hi", streamer=object()), r"generate argument 'streamer' is set by the chat session"),
        (dict(text="hi", raincheck_config=CFG), r"generate argument 'raincheck_config' is set by the chat session"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            chat.ask(**kwargs)
        with pytest.raises(ValueError, match=message.replace("ask", "stream")):
            chat.stream(**kwargs)
    assert chat.messages == [] and chat.cache is None and chat.stats == []
