"""`enable_raincheck` / `disable_raincheck` restore the instance exactly; a deep copy of an enabled model runs on its
own weights; `enable_raincheck` refuses the inner model and unsupported transformers versions."""

from __future__ import annotations

import copy
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import _extend  # noqa: E402

from hf_raincheck import DeferredPrefillCache, RaincheckConfig, disable_raincheck, enable_raincheck
from hf_raincheck import transformers_coupling
from hf_raincheck.conversation import cache_argument, output_cache
from hf_raincheck.testing import chat_inputs, load_tiny_qwen3_5, load_tiny_qwen3_vl, make_image

CFG = RaincheckConfig(retention=0.5, chunk_size=2, guard_tokens=1, completion="blocking")
LOADERS = {"qwen3_vl": ("tiny_vl_path", load_tiny_qwen3_vl), "qwen3_5": ("tiny_qwen3_5_path", load_tiny_qwen3_5)}


@pytest.fixture(params=sorted(LOADERS))
def family(request):
    fixture, load = LOADERS[request.param]
    path = request.getfixturevalue(fixture)
    return lambda: load(path)


def _inputs(processor):
    messages = [{"role": "user", "content": [{"type": "image", "image": make_image(0, (64, 64))},
                                             {"type": "text", "text": "What is in the picture?"}]}]
    return dict(chat_inputs(processor, messages))


def _greedy(model, inputs, n=6, **kw):
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _instance_dicts(model) -> dict:
    """Every module's instance attributes: ``{module name: {attribute: id(value)}}``."""
    return {name: {k: id(v) for k, v in vars(module).items()} for name, module in model.named_modules()}


def _same_instance(now: dict, before: dict, volatile: set) -> None:
    """Same attribute names in every module, holding the same objects (but for the `volatile` ones, which plain
    transformers calls replace themselves, e.g. Qwen-VL's ``rope_deltas``)."""
    assert now.keys() == before.keys()
    for name in before:
        assert now[name].keys() == before[name].keys(), name
        for key, ident in before[name].items():
            assert (name, key) in volatile or now[name][key] == ident, (name, key)


def test_disable_restores_the_instance_exactly(family):
    model, processor = family()
    inputs = _inputs(processor)
    before = _instance_dicts(model)
    reference_tokens = _greedy(model, inputs)
    reference_logits = _logits(model, inputs)
    plain = _instance_dicts(model)
    volatile = {(name, key) for name in before for key in before[name] if plain[name].get(key) != before[name][key]}
    assert volatile <= {("model", "rope_deltas")}  # what a plain generate replaces

    enable_raincheck(model)
    assert "generate" in vars(model) and "_raincheck_state" in vars(model)
    raincheck_tokens = _greedy(model, inputs, raincheck_config=CFG)
    assert len(raincheck_tokens) == 6
    assert disable_raincheck(model) is model

    _same_instance(_instance_dicts(model), before, volatile)
    assert torch.equal(_logits(model, inputs), reference_logits)
    assert _greedy(model, inputs) == reference_tokens
    with pytest.raises(ValueError, match="raincheck_config"):  # plain transformers again
        _greedy(model, inputs, raincheck_config=CFG)

    assert disable_raincheck(model) is model  # idempotent: not enabled, nothing to do
    _same_instance(_instance_dicts(model), before, volatile)
    enable_raincheck(model)  # and it can be enabled again
    assert _greedy(model, inputs, raincheck_config=CFG) == raincheck_tokens
    disable_raincheck(model)
    _same_instance(_instance_dicts(model), before, volatile)


def test_disable_keeps_instance_level_forwards(tiny_vl_path):
    """A forward that was an instance attribute before enabling (accelerate's hook puts one there) is put back."""
    model, _ = load_tiny_qwen3_vl(tiny_vl_path)
    own_forward = model.forward  # a bound method, stored on the instance
    model.forward = own_forward
    enable_raincheck(model)
    assert model.forward is not own_forward
    disable_raincheck(model)
    assert vars(model)["forward"] is own_forward and "generate" not in vars(model)


def test_disable_stops_a_background_worker(tiny_vl_path):
    model, processor = load_tiny_qwen3_vl(tiny_vl_path)
    inputs = _inputs(processor)
    enable_raincheck(model)
    cfg = RaincheckConfig(retention=0.3, chunk_size=1, guard_tokens=8, completion="background",
                          completion_chunk_size=1)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False, raincheck_config=cfg,
                             return_dict_in_generate=True)
    cache = output_cache(out)
    assert isinstance(cache, DeferredPrefillCache)
    deferred = cache.plan.total_deferred
    assert deferred > 0
    disable_raincheck(model)
    assert not cache.completion_running
    # nothing lost, nothing twice: what the worker did not restore is still pending in the cache
    assert int(cache.filled.sum()) + cache.pending == cache.length
    with pytest.raises(ValueError, match="raincheck_config"):  # the cache's model is a plain model again
        model.generate(**inputs, max_new_tokens=1, raincheck_config=cfg, **cache_argument(cache))
    enable_raincheck(model)  # enabled again, a later call folds the pending tokens into its prefill
    follow_up = _extend(inputs, out.sequences[0, inputs["input_ids"].shape[1]:].tolist() + [5, 6])
    complete = model.generate(**follow_up, max_new_tokens=1, raincheck_config=cfg, **cache_argument(cache),
                              return_dict_in_generate=True)
    cache = output_cache(complete)
    assert cache.pending == 0 or cache.completion_running
    cache.wait()
    assert cache.pending == 0 and int(cache.filled.sum()) == cache.length


def test_deepcopy_of_an_enabled_model_runs_on_its_own_weights(family):
    model, processor = family()
    inputs = _inputs(processor)
    enable_raincheck(model)
    plain = _greedy(model, inputs)
    raincheck = _greedy(model, inputs, raincheck_config=CFG)
    logits = _logits(model, inputs)

    twin = copy.deepcopy(model)
    assert twin._raincheck_state is not model._raincheck_state
    assert twin._raincheck_state.adapter.model is twin
    assert _greedy(twin, inputs, raincheck_config=CFG) == raincheck  # same weights: same answers
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    # zero weights: every logit is 0, so greedy picks token 0 every time (the original would not)
    assert _greedy(twin, inputs, raincheck_config=CFG) == [0] * 6
    assert _greedy(twin, inputs) == [0] * 6
    assert torch.count_nonzero(_logits(twin, inputs)) == 0
    assert raincheck != [0] * 6 or plain != [0] * 6
    # the original is untouched
    assert _greedy(model, inputs, raincheck_config=CFG) == raincheck
    assert _greedy(model, inputs) == plain
    assert torch.equal(_logits(model, inputs), logits)
    # and each can be disabled on its own
    disable_raincheck(twin)
    assert "_raincheck_state" not in vars(twin)
    assert _greedy(model, inputs, raincheck_config=CFG) == raincheck


def test_inner_model_is_refused_with_a_clear_error(tiny_vl_path):
    model, _ = load_tiny_qwen3_vl(tiny_vl_path)
    with pytest.raises(ValueError, match=r"ForConditionalGeneration.*not its inner model \(model.model\).*Qwen3VLModel"):
        enable_raincheck(model.model)
    assert "_raincheck_state" not in vars(model.model)


def test_unsupported_transformers_version(tiny_vl_path, monkeypatch):
    model, _ = load_tiny_qwen3_vl(tiny_vl_path)
    monkeypatch.setattr(transformers_coupling, "installed_transformers_version", lambda: "5.26.0")
    with pytest.raises(RuntimeError, match=r"supports transformers >=5\.23,<5\.26, found 5\.26\.0.*force=True"):
        enable_raincheck(model)
    assert "_raincheck_state" not in vars(model)
    with pytest.warns(UserWarning, match=r"found 5\.26\.0.*force=True"):
        enable_raincheck(model, force=True)
    assert "_raincheck_state" in vars(model)


def test_supported_transformers_version_passes_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        transformers_coupling.check_transformers_version()
    assert transformers_coupling.transformers_version_supported()
    # as pip reads the pin: 5.26's pre-releases are 5.26, 5.23's development builds are before 5.23
    for version, ok in [("5.23.0", True), ("5.23.4", True), ("5.23.1rc1", True), ("5.23.0.dev0", False),
                        ("5.24.0", True), ("5.25.0", True), ("5.25.3", True), ("5.22.9", False), ("5.26.0", False),
                        ("5.26.0.dev0", False), ("6.0.0", False)]:
        assert transformers_coupling.transformers_version_supported(version) is ok, version
