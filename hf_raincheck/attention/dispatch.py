"""Routes a text-attention call either to a Raincheck backend or back to the model's own implementation.

`install(model_attention_modules)` gives each text attention module a private copy of its config whose
``_attn_implementation`` is ``"raincheck"``; the function registered under that name (in transformers'
`AttentionInterface`, an additive registration) looks for the ``raincheck_backend`` keyword that only
Raincheck's own forwards pass. Without it, the call goes to the implementation the model was loaded with,
unchanged, so plain `forward`/`generate` calls behave exactly as before.
"""

from __future__ import annotations

from .. import transformers_coupling as hf
from . import flash
from .naive import naive_attention
from .sdpa import sdpa_attention

NAME = "raincheck"
BACKENDS = {"eager": naive_attention, "sdpa": sdpa_attention, "flash": flash.flash_attention}


class _CausalLowerRight:
    """The mask of a forward whose keys are exactly the entries its rows may see, in order, ending with the rows
    themselves: row r of q sees keys ``[0, kv - q + r]`` (bottom-right aligned causal; SDPA can then use its
    flash kernels instead of a dense boolean mask)."""

    def __repr__(self) -> str:
        return "CAUSAL_LOWER_RIGHT"


CAUSAL_LOWER_RIGHT = _CausalLowerRight()


def resolve_backend(name: str) -> str:
    """``auto`` -> SDPA, the faster at decode and fused-step shapes (flash-attn's kernels through the flash
    backend were slower than SDPA with its grouped path; see the benchmarks page); ``flash`` needs the flash_attn
    package (a ValueError says what to install)."""
    if name == "auto":
        return "sdpa"
    if name == "flash":
        flash.kernel()
    return name


def raincheck_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    backend = kwargs.pop("raincheck_backend", None)
    if backend is None:
        base_impl = hf.attention_implementation(module._raincheck_base_config)
        return hf.attention_function(module, base_impl)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if attention_mask is CAUSAL_LOWER_RIGHT:
        return BACKENDS[backend](query, key, value, None, scaling, causal_lower_right=True), None
    if isinstance(attention_mask, flash.FlashMask):  # the flash backend's layout (attention/flash.py)
        return flash.flash_attention(query, key, value, attention_mask.to(query.device), scaling), None
    if attention_mask.device != query.device:  # a device_map's hooks move it with the layer's inputs; else do it here
        attention_mask = attention_mask.to(query.device)
    out = BACKENDS[backend](query, key, value, attention_mask, scaling)
    return out, None


hf.register_attention_function(NAME, raincheck_attention)


def install(attention_modules) -> None:
    """Points these attention modules at the dispatcher (idempotent; instance-level only)."""
    for module in attention_modules:
        if getattr(module, "_raincheck_base_config", None) is not None:
            continue
        base = module.config
        module._raincheck_base_config = base
        module.config = hf.config_with_attention(base, NAME)


def uninstall(attention_modules) -> None:
    """Gives these attention modules their own config back (idempotent)."""
    for module in attention_modules:
        base = getattr(module, "_raincheck_base_config", None)
        if base is not None:
            module.config = base
            del module._raincheck_base_config
