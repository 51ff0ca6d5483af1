"""``generation_config.raincheck_config``: a default set the way transformers users set generation defaults, kept by
``save_pretrained`` / ``from_pretrained``; an explicit ``raincheck_config=`` wins."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForImageTextToText, GenerationConfig

from hf_raincheck import DeferredPrefillCache, RaincheckConfig, enable_raincheck
from hf_raincheck.conversation import output_cache
from hf_raincheck.testing import chat_inputs, load_tiny_qwen3_vl, make_image

CFG = RaincheckConfig(retention=0.5, chunk_size=2, guard_tokens=1, completion="blocking")
OTHER = RaincheckConfig(policy="hard", retention=0.25, completion="next_turn")


@pytest.fixture
def model_and_inputs(tiny_vl_path):
    model, processor = load_tiny_qwen3_vl(tiny_vl_path)
    messages = [{"role": "user", "content": [{"type": "image", "image": make_image(1, (64, 64))},
                                             {"type": "text", "text": "Describe it."}]}]
    return model, dict(chat_inputs(processor, messages))


def _run(model, inputs, **kw):
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                             return_dict_in_generate=True, **kw)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), output_cache(out)


@pytest.mark.parametrize("form", ["config", "dict"])
def test_model_generation_config_default(model_and_inputs, form):
    model, inputs = model_and_inputs
    enable_raincheck(model)
    explicit_tokens, explicit_cache = _run(model, inputs, raincheck_config=CFG)
    model.generation_config.raincheck_config = CFG if form == "config" else CFG.to_dict()
    tokens, cache = _run(model, inputs)
    assert isinstance(cache, DeferredPrefillCache) and cache.config == CFG
    assert tokens == explicit_tokens
    assert cache.plan.total_deferred == explicit_cache.plan.total_deferred > 0


def test_passed_generation_config(model_and_inputs):
    model, inputs = model_and_inputs
    enable_raincheck(model)
    _, cache = _run(model, inputs, generation_config=GenerationConfig(raincheck_config=CFG))
    assert isinstance(cache, DeferredPrefillCache) and cache.config == CFG
    _, cache = _run(model, inputs, generation_config=GenerationConfig(raincheck_config=CFG.to_dict()))
    assert cache.config == CFG


def test_explicit_argument_wins(model_and_inputs):
    model, inputs = model_and_inputs
    enable_raincheck(model)
    model.generation_config.raincheck_config = CFG
    _, cache = _run(model, inputs, raincheck_config=OTHER)
    assert cache.config is OTHER
    _, cache = _run(model, inputs, raincheck_config=OTHER, generation_config=GenerationConfig(raincheck_config=CFG))
    assert cache.config is OTHER
    # a passed GenerationConfig wins over the model's default
    _, cache = _run(model, inputs, generation_config=GenerationConfig(raincheck_config=OTHER))
    assert cache.config is OTHER
    # raincheck_config=None: plain transformers generation for this call
    plain_tokens, plain_cache = _run(model, inputs, raincheck_config=None)
    assert not isinstance(plain_cache, DeferredPrefillCache)
    model.generation_config.raincheck_config = None
    assert _run(model, inputs)[0] == plain_tokens


def test_a_bad_default_is_named(model_and_inputs):
    model, inputs = model_and_inputs
    model.generation_config.raincheck_config = {"retention": 0.5, "chunk": 3}
    with pytest.raises(ValueError, match=r"model\.generation_config\.raincheck_config: .*unknown keys \['chunk'\]"):
        enable_raincheck(model)
    model.generation_config.raincheck_config = "raincheck"
    with pytest.raises(ValueError, match=r"model\.generation_config\.raincheck_config must be a RaincheckConfig or its"):
        enable_raincheck(model)
    model.generation_config.raincheck_config = None
    enable_raincheck(model)
    with pytest.raises(ValueError, match=r"generate: generation_config\.raincheck_config must be a RaincheckConfig"):
        _run(model, inputs, generation_config=GenerationConfig(raincheck_config=3))


def test_saved_and_restored_with_the_checkpoint(model_and_inputs, tmp_path):
    model, inputs = model_and_inputs
    enable_raincheck(model)
    expected_tokens, _ = _run(model, inputs, raincheck_config=CFG)
    model.generation_config.raincheck_config = CFG
    model.save_pretrained(tmp_path)
    with open(os.path.join(tmp_path, "generation_config.json")) as f:
        assert json.load(f)["raincheck_config"] == CFG.to_dict()

    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="sdpa")
    loaded.eval()
    assert loaded.generation_config.raincheck_config == CFG.to_dict()
    enable_raincheck(loaded)
    tokens, cache = _run(loaded, inputs)
    assert isinstance(cache, DeferredPrefillCache) and cache.config == CFG
    assert tokens == expected_tokens


def test_saving_an_unserialisable_default_names_the_field(model_and_inputs, tmp_path):
    model, _ = model_and_inputs
    model.generation_config.raincheck_config = RaincheckConfig(pruning=lambda ctx: ctx.kept_default())
    with pytest.raises(ValueError, match=r"to_dict: pruning=.* is a callable"):
        model.save_pretrained(tmp_path)
