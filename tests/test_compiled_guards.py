"""Compiled steps without dynamo's guards on the decoder modules (`hf_raincheck.generation.compiled_guards`): the
filter drops those guards and keeps the rest, every set of compiled steps has graphs of its own, and a module
changed between turns is checked once per turn and gets new compiled steps (CPU: dynamo's eager backend)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from transformers.generation.configuration_utils import CompileConfig

sys.path.insert(0, os.path.dirname(__file__))

from handmade import _conv, _extend, _tiny_model  # noqa: E402
from helpers import generate, new_tokens  # noqa: E402

from hf_raincheck import RaincheckConfig, enable_raincheck  # noqa: E402
from hf_raincheck.generation import compiled_guards, decode  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

TOL = dict(atol=2e-5, rtol=1e-4)
CFG = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, pruning="uniform", completion="blocking")


def compile_config():
    config = CompileConfig(backend="eager", fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    return config


def run(model, inputs, n, past=None, static=True):
    kw = dict(cache_implementation="static", compile_config=compile_config()) if static else {}
    return generate(model, inputs, n, CFG, past=past, **kw)


def static_steps(model):
    return [s for s in model._raincheck_state.static_steps.values() if isinstance(s, decode.StaticStep)]


def test_compile_kwargs_carry_the_filter_and_the_mode_as_options():
    f = compiled_guards.drop_decoder_guards
    inductor = compiled_guards.compile_kwargs(
        dict(fullgraph=False, dynamic=None, backend="inductor", mode="reduce-overhead", options=None))
    assert "mode" not in inductor
    assert inductor["options"] == {"triton.cudagraphs": True, "guard_filter_fn": f}  # what the mode means
    eager = compiled_guards.compile_kwargs(dict(backend="eager", mode="reduce-overhead", fullgraph=True))
    assert "mode" not in eager and eager["options"] == {"guard_filter_fn": f}
    given = compiled_guards.compile_kwargs(dict(backend="inductor", mode=None, options={"max_autotune": True}))
    assert given["options"] == {"max_autotune": True, "guard_filter_fn": f}
    # another backend keeps its mode (torch.compile takes a mode or options, not both) and every guard
    other = compiled_guards.compile_kwargs(dict(backend="cudagraphs", mode="reduce-overhead"))
    assert other == dict(backend="cudagraphs", mode="reduce-overhead")


def test_the_filter_drops_the_decoder_guards_and_keeps_the_rest(monkeypatch):
    decisions = []
    original = compiled_guards.drop_decoder_guards

    def recorded(entries):
        keep = original(entries)
        decisions.extend(zip([e.name for e in entries], keep))
        return keep

    monkeypatch.setattr(compiled_guards, "drop_decoder_guards", recorded)
    model = enable_raincheck(_tiny_model("eager", seed=3))
    out = run(model, _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4]), 10)
    assert out.past_key_values.stats.during_decode > 0  # both step kinds compiled
    kept = [name for name, keep in decisions if keep]
    dropped = [name for name, keep in decisions if not keep]
    assert any(name.startswith("args[0].text._modules['layers']") for name in dropped)
    assert any(name.startswith("args[0].model._modules['lm_head']") for name in dropped)
    assert not any(compiled_guards._reads_decoder(name) for name in kept)
    assert any(name.startswith("args[1]") for name in kept)  # the cache's guards stay
    assert len(dropped) > len(kept)


def test_each_model_compiles_graphs_of_its_own():
    """Two models of one family: each model's compiled steps are copies of the step functions with code objects of
    their own, so one model's graphs (whose guards no longer look at the modules) never serve the other."""
    a, b = enable_raincheck(_tiny_model("eager", seed=1)), enable_raincheck(_tiny_model("eager", seed=2))
    inputs = _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4])
    for model in (a, b):
        compiled = run(model, inputs, 10)
        eager = run(model, inputs, 10, static=False)
        assert new_tokens(compiled, inputs) == new_tokens(eager, inputs)
        torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), **TOL)
    (step_a,), (step_b,) = static_steps(a), static_steps(b)
    for body_a, body_b in zip(step_a.compiled.bodies, step_b.compiled.bodies):
        assert body_a.__code__ is not body_b.__code__
        assert len(_debug_get_cache_entry_list(body_a.__code__)) == 1
        assert len(_debug_get_cache_entry_list(body_b.__code__)) == 1


class Doubled(torch.nn.Module):
    """A decoder MLP whose output is doubled: a module the compiled graph of the plain MLP does not run."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, hidden):
        return 2 * self.mlp(hidden)


def test_a_module_changed_between_turns_gets_new_compiled_steps():
    model = enable_raincheck(_tiny_model("eager", seed=4))
    inputs = _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4])
    compiled = run(model, inputs, 8)
    eager = run(model, inputs, 8, static=False)
    assert new_tokens(compiled, inputs) == new_tokens(eager, inputs)
    (first,) = static_steps(model)
    layer = model.model.language_model.layers[0]
    layer.mlp = Doubled(layer.mlp)
    nxt = _extend(_extend(inputs, new_tokens(eager, inputs)), [7, 8, 9])
    compiled2 = run(model, nxt, 6, past=compiled.past_key_values)
    eager2 = run(model, nxt, 6, past=eager.past_key_values, static=False)
    (second,) = static_steps(model)
    assert second is not first  # built anew: the fingerprint changed
    assert new_tokens(compiled2, nxt) == new_tokens(eager2, nxt)
    torch.testing.assert_close(torch.stack(compiled2.logits), torch.stack(eager2.logits), **TOL)
    # an unchanged model keeps its compiled steps
    run(model, _extend(_extend(nxt, new_tokens(eager2, nxt)), [5, 6]), 4, past=compiled2.past_key_values)
    assert static_steps(model) == [second]


def test_a_forward_hook_added_between_turns_runs_in_the_compiled_steps():
    model = enable_raincheck(_tiny_model("eager", seed=5))
    inputs = _conv([(1, 8, 8), (1, 8, 8)], [3, 2, 4])
    compiled = run(model, inputs, 8)
    eager = run(model, inputs, 8, static=False)
    (first,) = static_steps(model)
    layer = model.model.language_model.layers[1]
    handle = layer.mlp.register_forward_hook(lambda module, args, out: out * 3)
    nxt = _extend(_extend(inputs, new_tokens(eager, inputs)), [7, 8, 9])
    compiled2 = run(model, nxt, 6, past=compiled.past_key_values)
    eager2 = run(model, nxt, 6, past=eager.past_key_values, static=False)
    handle.remove()
    assert static_steps(model) != [first]
    torch.testing.assert_close(torch.stack(compiled2.logits), torch.stack(eager2.logits), **TOL)
