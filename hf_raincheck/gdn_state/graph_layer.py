"""One Gated DeltaNet layer inside a compiled static step: `gdn_rows_forward_graph` (one conversation,
`hf_raincheck.generation.decode.StaticStep`) and `gdn_batch_forward_graph` (a static batch,
`hf_raincheck.generation.shared_static`). The rules of `layer.gdn_rows_forward` (docs/design.md rule 3) with fixed
shapes and no host values: a deferred window padded with inert rows, every state updated in place (the fixed
``[S | P_tail]`` layout), the kernels through the package's custom ops (`ops.py`: one opaque node per call in the
traced graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layer import GDNGlue
from .ops import advance, advance_, join_prefix_, lazy_window_
from .state import GDNLayerState


@dataclass
class GDNGraphStep:
    """The rows of a compiled static step, for every GDN layer (tensors and shapes only, see `gdn_rows_forward_graph`).

    Attributes:
        valid: bool ``[chunk]``: which of the leading chunk rows are real deferred rows (None: a plain decode step,
            one row).
        count: 0-d long tensor: how many are (the conv window after the chunk ends at the last real row).
        live: whether a decode row follows (False: the chunk alone, the unfused control).
        backend: ``"torch"`` or ``"fla"``.
        lazy: a fused step (chunk and decode row) leaves its window's join pending (`ops.lazy_window_`): the
            layers' ``pending`` buffers take it, and the cache folds them in before any other forward
            (`DeferredPrefillCache.join_pending_gdn`).
    """

    valid: torch.Tensor | None
    count: torch.Tensor | None
    live: bool
    backend: str
    lazy: bool = False


def gdn_rows_forward_graph(glue: GDNGlue, module, hidden: torch.Tensor, layer: GDNLayerState, step: GDNGraphStep):
    """`gdn_rows_forward` for compiled static steps: fixed shapes, no host values, every update in place.

    Rows: ``chunk`` deferred rows (padding after the real ones: ``beta = 0`` and ``g = 0`` make a padding row the
    identity on the state, and the conv window after the chunk is taken at the last real row) then one decode row;
    or the decode row alone. The layer is in the fixed layout (``[S | P_tail]`` always). Kernels run through the
    ``hf_raincheck::gated_delta`` custom op (`ops.py`): one opaque node per call in the traced graph.
    """
    qkv, z, b, a = glue.project(module, hidden)
    outs = []
    window = None
    if step.valid is not None:
        n = step.valid.shape[0]
        prefix = layer.prefix
        # channels last (`conv_tail`): [window | the chunk's rows] as [1, kernel + n, C]
        full = torch.cat([prefix.conv.transpose(1, 2), qkv.transpose(1, 2)[:, :n]], dim=1)
        conv_out = glue.conv_tail(module, full, n)
        where = step.count + torch.arange(prefix.conv.shape[-1], device=full.device)
        new_window = full.index_select(1, where).transpose(1, 2)
        q, k, v, g, beta = glue.factors(module, conv_out, a[:, :n], b[:, :n])
        # the kernels want contiguous rows (fla copies views, three eager copies per layer inside the opaque call);
        # made here, Inductor writes them in the kernel that computes them
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        valid = step.valid[None, :, None]
        g = torch.where(valid, g, torch.zeros_like(g))
        beta = torch.where(valid, beta, torch.zeros_like(beta))
        window = (q, k, v, g, beta)
        prefix.conv.copy_(new_window)
    if window is not None and not (step.live and step.lazy):
        out, new_prefix = advance(step.backend, *window, prefix.recurrent, opaque=True)
        join_prefix_(layer.state, prefix.recurrent, new_prefix)  # S_live += P_tail (new - old); prefix <- new
        outs.append(out)
    if step.live:
        full = torch.cat([layer.conv.transpose(1, 2), qkv.transpose(1, 2)[:, -1:]], dim=1)
        conv_out = glue.conv_tail(module, full, 1)
        layer.conv.copy_(full[:, 1:].transpose(1, 2))
        live = glue.factors(module, conv_out, a[:, -1:], b[:, -1:])
        if window is not None and step.lazy:  # the decode row first, the window's join left pending
            outs.extend(lazy_window_(step.backend, *window, prefix.recurrent, layer.pending, layer.state, *live))
        else:
            outs.append(advance_(step.backend, *live, layer.state, layer.carry))  # the state in place
    core = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return glue.output(module, core, z)


@dataclass
class GDNBatchGraphStep:
    """The rows of a compiled static batch step (`hf_raincheck.generation.shared_static`), for every GDN layer:
    tensors and shapes only (see `gdn_batch_forward_graph`).

    Attributes:
        layers: per GDN layer index, the batch's state buffers (`BatchedDeferredPrefillCache.gdn_buffers`): ``state``
            ``[B, H_v, K, V + K]`` fp32 (``[S | P_tail]``, the fixed layout), ``conv`` ``[B, C, kernel]``,
            ``prefix`` ``[B, H_v, K, V]`` fp32 and ``prefix_conv`` ``[B, C, kernel]`` (each row's checkpoint; a row
            without a pending plan carries nothing, so its rows there are never read into its live state).
        live: bool ``[B]``: which rows feed a decode row (a stopped row's decode position changes no state).
        valid: bool ``[B, chunk]``: which chunk rows are real deferred rows (None: a decode-only step).
        count: long ``[B]``: how many are, per row (the first ``count[b]``).
        backend: ``"torch"`` or ``"fla"``.
        lazy: a fused step (every fused batch step leaves its rows' joins pending, `gdn_batch_forward_graph`): the
            layers' ``pending`` buffers (``[B, H_v, K, V]`` fp32, `BatchedDeferredPrefillCache.pending_gdn_buffers`)
            take them, and the batch cache folds them in before any forward that is not one and when the call ends.

    `live`, `valid` and `count` are set inside the traced graph (from the step's ``[4, B]`` index tensor)."""

    layers: dict
    backend: str
    live: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    count: torch.Tensor | None = None
    lazy: bool = False


def gdn_batch_forward_graph(glue: GDNGlue, module, hidden: torch.Tensor, buffers: dict, step: GDNBatchGraphStep):
    """`gdn_rows_forward_graph` for the B rows of a compiled static batch step, every row on its own states (rows
    of `buffers`, updated in place), in one kernel call per row block for all rows.

    `hidden` ``[B, chunk + 1, hidden]`` (row b: its deferred window, padding after its ``count[b]`` real rows, then
    its decode row) or ``[B, 1, hidden]`` (decode rows only). Per row, as `gdn_rows_forward` (docs/design.md rule
    3): the real deferred rows continue the row's prefix checkpoint (state and conv window; padding rows have
    ``g = beta = 0``, the identity, and the conv window is taken at the last real row), and the decode row
    continues the live ``[S | P_tail]`` (its transition multiplies into P_tail) and the live conv window. A row
    whose decode row is not live (it stopped) keeps its live state and conv window.

    A fused step does not join the checkpoint's change into the live state (``S_live += P_tail (S_prefix_new -
    S_prefix_old)``): as a batch-1 fused step (`ops.lazy_window_`), the decode rows run first on the unjoined
    states and every row's change adds to ``buffers["pending"]`` (a row that carried nothing adds zero), so the
    live state is ``S + P_tail pending``; the batch cache folds it in before any other forward and when the call
    ends (`BatchedDeferredPrefillCache.join_pending_gdn`; `step.lazy` tells it). At B = 16 this takes 85 us of
    GPU time off each fused step's GDN layer (Qwen3.5-9B's heads, an H100: 557 -> 472 us; benchmarks page).
    `naive.naive_batch_graph_step` is the plain per-row reference (joined)."""
    qkv, z, b, a = glue.project(module, hidden)
    state, conv = buffers["state"], buffers["conv"]
    value_dim = buffers["prefix"].shape[-1]
    outs = []
    window = None
    if step.valid is not None:
        n = step.valid.shape[1]
        prefix_conv = buffers["prefix_conv"]
        kernel = prefix_conv.shape[-1]
        # channels last (`conv_tail`): [B, kernel + n, C]
        full = torch.cat([prefix_conv.transpose(1, 2), qkv.transpose(1, 2)[:, :n]], dim=1)
        conv_out = glue.conv_tail(module, full, n)
        # [B, kernel]: ends at the last real row (a row that carried nothing: its old window, unchanged)
        where = step.count[:, None] + torch.arange(kernel, device=full.device)
        new_window = full.gather(1, where[:, :, None].expand(-1, -1, full.shape[2])).transpose(1, 2)
        q, k, v, g, beta = glue.factors(module, conv_out, a[:, :n], b[:, :n])
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        valid = step.valid[:, :, None]
        g = torch.where(valid, g, torch.zeros_like(g))
        beta = torch.where(valid, beta, torch.zeros_like(beta))
        window = (q, k, v, g, beta)
        prefix_conv.copy_(new_window)
    live = step.live[:, None, None]
    full = torch.cat([conv.transpose(1, 2), qkv.transpose(1, 2)[:, -1:]], dim=1)  # [B, kernel + 1, C]
    conv_out = glue.conv_tail(module, full, 1)
    conv.copy_(torch.where(live, full[:, 1:].transpose(1, 2), conv))
    q1, k1, v1, g1, beta1 = glue.factors(module, conv_out, a[:, -1:], b[:, -1:])
    # a stopped row's decode position is the identity on its state (g = beta = 0), so the kernel's final state is
    # every row's new state: no select over the [B, H_v, K, V + K] states, which the kernel updates in place
    g1 = torch.where(live, g1, torch.zeros_like(g1))
    beta1 = torch.where(live, beta1, torch.zeros_like(beta1))
    if window is None:
        outs.append(advance_(step.backend, q1, k1, v1, g1, beta1, state, state.shape[-1] - value_dim))
    else:  # the decode rows first, every row's join left pending
        pending = buffers.get("pending")
        if pending is None or not step.lazy:
            raise RuntimeError("a fused batch step leaves its joins pending: it needs buffers['pending'] and "
                               "step.lazy (BatchedDeferredPrefillCache.pending_gdn_buffers)")
        outs.extend(lazy_window_(step.backend, *window, buffers["prefix"], pending, state, q1, k1, v1, g1, beta1))
    core = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return glue.output(module, core, z)
