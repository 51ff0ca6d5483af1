"""Putting Raincheck on a model instance and taking it off again: `install`, `disable_raincheck`.

What `install` changes, all on this instance (and its submodules), and what `disable_raincheck` gives back:

- ``model.generate``, ``model.forward`` and transformers' ``model._get_stopping_criteria`` (a batch records which
  rows stopped: `hf_raincheck.generation.row_stops`): instance attributes (`RaincheckMethod`) in front of the
  originals;
- the ``config`` of each text attention module: a private copy naming Raincheck's attention dispatcher
  (`hf_raincheck.attention.dispatch.install`), the original under ``_raincheck_base_config``;
- the forward of each Gated DeltaNet module (`hf_raincheck.gdn_state.patch.install`);
- ``model._raincheck_state`` (`RaincheckState`).

A pipeline (``transformers.pipeline(...)``) may be passed instead of a model: its model is enabled and the pipeline
instance rejects a top-level ``raincheck_config=`` (transformers hands unknown pipeline arguments to the processor,
which drops them), saying to pass ``generate_kwargs={"raincheck_config": cfg}``.
"""

from __future__ import annotations

import functools

from .. import attention
from .. import transformers_coupling as hf
from ..gdn_state import patch as gdn_patch
from ..models import get_adapter
from . import config_source
from .state import STATE_ATTR, RaincheckState

_PATCHED_METHODS = ("generate", "forward", hf.STOPPING_CRITERIA_METHOD)


class RaincheckMethod:
    """``model.generate`` / ``model.forward`` of an enabled instance: ``fn(model, *args, **kwargs)``.

    Shows the original's signature (``__wrapped__``: transformers validates generate's kwargs against forward's).
    An object rather than a closure so that ``copy.deepcopy(model)`` gives the copy methods that call the copy.
    """

    def __init__(self, fn, model, original):
        self._fn = fn
        self._model = model
        functools.update_wrapper(self, original, updated=())

    def __call__(self, *args, **kwargs):
        return self._fn(self._model, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<Raincheck {getattr(self, '__name__', 'method')} of {type(self._model).__name__}>"


def _is_pipeline(obj) -> bool:
    from transformers import Pipeline

    return isinstance(obj, Pipeline)


def _reject_top_level_config(kwargs: dict) -> None:
    if config_source.ATTR in kwargs:
        raise ValueError(
            "pipeline(...)(..., raincheck_config=...): a pipeline hands its own keyword arguments to the processor, "
            "which drops raincheck_config; pass it to generate instead: "
            "pipe(..., generate_kwargs={'raincheck_config': cfg})"
        )


def install(model, generate_fn, forward_fn, stopping_fn, force: bool = False):
    """`enable_raincheck`'s work (see its docstring); returns what was passed."""
    hf.check_transformers_version(force=force)
    if _is_pipeline(model):
        pipe = model
        _reject_top_level_config(hf.pipeline_preprocess_params(pipe))
        install(pipe.model, generate_fn, forward_fn, stopping_fn, force=force)
        hf.guard_pipeline_kwargs(pipe, _reject_top_level_config)
        return pipe
    if getattr(model, STATE_ATTR, None) is not None:
        return model
    adapter = get_adapter(model)
    # a bad default is reported now rather than at the first generate
    config_source.from_generation_config(getattr(model, "generation_config", None), "model.generation_config")
    own = vars(model)
    state = RaincheckState(
        adapter=adapter,
        original_generate=model.generate,
        original_forward=model.forward,
        original_stopping_criteria=getattr(model, hf.STOPPING_CRITERIA_METHOD),
        own_attrs={name: own[name] for name in _PATCHED_METHODS if name in own},
    )
    attention.install(adapter.text_attention_modules())
    if adapter.gdn_glue is not None:
        gdn_patch.install(adapter.gdn_modules(), adapter.gdn_glue)
    setattr(model, STATE_ATTR, state)
    model.generate = RaincheckMethod(generate_fn, model, state.original_generate)
    model.forward = RaincheckMethod(forward_fn, model, state.original_forward)
    setattr(model, hf.STOPPING_CRITERIA_METHOD, RaincheckMethod(stopping_fn, model, state.original_stopping_criteria))
    return model


def disable_raincheck(model):
    """Takes Raincheck off a model instance that `enable_raincheck` patched, restoring it exactly.

    Gives back the original ``generate`` and ``forward``, the text attention modules' own configs and the Gated
    DeltaNet modules' own forwards, and removes ``model._raincheck_state``: the instance then behaves (and its
    ``__dict__`` looks) as if it had never been enabled. Background completion workers still running on caches of
    this model are stopped first; what they left pending stays in those caches (counted in ``cache.pending``), and is
    restored by a later Raincheck `generate` on the cache after `enable_raincheck` again.

    Idempotent: a model that is not enabled is returned unchanged. A pipeline passed to `enable_raincheck` may be
    passed here too (its model and the pipeline instance are both restored). Returns what was passed.
    """
    if _is_pipeline(model):
        hf.unguard_pipeline_kwargs(model)
        disable_raincheck(model.model)
        return model
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        return model
    for cache in list(state.caches.values()):
        cache.cancel()
    attention.uninstall(state.adapter.text_attention_modules())
    if state.adapter.gdn_glue is not None:
        gdn_patch.uninstall(state.adapter.gdn_modules())
    for name in _PATCHED_METHODS:
        if name in state.own_attrs:
            setattr(model, name, state.own_attrs[name])
        else:
            vars(model).pop(name, None)
    delattr(model, STATE_ATTR)
    return model
