"""Dynamo's guard checks on compiled steps: checked per turn for the model's modules, per step for the rest.

Before every call of a compiled function, dynamo checks the guards of its cached graphs: that everything the trace
read is as it was. For a step, most of that is the model's modules, reached through attribute chains (types,
``_modules`` dicts, hooks, every parameter's metadata, module attributes), ~1200 objects at Qwen3.5-9B's shape: a
large share of a decode step's host time, which the accelerator waits for (transformers' loop synchronises on every
token; the benchmarks page has the profiles). Compiled steps therefore drop the guards on the decoder's modules
(`drop_decoder_guards`) and check the modules once per turn instead (`module_fingerprint`: every module's identity,
type, ``training`` flag and forward hooks, every parameter's and buffer's identity, dtype, device and shape): a
change found there builds new compiled steps (`static_step.static_step`,
`batch.static_batch_step`). Guards on everything else (the cache's tensors and attributes, the step's arguments,
global state such as grad mode and autocast) stay and are checked on every step.

Each set of compiled steps compiles its own copies of the step functions (`own_code`): dynamo keeps its graphs per
code object, so without copies another model's graphs (same classes, other structure) could pass the remaining
guards. What the per-turn check does not see: a plain attribute of a module changed after the first compiled turn
(a norm's ``eps``); change those before the first compiled call, or call `disable_raincheck` and `enable_raincheck`
again (new compiled steps). The decoder's config keeps its guards.
"""

from __future__ import annotations

import itertools
import types

import torch

# backends that take no mode (dynamo's debugging backends ignore it): the filter applies with them too
_MODELESS_BACKENDS = ("eager", "aot_eager")

# how dynamo names (in a guard filter's entries) what a step reads of the decoder modules
# (`ModelAdapter.decoder_modules`): the step bodies take the adapter as their first argument and reach the text
# decoder as its ``text``, the LM head as its ``model.lm_head`` (dynamo reads a child module through ``_modules``)
DECODER_SOURCES = ("args[0].text", "args[0].model._modules['lm_head']")
KEPT_SOURCES = ("args[0].text.config",)  # the decoder's config keeps its guards (a few dozen)


def _under(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == root or name.startswith((root + ".", root + "[")) for root in roots)


def _reads_decoder(name: str) -> bool:
    return _under(name, DECODER_SOURCES) and not _under(name, KEPT_SOURCES)


def drop_decoder_guards(entries) -> list[bool]:
    """dynamo's ``guard_filter_fn``: keep every guard except those on the decoder modules (their types, attributes,
    hooks, parameters and buffers: the names under `DECODER_SOURCES`, the config apart); `module_fingerprint` checks
    the modules once per turn instead."""
    return [not _reads_decoder(entry.name) for entry in entries]


def own_code(fn: types.FunctionType) -> types.FunctionType:
    """A copy of `fn` with a code object of its own (an equal one, ``code.replace()``): dynamo keeps compiled graphs
    and their guards per code object, so the copy starts with an empty cache that no other copy shares."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__doc__, copy.__qualname__ = fn.__doc__, fn.__qualname__
    return copy


def compile_kwargs(options: dict) -> dict:
    """``torch.compile`` keyword arguments for `options` (transformers' ``CompileConfig.to_dict()``: backend, mode,
    options, fullgraph, dynamic) with the guard filter `drop_decoder_guards`. ``torch.compile`` takes a
    mode or options, not both, so Inductor's mode becomes its options (``torch._inductor.list_mode_options``: what
    the mode means); dynamo's debugging backends ignore the mode. Any other backend keeps its mode and every guard."""
    kwargs = dict(options)
    mode = kwargs.pop("mode", None)
    extra = dict(kwargs.pop("options", None) or {})
    backend = kwargs.get("backend", "inductor")
    if mode not in (None, "default"):
        if backend == "inductor":
            from torch._inductor import list_mode_options

            extra = {**list_mode_options(mode, kwargs.get("dynamic")), **extra}
        elif backend not in _MODELESS_BACKENDS:
            kwargs["mode"] = mode
            if extra:
                kwargs["options"] = extra
            return kwargs
    extra["guard_filter_fn"] = drop_decoder_guards
    kwargs["options"] = extra
    return kwargs


def module_fingerprint(*roots: torch.nn.Module) -> tuple:
    """What the compiled steps assume of the modules under `roots` in place of dynamo's guards on them: each
    module's identity, type, ``training`` flag and forward (pre-)hooks; each parameter's and buffer's identity,
    dtype, device and shape (None for an empty slot). Equal fingerprints: the steps' graphs hold for the modules.
    One pass over the language model and LM head per turn (~1200 entries at Qwen3.5-9B's shape)."""
    items = []
    for root in roots:
        for module in root.modules():
            items.append((id(module), type(module), module.training, tuple(module._forward_hooks),
                          tuple(module._forward_pre_hooks)))
            for tensor in itertools.chain(module._parameters.values(), module._buffers.values()):
                items.append(None if tensor is None else (id(tensor), tensor.dtype, tensor.device, tensor.shape))
    return tuple(items)
