"""Routes a GDN module's forward to the package's layer forwards (`gdn_rows_forward`, `gdn_shared_forward`, the
compiled steps' `graph_layer` forwards) during Raincheck's forwards only (instance-level patch).

Calls that are not Raincheck's (plain `forward` / `generate`) reach the module's own forward unchanged. When
accelerate has hooked the module (``device_map``), the patch goes under the hook (``_old_forward``), so inputs
are still moved to the module's device first.
"""

from __future__ import annotations

import functools

from ..transformers_coupling import GDN_CACHE_ARGUMENT, hooked_forward_name
from .graph_layer import GDNBatchGraphStep, GDNGraphStep, gdn_batch_forward_graph, gdn_rows_forward_graph
from .layer import gdn_rows_forward
from .shared_layer import SharedGDNSteps, gdn_shared_forward


def _raincheck_gdn_forward(original, glue, module, hidden_states, *args, **kwargs):
    cache = kwargs.get(GDN_CACHE_ARGUMENT)  # (the decoder layer passes it by keyword)
    context = getattr(cache, "forward_context", None)  # a Raincheck forward's (`ForwardContext`)
    step = context.gdn_step if context is not None else None
    if step is None:
        return original(hidden_states, *args, **kwargs)
    if isinstance(step, SharedGDNSteps):  # a batch's rows in one forward, each on its own row cache's states
        return gdn_shared_forward(glue, module, hidden_states, step)
    if isinstance(step, GDNBatchGraphStep):  # a compiled static batch step: every row's states in batch buffers
        return gdn_batch_forward_graph(glue, module, hidden_states, step.layers[module.layer_idx], step)
    layer = cache.gdn_state(module.layer_idx)
    if isinstance(step, GDNGraphStep):
        return gdn_rows_forward_graph(glue, module, hidden_states, layer, step)
    return gdn_rows_forward(glue, module, hidden_states, layer, step)


def install(modules: dict, glue) -> None:
    """Patches each GDN module (idempotent)."""
    for module in modules.values():
        if getattr(module, "_raincheck_gdn_original", None) is not None:
            continue
        attr = hooked_forward_name(module)
        original = getattr(module, attr)
        # whether `attr` was an instance attribute (accelerate's hook, another patch) or the class's method
        own = attr in vars(module)
        module._raincheck_gdn_original = (attr, original, own)
        patched = functools.partial(_raincheck_gdn_forward, original, glue, module)
        setattr(module, attr, functools.update_wrapper(patched, original))


def uninstall(modules: dict) -> None:
    """Gives each GDN module its forward back as it was (idempotent)."""
    for module in modules.values():
        saved = getattr(module, "_raincheck_gdn_original", None)
        if saved is None:
            continue
        attr, original, own = saved
        if own:
            setattr(module, attr, original)
        else:
            delattr(module, attr)  # the class's forward again
        del module._raincheck_gdn_original
