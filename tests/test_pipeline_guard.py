"""`enable_raincheck(pipe)`: a pipeline built on a Raincheck model rejects a top-level ``raincheck_config=`` (which
transformers would hand to the processor, which drops it) and says to pass it in ``generate_kwargs``."""

from __future__ import annotations

import pytest
from transformers import pipeline

from hf_raincheck import RaincheckConfig, disable_raincheck, enable_raincheck
from hf_raincheck.testing import load_tiny_qwen3_vl, make_image


def _messages():
    return [{"role": "user", "content": [{"type": "image", "image": make_image(2, (64, 64))},
                                         {"type": "text", "text": "Describe the picture."}]}]


def _config(steps: list):
    def schedule(step, pending):  # records that Raincheck's decode steps ran
        steps.append((step, pending))
        return 2

    return RaincheckConfig(retention=0.5, guard_tokens=0, schedule=schedule, completion="next_turn")


def test_top_level_raincheck_config_is_rejected(tiny_vl_path):
    model, processor = load_tiny_qwen3_vl(tiny_vl_path)
    pipe = pipeline("image-text-to-text", model=model, processor=processor)
    assert enable_raincheck(pipe) is pipe
    assert "_raincheck_state" in vars(model)
    steps = []
    with pytest.raises(ValueError, match=r"generate_kwargs=\{'raincheck_config': cfg\}"):
        pipe(text=_messages(), raincheck_config=_config(steps), max_new_tokens=3)
    assert steps == []
    out = pipe(text=_messages(), max_new_tokens=3, generate_kwargs={"raincheck_config": _config(steps),
                                                                    "min_new_tokens": 3})
    assert out[0]["generated_text"][-1]["role"] == "assistant"
    assert steps and steps[0][1] > 0  # Raincheck ran, with deferred tokens pending at its first decode step

    disable_raincheck(pipe)
    assert "_sanitize_parameters" not in vars(pipe) and "_raincheck_state" not in vars(model)
    pipe(text=_messages(), max_new_tokens=2)  # a plain pipeline again


def test_raincheck_config_given_at_construction_is_rejected(tiny_vl_path):
    model, processor = load_tiny_qwen3_vl(tiny_vl_path)
    pipe = pipeline("image-text-to-text", model=model, processor=processor, raincheck_config=RaincheckConfig())
    with pytest.raises(ValueError, match=r"generate_kwargs=\{'raincheck_config': cfg\}"):
        enable_raincheck(pipe)
    assert "_raincheck_state" not in vars(model)
