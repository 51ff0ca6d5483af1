"""Every unsupported combination fails at once with a clear ValueError."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from handmade import _conv, _extend, _tiny_model  # noqa: E402

from hf_raincheck import transformers_coupling as hf  # noqa: E402
from hf_raincheck import DeferredPrefillCache, RaincheckConfig, complete_deferred, enable_raincheck  # noqa: E402
from hf_raincheck.conversation import cache_argument, output_cache  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return enable_raincheck(_tiny_model("sdpa"))


@pytest.fixture()
def inputs():
    return _conv([(1, 8, 8)], [3, 4])


CFG = RaincheckConfig(retention=0.5, chunk_size=2, guard_tokens=1)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("policy", "soft", "policy must be one of"),
        ("retention", 0.0, "retention must be in (0, 1]"),
        ("retention", 1.5, "retention must be in (0, 1]"),
        ("retention", "0.3", "retention must be a float"),
        ("chunk_size", 0, "chunk_size must be an int >= 1 or 'auto'"),
        ("chunk_size", 2.5, "chunk_size must be an int >= 1 or 'auto'"),
        ("chunk_size", "max", "chunk_size must be an int >= 1 or 'auto'"),
        ("chunk_size", True, "chunk_size must be an int >= 1 or 'auto'"),
        ("guard_tokens", -1, "guard_tokens must be an int >= 0"),
        ("completion", "later", "completion must be one of"),
        ("completion_chunk_size", 0, "completion_chunk_size must be an int >= 1"),
        ("attn_backend", "xformers", "attn_backend must be one of"),
        ("visibility", "all", "visibility must be one of"),
        ("pruning", "nope", "pruning must be one of"),
        ("pruning", 3, "pruning must be a registered selector name or a callable"),
        ("pruning_options", [1], "pruning_options must be a dict"),
        ("schedule", 5, "schedule must be callable"),
        ("step_deferred_budget", 0, "step_deferred_budget must be an int >= 1, None (no cap) or 'auto'"),
        ("step_deferred_budget", "max", "step_deferred_budget must be an int >= 1, None (no cap) or 'auto'"),
        ("step_deferred_budget", True, "step_deferred_budget must be an int >= 1, None (no cap) or 'auto'"),
    ],
)
def test_invalid_config_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=r"RaincheckConfig\." + field) as err:
        RaincheckConfig(**{field: value})
    assert message in str(err.value)


def _gen(model, inputs, **kw):
    kw.setdefault("raincheck_config", CFG)
    kw.setdefault("max_new_tokens", 3)
    return model.generate(**inputs, **kw)


def test_batch_whose_grids_miss_a_rows_images(model, inputs):
    batch = dict(inputs)
    batch["input_ids"] = inputs["input_ids"].repeat(2, 1)  # two rows with an image each, grids of one image
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, \d+\), input_ids \(2, \d+\)"):
        _gen(model, batch)
    batch["attention_mask"] = inputs["attention_mask"].repeat(2, 1)
    batch["mm_token_type_ids"] = inputs["mm_token_type_ids"].repeat(2, 1)
    with pytest.raises(ValueError, match="image_grid_thw does not match the image placeholders of row 1"):
        _gen(model, batch)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_beams=2), "beam search is not supported"),
        (dict(prompt_lookup_num_tokens=3), "prompt-lookup decoding is not supported"),
        (dict(use_cache=False), "use_cache=False is not supported"),
        (dict(cache_implementation="offloaded"), "cache_implementation must be 'dynamic' or 'static'"),
        (dict(prefill_chunk_size=4), "prefill_chunk_size is not supported"),
    ],
)
def test_unsupported_generate_options(model, inputs, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _gen(model, inputs, **kwargs)


def test_assisted_decoding(model, inputs):
    with pytest.raises(ValueError, match="assisted decoding is not supported"):
        _gen(model, inputs, assistant_model=model)


def test_raincheck_config_of_wrong_type(model, inputs):
    with pytest.raises(ValueError, match="raincheck_config must be a RaincheckConfig"):
        _gen(model, inputs, raincheck_config={"retention": 0.3})


def test_model_family_without_adapter():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32))
    with pytest.raises(ValueError, match="model type 'llama'.*has no Raincheck adapter; supported: "):
        enable_raincheck(llama)


def test_generate_before_enable(inputs):
    from hf_raincheck.generation.enable import raincheck_state

    with pytest.raises(ValueError, match="call enable_raincheck"):
        raincheck_state(_tiny_model(), "generate")
    with pytest.raises(ValueError, match="complete_deferred: call enable_raincheck"):
        complete_deferred(_tiny_model(), DeferredPrefillCache(2))


def test_cache_that_does_not_extend_the_conversation(model, inputs):
    out = _gen(model, inputs, return_dict_in_generate=True)
    other = _conv([(1, 8, 8)], [3, 4], seed=9)
    other = _extend(other, [1, 2, 3, 4])
    with pytest.raises(ValueError, match=f"{hf.CACHE_ARGUMENT} does not extend this conversation.*differs from them at index 0"):
        _gen(model, other, **cache_argument(output_cache(out)))
    # the same conversation without anything new
    same = dict(input_ids=out.sequences[:, :-1])
    with pytest.raises(ValueError, match="holds nothing beyond"):
        _gen(model, same, **cache_argument(output_cache(out)))


def test_foreign_cache_types(model, inputs):
    from transformers import DynamicCache

    with pytest.raises(ValueError, match=f"{hf.CACHE_ARGUMENT} must be a DeferredPrefillCache"):
        _gen(model, inputs, **cache_argument(DynamicCache()))
    with pytest.raises(ValueError, match="complete_deferred: cache must be a DeferredPrefillCache"):
        complete_deferred(model, DynamicCache())
    with pytest.raises(ValueError, match="max_tokens must be None or an int >= 0"):
        complete_deferred(model, DeferredPrefillCache(2), max_tokens=-1)


def test_cache_reused_with_another_model(model, inputs):
    out = _gen(model, inputs, return_dict_in_generate=True, raincheck_config=RaincheckConfig(completion="next_turn"))
    other = enable_raincheck(_tiny_model("sdpa", seed=1))
    conv = dict(input_ids=torch.cat([out.sequences, torch.tensor([[5, 6]])], 1))
    with pytest.raises(ValueError, match="built by a different model"):
        _gen(other, conv, **cache_argument(output_cache(out)))
    with pytest.raises(ValueError, match="built by a different model"):
        complete_deferred(other, output_cache(out))


def test_direct_forward_on_a_raincheck_cache(model, inputs):
    out = _gen(model, inputs, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="filled by generate\\(raincheck_config=...\\) only"):
        model(input_ids=torch.tensor([[1]]), **cache_argument(output_cache(out)))


def test_bad_selector_output(model, inputs):
    def too_many(ctx):
        start, stop = ctx.spans[0]
        return torch.arange(start, stop)

    with pytest.raises(ValueError, match="kept 16 tokens in span 0.*its budget is exactly 8"):
        _gen(model, inputs, raincheck_config=RaincheckConfig(retention=0.5, pruning=too_many))

    def outside(ctx):
        start, _ = ctx.spans[0]
        return torch.cat([torch.tensor([0]), torch.arange(start, start + ctx.budgets[0])])

    with pytest.raises(ValueError, match="outside the placeholder spans: \\[0\\]"):
        _gen(model, inputs, raincheck_config=RaincheckConfig(retention=0.5, pruning=outside))

    def twice(ctx):
        start, _ = ctx.spans[0]
        return torch.cat([torch.tensor([start]), torch.arange(start, start + ctx.budgets[0] - 1)])

    with pytest.raises(ValueError, match="returned duplicate indices"):
        _gen(model, inputs, raincheck_config=RaincheckConfig(retention=0.5, pruning=twice))


def test_bad_schedule_answer(model, inputs):
    with pytest.raises(ValueError, match="schedule must return an int >= 0"):
        _gen(model, inputs, max_new_tokens=4, raincheck_config=RaincheckConfig(retention=0.5, schedule=lambda s, p: -1))


def test_grids_that_do_not_match_input_ids(model, inputs):
    bad = dict(inputs)
    bad["image_grid_thw"] = torch.tensor([[1, 8, 8], [1, 8, 8]])
    with pytest.raises(ValueError, match="image_grid_thw describes 32 image placeholder tokens but input_ids holds 16"):
        _gen(model, bad)


def test_prompt_ending_in_a_placeholder(model):
    inputs = _conv([(1, 8, 8)], [3, 0])
    inputs["input_ids"] = inputs["input_ids"][:, :-1]
    inputs["mm_token_type_ids"] = inputs["mm_token_type_ids"][:, :-1]
    inputs["attention_mask"] = inputs["attention_mask"][:, :-1]
    with pytest.raises(ValueError, match="ends with an image/video placeholder"):
        _gen(model, inputs)


def test_user_schedule_and_callable_selector_are_used(model, inputs):
    seen = []

    def every_other(step, pending):
        seen.append((step, pending))
        return 3 if step % 2 == 0 else 0

    def first_tokens(ctx):
        return torch.cat([torch.arange(s, s + b) for (s, _), b in zip(ctx.spans, ctx.budgets)])

    out = _gen(model, inputs, max_new_tokens=6, min_new_tokens=6, return_dict_in_generate=True,
               raincheck_config=RaincheckConfig(retention=0.5, pruning=first_tokens, schedule=every_other,
                                                completion="next_turn"))
    cache = output_cache(out)
    start, stop = cache.plan.spans[0]
    assert cache.plan.kept.tolist() == list(range(start, start + 8))
    assert [s for s, _ in seen] == [1, 2, 3, 4, 5]
    assert cache.stats.during_decode == 6 and cache.pending == 2


def test_mm_token_type_ids_that_do_not_match_input_ids(model, inputs):
    bad = dict(inputs)
    bad["mm_token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    with pytest.raises(ValueError, match="mm_token_type_ids does not match input_ids"):
        _gen(model, bad)
