"""Raincheck on a model dispatched by accelerate with a ``device_map`` (issue 10, the part a CPU can run).

Every module of the tiny Qwen3-VL is mapped to ``"cpu"`` at the granularity ``device_map="auto"`` uses for real
checkpoints (each vision block, each decoder layer, embeddings, norm, lm_head), and accelerate's hooks are installed,
so every Raincheck forward runs through the hooks that move inputs between the devices of a sharded model. The
results must equal those of the same checkpoint loaded plainly: greedy tokens, step logits, next-turn logits.

transformers' ``from_pretrained(device_map=...)`` installs the hooks only when the map names several devices (or
disk): with one device it just places the weights. The fixture therefore dispatches the loaded model itself with
``force_hooks=True`` and the arguments transformers passes to ``accelerate.dispatch_model``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from accelerate import dispatch_model
from accelerate.hooks import AlignDevicesHook, SequentialHook

sys.path.insert(0, os.path.dirname(__file__))

from helpers import generate, new_tokens  # noqa: E402

from hf_raincheck import RaincheckConfig, enable_raincheck  # noqa: E402
from hf_raincheck.conversation import next_turn_inputs, output_cache  # noqa: E402
from hf_raincheck.models import get_adapter  # noqa: E402
from hf_raincheck.models.base import execution_device  # noqa: E402
from hf_raincheck.testing import chat_inputs, load_tiny_qwen3_vl, make_image  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)


def device_map_of(model, device="cpu") -> dict[str, str]:
    """Every vision block and decoder layer on its own entry (what ``device_map="auto"`` splits at), plus the
    towers' other children and ``lm_head``, all on `device`."""
    names = []
    for prefix, parent in (("model.visual", model.model.visual), ("model.language_model", model.model.language_model)):
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.ModuleList):
                names += [f"{prefix}.{name}.{i}" for i in range(len(child))]
            else:
                names.append(f"{prefix}.{name}")
    return {name: device for name in [*names, "lm_head"]}


@pytest.fixture(scope="module")
def models(tiny_vl_path):
    plain, processor = load_tiny_qwen3_vl(tiny_vl_path)
    device_map = device_map_of(plain)
    mapped, _ = load_tiny_qwen3_vl(tiny_vl_path, device_map=device_map)
    assert not hasattr(mapped.model.language_model.layers[0], "_hf_hook")  # one device: transformers adds no hooks
    dispatch_model(mapped, device_map=device_map, skip_keys=mapped._skip_keys_device_placement, force_hooks=True)
    return enable_raincheck(plain), enable_raincheck(mapped), processor


@pytest.fixture
def hooked_calls(monkeypatch):
    """Names of the modules whose accelerate hook moved inputs, while the test runs."""
    calls = []
    original = AlignDevicesHook.pre_forward

    def pre_forward(self, module, *args, **kwargs):
        calls.append(module)
        return original(self, module, *args, **kwargs)

    monkeypatch.setattr(AlignDevicesHook, "pre_forward", pre_forward)
    return calls


def _messages(image, text="What is in the picture?"):
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def test_the_mapped_model_runs_through_accelerate_hooks(models, hooked_calls):
    _, mapped, processor = models
    layers = mapped.model.language_model.layers
    assert all(isinstance(layer._hf_hook, AlignDevicesHook) for layer in layers)
    adapter = get_adapter(mapped)
    assert adapter.input_device == torch.device("cpu") and adapter.deepstack_devices() == [torch.device("cpu")] * 2
    inputs = chat_inputs(processor, _messages(make_image(0, (256, 256))))
    generate(mapped, inputs, 4, RaincheckConfig(retention=0.3, chunk_size=8, guard_tokens=1, pruning="hiprune"))
    hooked = {id(m) for m in hooked_calls}
    must = [*layers, mapped.model.language_model.embed_tokens, mapped.lm_head, *mapped.model.visual.blocks]
    assert all(id(m) in hooked for m in must)


def test_execution_device_prefers_the_hook():
    layer = torch.nn.Linear(2, 2)
    assert execution_device(layer) == torch.device("cpu")
    layer._hf_hook = SequentialHook(AlignDevicesHook(execution_device=torch.device("meta")))
    assert execution_device(layer) == torch.device("meta")  # e.g. offloaded weights: they sit elsewhere


CONFIGS = {
    # explicit blocking completion: stats are compared exactly (background completion's timing would vary)
    "retention1": RaincheckConfig(retention=1.0, completion="blocking"),
    "raincheck_next_turn": RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, completion="next_turn"),
    "raincheck_hiprune": RaincheckConfig(retention=0.3, chunk_size=7, guard_tokens=1, pruning="hiprune",
                                         pruning_options={"alpha": 2.0}, completion="blocking"),
    "hard_visionzip": RaincheckConfig(policy="hard", retention=0.3, pruning="visionzip", completion="blocking"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_tokens_and_next_turn_logits_as_the_plain_model(models, name):
    plain, mapped, processor = models
    cfg = CONFIGS[name]
    turn1 = chat_inputs(processor, _messages(make_image(1, (256, 256))))
    runs = []
    for model in (plain, mapped):
        out1 = generate(model, turn1, 8, cfg)
        turn2 = next_turn_inputs(processor, out1.sequences, _messages(make_image(2), "And this one?"))
        out2 = generate(model, turn2, 4, cfg, past=output_cache(out1))
        runs.append((out1, turn2, out2))
    (a1, a_turn2, a2), (b1, b_turn2, b2) = runs
    assert new_tokens(b1, turn1) == new_tokens(a1, turn1)
    torch.testing.assert_close(torch.stack(b1.logits), torch.stack(a1.logits), **TOL)
    assert torch.equal(b_turn2["input_ids"], a_turn2["input_ids"])
    assert new_tokens(b2, b_turn2) == new_tokens(a2, a_turn2)
    torch.testing.assert_close(torch.stack(b2.logits), torch.stack(a2.logits), **TOL)
    cache = output_cache(b2)
    assert cache.stats == output_cache(a2).stats and len(cache.plans) == 2
    if name == "retention1":  # and both equal plain generate on the mapped model
        plain_out = generate(mapped, turn1, 8)
        assert new_tokens(plain_out, turn1) == new_tokens(b1, turn1)


def test_qwen3_5_under_accelerate_hooks_equals_plain_load(tiny_qwen3_5_path, hooked_calls):
    """Hybrid model: the GDN patch sits under accelerate's hook (``_old_forward``), so GDN layers still get their
    inputs moved; the states live on each layer's device; results equal the plainly loaded model's."""
    from hf_raincheck.testing import load_tiny_qwen3_5

    plain, processor = load_tiny_qwen3_5(tiny_qwen3_5_path)
    mapped, _ = load_tiny_qwen3_5(tiny_qwen3_5_path, device_map=device_map_of(plain))
    dispatch_model(mapped, device_map=device_map_of(plain), skip_keys=mapped._skip_keys_device_placement,
                   force_hooks=True)
    plain, mapped = enable_raincheck(plain), enable_raincheck(mapped)
    gdn = mapped.model.language_model.layers[0].linear_attn
    assert hasattr(gdn, "_old_forward") and gdn._raincheck_gdn_original[0] == "_old_forward"
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, completion="next_turn")
    turn1 = chat_inputs(processor, _messages(make_image(1, (256, 256))))
    runs = []
    for model in (plain, mapped):
        out1 = generate(model, turn1, 8, cfg)
        turn2 = next_turn_inputs(processor, out1.sequences, _messages(make_image(2), "And this one?"))
        out2 = generate(model, turn2, 4, cfg, past=output_cache(out1))
        runs.append((out1, out2))
    (a1, a2), (b1, b2) = runs
    assert any(m is gdn for m in hooked_calls)
    assert new_tokens(b1, turn1) == new_tokens(a1, turn1)
    torch.testing.assert_close(torch.stack(b1.logits), torch.stack(a1.logits), **TOL)
    torch.testing.assert_close(torch.stack(b2.logits), torch.stack(a2.logits), **TOL)
    assert output_cache(b2).stats == output_cache(a2).stats


def test_a_decoder_on_several_devices_runs_static_steps_eagerly_and_says_so(models, monkeypatch):
    """Compiled steps need one device (Inductor cannot lower the cache writes through accelerate's hooks across
    GPUs, and CUDA graphs cannot span devices): with the decoder's layers on two execution devices, a static cache
    with a compile config runs eager steps, warns once, and gives the one-device results."""
    import warnings

    from transformers.generation.configuration_utils import CompileConfig

    from hf_raincheck.generation.enable import raincheck_state

    plain, mapped, processor = models
    adapter = raincheck_state(mapped, "test").adapter
    assert adapter.decoder_devices() == [torch.device("cpu")]
    layer = mapped.model.language_model.layers[1].self_attn
    hooks = list(getattr(layer._hf_hook, "hooks", None) or [layer._hf_hook])
    saved = [h.execution_device for h in hooks]
    for h in hooks:  # the layer claims another device: decoder_devices reads the hooks
        h.execution_device = torch.device("meta")
    try:
        assert adapter.decoder_devices() == [torch.device("cpu"), torch.device("meta")]
    finally:
        for h, device in zip(hooks, saved):
            h.execution_device = device
    # running needs real devices: the adapter reports two while every layer still computes on the CPU
    monkeypatch.setattr(adapter, "decoder_devices", lambda: [torch.device("cpu"), torch.device("meta")])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_config = CompileConfig(backend="eager", fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True  # would compile on the CPU (as tests/test_compiled_steps.py)
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, guard_tokens=2, completion="blocking")
    inputs = chat_inputs(processor, _messages(make_image(3, (256, 256))))
    kw = dict(cache_implementation="static", compile_config=compile_config)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = generate(mapped, inputs, 8, cfg, **kw)
            generate(mapped, inputs, 4, cfg, **kw)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # nothing compiled
    finally:
        torch._dynamo.reset()
    said = [w for w in caught if "compiled steps need one device" in str(w.message)]
    assert len(said) == 1 and "2 devices (cpu, meta)" in str(said[0].message)
    reference = generate(plain, inputs, 8, cfg)
    assert new_tokens(out, inputs) == new_tokens(reference, inputs)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(reference.logits), **TOL)
