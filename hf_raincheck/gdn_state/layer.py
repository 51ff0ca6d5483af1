"""One Gated DeltaNet layer over the rows of a Raincheck forward (DESIGN.md rule 3).

Rows come in processing order: first the deferred rows of the plan being restored (if any), then the live
rows (a prompt's uncached tokens, or one decode row). Per layer:

1. deferred rows continue the plan's prefix checkpoint (recurrent state and conv window at the boundary), in
   source order; then the live state is joined: ``S_live += P_tail (S_prefix_new - S_prefix_old)``;
2. live rows continue the live state. When a new plan's boundary falls inside them, the state there becomes
   that plan's checkpoint, and the rows after it start its ``P_tail`` (identity at the boundary); while a plan
   is pending, every live row after its boundary multiplies its transition into ``P_tail``.

A decode row therefore sees the chunk restored in its own step. The family's projections, short conv and
output gate come from a `GDNGlue` (model-specific, in ``hf_raincheck.models``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import advance
from .state import GDNLayerState


@dataclass
class GDNStep:
    """How the rows of one forward split, for every GDN layer (host-side ints; no device syncs).

    Attributes:
        restore_plan: ``id`` of the plan whose deferred rows lead the forward (None: no deferred rows).
        num_restore: how many rows (at the front) restore it.
        checkpoint_plan: ``id`` of a new plan whose boundary falls inside the live rows (None: none).
        checkpoint_at: live rows before that boundary.
        track: whether live rows after the boundary (all of them when there is no checkpoint) extend the pending
            plan's ``P_tail``.
        backend: ``"torch"`` or ``"fla"``.
    """

    restore_plan: int | None
    num_restore: int
    checkpoint_plan: int | None
    checkpoint_at: int
    track: bool
    backend: str


class GDNGlue:
    """Family-specific pieces of a GDN layer (transformers' module attributes and helper functions)."""

    def project(self, module, hidden):  # -> mixed_qkv [1, C, T] (pre-conv), z, b, a
        raise NotImplementedError

    def conv(self, module, mixed_qkv, window):  # -> conv_out [1, T, C], new window [1, C, kernel]
        raise NotImplementedError

    def factors(self, module, conv_out, a, b):  # -> q, k, v, g, beta
        raise NotImplementedError

    def output(self, module, core_out, z):  # -> [1, T, hidden]
        raise NotImplementedError

    def dims(self, module):  # -> (num_v_heads, key_dim, value_dim, conv_channels, kernel)
        raise NotImplementedError


def _segment(glue, module, backend, qkv, a, b, recurrent, window, transition=None):
    conv_out, window = glue.conv(module, qkv, window)
    q, k, v, g, beta = glue.factors(module, conv_out, a, b)
    out, recurrent, transition = advance(backend, q, k, v, g, beta, recurrent, transition)
    return out, recurrent, window, transition


def gdn_rows_forward(glue: GDNGlue, module, hidden: torch.Tensor, layer: GDNLayerState, step: GDNStep):
    """The layer's output ``[1, T, hidden]`` for the rows of one Raincheck forward; updates `layer`."""
    qkv, z, b, a = glue.project(module, hidden)
    total = hidden.shape[1]
    outs = []
    n = step.num_restore
    if n:
        prefix = layer.prefix
        if prefix is None or prefix.plan_id != step.restore_plan:
            raise RuntimeError("Raincheck GDN state: deferred rows without the checkpoint of their plan")
        out, new_prefix, prefix.conv, _ = _segment(
            glue, module, step.backend, qkv[..., :n], a[:, :n], b[:, :n], prefix.recurrent, prefix.conv
        )
        layer.join(new_prefix)
        outs.append(out)
    live = total - n
    if live:
        cut = step.checkpoint_at if step.checkpoint_plan is not None else 0
        if cut:
            out, layer.recurrent, layer.conv, _ = _segment(
                glue, module, step.backend, qkv[..., n : n + cut], a[:, n : n + cut], b[:, n : n + cut],
                layer.recurrent, layer.conv,
            )
            outs.append(out)
        if step.checkpoint_plan is not None:
            num_v_heads, key_dim, value_dim, channels, kernel = glue.dims(module)
            layer.checkpoint(
                step.checkpoint_plan, num_v_heads, key_dim, value_dim, (1, channels, kernel), hidden.device, qkv.dtype
            )
        rest = slice(n + cut, total)
        if rest.stop > rest.start:
            transition = layer.prefix.transition if (step.track and layer.prefix is not None) else None
            out, layer.recurrent, layer.conv, transition = _segment(
                glue, module, step.backend, qkv[..., rest], a[:, rest], b[:, rest], layer.recurrent, layer.conv,
                transition,
            )
            if transition is not None:
                layer.prefix.transition = transition
            outs.append(out)
    core = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return glue.output(module, core, z)
