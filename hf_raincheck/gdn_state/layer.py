"""One Gated DeltaNet layer over the rows of a Raincheck forward (docs/design.md rule 3).

Rows come in processing order: first the deferred rows of the plan being restored (if any), then the live
rows (a prompt's uncached tokens, or one decode row). Per layer:

1. deferred rows continue the plan's prefix checkpoint (recurrent state and conv window at the boundary), in
   source order; then the live state is joined: ``S_live += P_tail (S_prefix_new - S_prefix_old)``;
2. live rows continue the live state. When a new plan's boundary falls inside them, the state there becomes
   that plan's checkpoint, and the rows after it start its ``P_tail`` (identity at the boundary); while a plan
   is pending, every live row after its boundary multiplies its transition into ``P_tail``.

A decode row therefore sees the chunk restored in its own step. The family's projections, short conv and
output gate come from a `GDNGlue` (model-specific, in ``hf_raincheck.models``).

This module runs one conversation's rows eagerly (`gdn_rows_forward`). The same layer over a forward shared by a
batch's rows is `shared_layer.gdn_shared_forward` (rows of one kind together: `batch_rows`); compiled static steps
run `graph_layer`'s forwards (fixed shapes, states updated in place).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .ops import advance, advance_split
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

    def conv_full(self, module, full):  # causal conv over ``full`` [1, C, L] (zero left padding) -> [1, L, C]
        raise NotImplementedError

    # the last `n` outputs of `conv_full` over ``rows`` [B, L, C] (positions on dim 1; L >= n + kernel - 1: no
    # padding read) -> [B, n, C], as elementwise products (compiled steps: fused into one kernel instead of a conv
    # kernel per layer; channels last, the layout of the projection and of the outputs)
    def conv_tail(self, module, rows, n):
        raise NotImplementedError

    # -> q, k, v, g, beta; row-wise: q, k, v have conv_out's rows, g and beta a's / b's (they may differ in number)
    def factors(self, module, conv_out, a, b):
        raise NotImplementedError

    def output(self, module, core_out, z):  # -> [1, T, hidden]
        raise NotImplementedError

    def dims(self, module):  # -> (num_v_heads, key_dim, value_dim, conv_channels, kernel)
        raise NotImplementedError


def conv_window(full: torch.Tensor, kernel: int) -> torch.Tensor:
    """The short-conv window ``[1, C, kernel]`` at the end of ``full [1, C, t]`` (zeros on the left if shorter)."""
    window = full[..., -kernel:]
    if window.shape[-1] < kernel:
        window = F.pad(window, (kernel - window.shape[-1], 0))
    return window.contiguous()


def _window_after(window, rows, kernel: int) -> torch.Tensor:
    """The short-conv window after `rows` ``[1, C, t]`` from `window` (None: zeros)."""
    return conv_window(rows if window is None else torch.cat([window, rows], dim=-1), kernel)


def gdn_rows_forward(glue: GDNGlue, module, hidden: torch.Tensor, layer: GDNLayerState, step: GDNStep):
    """The layer's output ``[1, T, hidden]`` for the rows of one Raincheck forward; updates `layer`."""
    qkv, z, b, a = glue.project(module, hidden)
    num_v_heads, key_dim, value_dim, channels, kernel = glue.dims(module)
    total = hidden.shape[1]
    n = step.num_restore
    live = total - n
    prefix = None
    if n:
        prefix = layer.prefix
        if prefix is None or prefix.plan_id != step.restore_plan:
            raise RuntimeError("Raincheck GDN state: deferred rows without the checkpoint of their plan")
    # the gates and the q / k / v split are row-wise, so one `factors` call serves every row (eager forwards are
    # host-bound on a GPU: each operator saved is a launch per GDN layer)
    if n and live:
        # one short conv for both segments: [prefix window | deferred rows | live window | live rows]. Each output
        # reads the `kernel` inputs up to its own, so the deferred rows continue the prefix window and the live
        # rows the live one; the `kernel` outputs over the live window are not used (their q / k / v rows are
        # skipped below: `factors` gives q, k, v for conv_out's rows, g and beta for a / b's)
        restore_qkv, live_qkv = qkv.split([n, live], dim=-1)
        full = torch.cat([prefix.conv, restore_qkv, layer.conv, live_qkv], dim=-1)
        conv_out = glue.conv_full(module, full)[:, kernel:]
        # both new windows in one copy (each a contiguous `[1, C, kernel]`)
        prefix_window, window_end = torch.stack([full[..., n : n + kernel], full[..., -kernel:]])
        q, k, v, g, beta = glue.factors(module, conv_out, a, b)
        q, k, v = (t.split([n, kernel, live], dim=1) for t in (q, k, v))
        g, beta = (t.split([n, live], dim=1) for t in (g, beta))
        restore = (q[0], k[0], v[0], g[0], beta[0])
        q, k, v, g, beta = q[2], k[2], v[2], g[1], beta[1]
    elif n:
        restore_out, prefix_window = glue.conv(module, qkv, prefix.conv)
        restore = glue.factors(module, restore_out, a, b)
    else:
        live_out, window_end = glue.conv(module, qkv, layer.conv)
        q, k, v, g, beta = glue.factors(module, live_out, a, b)
    outs = []
    if n:
        out, new_prefix = advance(step.backend, *restore, prefix.recurrent)
        prefix.conv = prefix_window
        layer.join(new_prefix)
        outs.append(out)
    if live:
        cut = step.checkpoint_at if step.checkpoint_plan is not None else 0
        # one short conv over every live row (a boundary inside them only splits the kernel calls): the conv
        # window at the boundary is read off the same rows
        rows = qkv[..., n:] if n else qkv
        if step.checkpoint_plan is not None and 0 < cut < live:
            # a new plan's boundary inside the live rows (a Raincheck prompt with images): the rows on both sides of
            # it (`advance_split`: the rows before it, then the tail from ``[S_b | I]``), from
            # the live state without P_tail's columns (`checkpoint` starts P_tail afresh at the boundary, so a map
            # carried through the rows before it would be dropped)
            before = layer.state if layer.carry == 0 else layer.recurrent  # (only read)
            out, boundary, state = advance_split(step.backend, q, k, v, g, beta, before, cut)
            layer.start_tail(step.checkpoint_plan, boundary, _window_after(layer.conv, rows[..., :cut], kernel),
                             state, value_dim)
            if not step.track:
                layer.release()
            outs.append(out)
        else:
            if cut:  # the boundary after every live row
                before = layer.state if layer.carry == 0 else layer.recurrent.contiguous()
                out, state = advance(step.backend, q, k, v, g, beta, before)
                layer.set_state(state, value_dim)
                layer.conv = _window_after(layer.conv, rows, kernel)
                outs.append(out)
            if step.checkpoint_plan is not None:
                layer.checkpoint(step.checkpoint_plan, num_v_heads, key_dim, value_dim, (1, channels, kernel),
                                 hidden.device, qkv.dtype)
            if not step.track and layer.carry:
                layer.release()
            if not cut:
                out, state = advance(step.backend, q, k, v, g, beta, layer.state, layer.carry)
                layer.set_state(state, value_dim)
                outs.append(out)
        layer.conv = window_end
    if layer.fixed and layer.carry == 0:  # a fixed layer's first forward: its rows ran without P_tail's columns
        layer.add_transition_columns(key_dim)
    core = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return glue.output(module, core, z)
