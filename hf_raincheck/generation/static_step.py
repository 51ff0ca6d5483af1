"""Whether a static cache's decode steps are compiled, and the compiled step (`decode.StaticStep`) if so."""

from __future__ import annotations

import warnings

import torch

from .. import transformers_coupling as hf
from .decode import StaticStep
from .state import RaincheckState


def static_step(model, state: RaincheckState, gen_config, device: torch.device) -> StaticStep | None:
    """The compiled step for a static cache, as transformers decides for its own static caches: unless
    ``disable_compile``, on accelerators (or any device when the compile config says so,
    `hf_raincheck.transformers_coupling.compiles_on_all_devices`), with ``compile_config`` (default: transformers'
    `CompileConfig`), for Qwen3-VL and Qwen3.5 alike."""
    if gen_config.disable_compile:
        return None
    compile_config = hf.compile_config_or_default(gen_config.compile_config)
    if device.type not in ("cuda", "xpu") and not hf.compiles_on_all_devices(compile_config):
        return None
    devices = state.adapter.decoder_devices()
    if len(devices) > 1:
        # a model split over devices (accelerate device_map): Inductor failed to lower the fused step's cache
        # writes through accelerate's hooks, and CUDA graphs cannot span devices (torch skips them, and a compiled
        # step without them is slower than an eager one). Steps run eagerly on the static cache, with the same
        # results.
        if not state.warned_multi_device:
            state.warned_multi_device = True
            warnings.warn(
                f"Raincheck: the model's decoder spans {len(devices)} devices ({', '.join(map(str, devices))}); "
                "compiled steps need one device, so this static cache's steps run eagerly (same results). "
                "Pass disable_compile=True to silence this.", stacklevel=4)
        return None
    options = compile_config.to_dict()
    key = repr(sorted(options.items()))
    step = state.static_steps.get(key)
    if step is None:
        step = state.static_steps[key] = StaticStep(state.adapter, options)
    return step
