"""The batched pieces of a shared GDN forward (`shared_layer.gdn_shared_forward`): n batch rows of one kind in one
call of each piece (projections, short conv, gates, kernel, output) for all of them, each row on its own states,
as `layer.gdn_rows_forward` runs it alone.

Rows are right-aligned in ``hidden [n, q, hidden]`` (row j's rows are positions ``starts[j]:``); the positions
before them are padding, inert (zero conv inputs, ``g = beta = 0``, zero outputs). Eager forwards are host-bound on
a GPU, so the index tensors a forward needs are built on the host once per forward and shared by its GDN layers
(the per-forward `cache` dict), and each row's new states are views made by one `split` per tensor.

- `gdn_prefill_rows_forward`: rows that continue their live state (Full / Hard prompts, text-only prompts);
- `gdn_checkpoint_rows_forward`: live rows with a new plan's boundary inside (a Raincheck first prefill);
- `gdn_restore_rows_forward`: deferred rows then at most one decode row (an eager fused decode step);
- `gdn_decode_rows_forward`: one decode row each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layer import GDNGlue, GDNStep, conv_window
from .ops import advance, zero_like
from .state import GDNLayerState


def stacked_rows(tensors: list) -> torch.Tensor:
    """``torch.cat(tensors)`` of ``[1, ...]`` tensors, without the copy when they are, in order, every row of one
    tensor (the `split` of the forward that made them: a batch's GDN states from one step to the next); then that
    tensor itself, which aliases them: callers only read it."""
    first = tensors[0]
    base = first._base
    if (base is not None and base.shape[0] == len(tensors) and base.shape[1:] == first.shape[1:]
            and base.stride() == first.stride()):
        offset, step = base.storage_offset(), base.stride(0)
        if all(t._base is base and t.storage_offset() == offset + j * step for j, t in enumerate(tensors)):
            return base
    return first if len(tensors) == 1 else torch.cat(tensors)


def cached_index(cache: dict, rows, device) -> torch.Tensor:
    """A long tensor of `rows` on `device`, built once per forward (each GDN layer would copy it host to device)."""
    key = ("index", tuple(rows), device)
    index = cache.get(key)
    if index is None:
        index = cache[key] = torch.tensor(list(rows), dtype=torch.long, device=device)
    return index


def _padding_mask(cache: dict, key, starts, ends, length: int, device) -> torch.Tensor:
    """bool ``[n, length]``: positions ``starts[j] <= p < ends[j]`` of each row (built once per forward)."""
    key = ("mask", key, tuple(starts), tuple(ends), length, device)
    mask = cache.get(key)
    if mask is None:
        p = torch.arange(length)[None, :]
        mask = cache[key] = ((p >= torch.tensor(starts)[:, None]) & (p < torch.tensor(ends)[:, None])).to(device)
    return mask


def _checkpoint_indices(cache: dict, starts, cuts, length: int, kernel: int, device):
    """`gdn_checkpoint_rows_forward`'s host-built index tensors, moved to `device` in one transfer and built once per
    forward: bool ``[n, length]`` masks of each row's rows (from ``starts[j]``), of its rows before its boundary
    (``starts[j]:cuts[j]``) and after it (from ``cuts[j]``), and long ``[n, 1, kernel]``: the positions
    ``cuts[j]:cuts[j] + kernel`` of the placed conv input, the window after row j's rows before its boundary."""
    key = ("checkpoint_indices", tuple(starts), tuple(cuts), length, kernel, device)
    got = cache.get(key)
    if got is None:
        n = len(starts)
        p = torch.arange(length)[None, :]
        s, c = torch.tensor(starts)[:, None], torch.tensor(cuts)[:, None]
        masks = torch.stack([p >= s, (p >= s) & (p < c), p >= c])
        moved = torch.cat([masks.flatten().long(), (c + torch.arange(kernel)).flatten()]).to(device)
        valid, before, after = moved[: masks.numel()].bool().view(3, n, length).unbind(0)
        got = cache[key] = (valid, before, after, moved[masks.numel() :].view(n, 1, kernel))
    return got


def _placed_windows(cache: dict, qkv, starts, windows, kernel: int) -> torch.Tensor:
    """``[n, C, kernel + q]``: each row's rows (positions ``starts[j]:`` of `qkv`, at ``kernel + starts[j]:``) with
    its conv window ``windows[j]`` (``[1, C, kernel]``; None: zeros) right before them; the positions before hold
    padding inputs, read only by padding positions."""
    n, channels, length = qkv.shape
    zeros = None
    placed = []
    for window in windows:
        if window is None:
            if zeros is None:
                zeros = qkv.new_zeros(1, channels, kernel)
            window = zeros
        placed.append(window)
    stacked = torch.cat([torch.cat(placed), qkv], dim=-1)  # [n, C, kernel + q]: windows first
    key = ("conv_index", tuple(starts), length, kernel, qkv.device)
    where = cache.get(key)
    if where is None:
        f = torch.arange(kernel + length)[None, :]
        s = torch.tensor(starts)[:, None]
        moved = (f >= s) & (f < s + kernel)
        where = cache[key] = torch.where(moved, f - s, f)[:, None, :].to(qkv.device)
    return stacked.gather(-1, where.expand(-1, channels, -1))


def _advance_rows(cache: dict, backend: str, q, k, v, g, beta, states: list, carries: list, dims, stacked=None):
    """`advance` for n batch rows, row j from ``states[j]`` (None: zeros) carrying ``carries[j]`` columns: one
    kernel call per distinct carry (the state's shape). `stacked`: every row's state stacked ``[n, ...]`` (row j is
    ``states[j]``), taken as is when all rows run in one call (no per-row concatenation). Returns ``(o [n, T, H_v,
    V], [final_j [1, ...]], final)``: ``final`` the stacked final states ``[n, ...]`` when all rows ran in one call
    (each ``final_j`` is its row j), else None."""
    num_v_heads, key_dim, value_dim = dims
    n = q.shape[0]
    groups: dict[int, list[int]] = {}
    for j, c in enumerate(carries):
        groups.setdefault(c, []).append(j)
    core = None
    whole = None
    finals = [None] * n
    for c, members in groups.items():
        if len(members) == n:
            qg, kg, vg, gg, bg = q, k, v, g, beta
        else:
            index = cached_index(cache, members, q.device)
            qg, kg, vg, gg, bg = (t.index_select(0, index) for t in (q, k, v, g, beta))
        group = [states[j] for j in members]
        if stacked is not None and len(members) == n:
            state = stacked
        elif all(s is None for s in group):
            state = None
        else:
            zero = None
            for i, s in enumerate(group):
                if s is None:  # (only without P_tail: a state carrying it always exists)
                    if zero is None:
                        zero = torch.zeros(1, num_v_heads, key_dim, value_dim, dtype=torch.float32, device=q.device)
                    group[i] = zero
            state = stacked_rows(group)
        out, final = advance(backend, qg, kg, vg, gg, bg, state, c)
        if len(members) == n:
            core, whole = out, final
        else:
            if core is None:
                core = out.new_zeros((n,) + tuple(out.shape[1:]))
            core.index_copy_(0, cached_index(cache, members, q.device), out)
        for j, row in zip(members, final.split(1)):  # (one call for every row's view: eager steps are host-bound)
            finals[j] = row
    return core, finals, whole


def _identity(cache: dict, n: int, num_v_heads: int, key_dim: int, device) -> torch.Tensor:
    """P_tail = I for n rows, ``[n, H_v, K, K]`` fp32 (an expanded view of one identity built once per forward)."""
    key = ("identity", key_dim, device)
    eye = cache.get(key)
    if eye is None:
        eye = cache[key] = torch.eye(key_dim, dtype=torch.float32, device=device)
    return eye.expand(n, num_v_heads, key_dim, key_dim)


def _inert(mask, g, beta):
    """`g` and `beta` with zeros where `mask` ``[n, T]`` is False (those rows are the identity on the state). (The
    zeros here and below are persistent 0-d tensors, `zero_like`: no zero filled on the device per GDN layer.)"""
    mask = mask[:, :, None]
    return torch.where(mask, g, zero_like(g)), torch.where(mask, beta, zero_like(beta))


def _zero_padding_inputs(qkv, valid):
    """`qkv` ``[n, C, q]`` with zeros at padding positions: whatever a padding position holds (even a NaN) then
    never reaches a real row (the kernels multiply k and v by beta = 0, and 0 * NaN is NaN)."""
    return torch.where(valid[:, None, :], qkv, zero_like(qkv))


def _zero_padding(out, valid):
    return torch.where(valid[:, :, None], out, zero_like(out))


def gdn_prefill_rows_forward(glue: GDNGlue, module, hidden: torch.Tensor, starts: list[int],
                             layers: list[GDNLayerState], steps: list[GDNStep], cache: dict | None = None):
    """`gdn_rows_forward` for n batch rows whose rows all continue their own live state (``num_restore == 0``, no
    checkpoint inside), in one call of each piece (projections, short conv, gates, output) for all of them and one
    kernel call per P_tail width (rows whose states carry P_tail's columns and rows without them run apart).

    `hidden` ``[n, q, hidden]``: row j's rows are positions ``starts[j]:`` (right-aligned, at least one); the
    positions before them are padding, inert: their short-conv inputs never reach a real row (row j's conv window
    is placed right before its rows), ``g = beta = 0`` make them the identity on the state (and on P_tail), and
    their outputs are zeros. Every state is updated as `gdn_rows_forward` does (new tensors, never in place; a
    finished plan's P_tail released; a fixed layout's first forward gets P_tail = I's columns after it). Returns
    ``[n, q, hidden]``."""
    cache = {} if cache is None else cache
    num_v_heads, key_dim, value_dim, channels, kernel = glue.dims(module)
    n, length = hidden.shape[0], hidden.shape[1]
    if len(starts) != n or len(layers) != n or len(steps) != n:
        raise ValueError("gdn_prefill_rows_forward: starts, layers and steps need one entry per row of hidden")
    for start, step in zip(starts, steps):
        if not 0 <= start < length or step.num_restore or step.checkpoint_plan is not None:
            raise ValueError("gdn_prefill_rows_forward: every row needs live rows only (no deferred rows, no "
                             f"checkpoint) and 0 <= start < {length}, got start {start}")
    qkv, z, b, a = glue.project(module, hidden)
    valid = _padding_mask(cache, "rows", starts, [length] * n, length, hidden.device)
    qkv = _zero_padding_inputs(qkv, valid)
    if all(layer.conv is None for layer in layers):
        # no window yet (a first prefill): with zeros at padding positions the causal conv's zero left padding is
        # each row's own (the window after rows shorter than the kernel ends with those zeros too)
        full = qkv
        conv_out = glue.conv_full(module, full)
        new_windows = conv_window(full, kernel)
    else:
        full = _placed_windows(cache, qkv, starts, [layer.conv for layer in layers], kernel)
        conv_out = glue.conv_full(module, full)[:, -length:]
        new_windows = full[..., -kernel:].contiguous()
    q, k, v, g, beta = glue.factors(module, conv_out, a, b)
    g, beta = _inert(valid, g, beta)
    for layer, step in zip(layers, steps):
        if not step.track and layer.carry:  # (the pending plan finished: its P_tail is no longer extended)
            layer.release()
    core, finals, _ = _advance_rows(cache, steps[0].backend, q, k, v, g, beta, [layer.state for layer in layers],
                                    [layer.carry for layer in layers], (num_v_heads, key_dim, value_dim))
    for layer, final, window in zip(layers, finals, new_windows.split(1)):
        layer.set_state(final, value_dim)
        layer.conv = window
        if layer.fixed and layer.carry == 0:  # a fixed layer's first forward: its rows ran without P_tail's columns
            layer.add_transition_columns(key_dim)
    return _zero_padding(glue.output(module, core, z), valid)


def gdn_checkpoint_rows_forward(glue: GDNGlue, module, hidden: torch.Tensor, starts: list[int],
                                layers: list[GDNLayerState], steps: list[GDNStep], cache: dict | None = None):
    """`gdn_rows_forward` for n batch rows that each run live rows with a new plan's boundary strictly inside them
    (``num_restore == 0``, ``0 < checkpoint_at < rows``: a Raincheck first prefill with images), in one call of
    each piece for all of them: one short conv over every row, one kernel call for the rows before the boundaries
    (each row from its live state without P_tail's columns; the other positions, padding and tails, inert), each
    row's checkpoint there (state, conv window at its boundary), then one kernel call per P_tail width for the
    tails (right-aligned; from ``[S | I]``). `hidden` ``[n, q, hidden]`` right-aligned as in
    `gdn_prefill_rows_forward`. Returns ``[n, q, hidden]`` (padding positions zero)."""
    cache = {} if cache is None else cache
    num_v_heads, key_dim, value_dim, channels, kernel = glue.dims(module)
    n, length = hidden.shape[0], hidden.shape[1]
    if len(starts) != n or len(layers) != n or len(steps) != n:
        raise ValueError("gdn_checkpoint_rows_forward: starts, layers and steps need one entry per row of hidden")
    cuts = []
    for start, step in zip(starts, steps):
        if (not 0 <= start < length or step.num_restore or step.checkpoint_plan is None
                or not 0 < step.checkpoint_at < length - start):
            raise ValueError("gdn_checkpoint_rows_forward: every row needs live rows with a new plan's boundary "
                             f"strictly inside them and 0 <= start < {length}, got start {start}")
        cuts.append(start + step.checkpoint_at)
    qkv, z, b, a = glue.project(module, hidden)
    valid, before, after, where = _checkpoint_indices(cache, starts, cuts, length, kernel, hidden.device)
    qkv = _zero_padding_inputs(qkv, valid)
    tail = length - min(cuts)  # the tails' positions (right-aligned)
    after = after[:, -tail:]
    if all(layer.conv is None for layer in layers):
        # no window yet (a first prefill): with zeros at padding positions, zeros before every row are what
        # `_placed_windows` would place there (one pad instead of its concatenations and gather per GDN layer)
        full = F.pad(qkv, (kernel, 0))
    else:
        full = _placed_windows(cache, qkv, starts, [layer.conv for layer in layers], kernel)
    conv_out = glue.conv_full(module, full)[:, -length:]
    boundary_windows = full.gather(-1, where.expand(-1, channels, -1))
    end_windows = full[..., -kernel:].contiguous()
    q, k, v, g, beta = glue.factors(module, conv_out, a, b)
    g1, beta1 = _inert(before, g, beta)
    dims = (num_v_heads, key_dim, value_dim)
    backend = steps[0].backend
    # the rows before a new plan's boundary: `checkpoint` starts P_tail afresh right after them, so a map carried
    # through them would be dropped (a fixed layout carries one from the end of its first forward on)
    live = [layer.state if layer.carry == 0 else layer.recurrent.contiguous() for layer in layers]
    out1, finals, boundary = _advance_rows(cache, backend, q, k, v, g1, beta1, live, [0] * n, dims)
    # every row's checkpoint and ``[S | P_tail = I]`` at once (eager forwards are host-bound: per-row copies and
    # identities would cost launches per row and GDN layer): the boundary states stacked, one concatenation with a
    # cached identity; each row's checkpoint and live state are rows of these new tensors (never written in place)
    tails = torch.cat([boundary, _identity(cache, n, num_v_heads, key_dim, boundary.device)], dim=-1)
    for layer, step, recurrent, window, tail_state in zip(layers, steps, boundary.split(1), boundary_windows.split(1),
                                                          tails.split(1)):
        layer.start_tail(step.checkpoint_plan, recurrent, window, tail_state, value_dim)
        if not step.track and layer.carry:
            layer.release()
    g2, beta2 = _inert(after, g[:, -tail:], beta[:, -tail:])
    out2, finals, _ = _advance_rows(cache, backend, q[:, -tail:], k[:, -tail:], v[:, -tail:], g2, beta2,
                                    [layer.state for layer in layers], [layer.carry for layer in layers], dims,
                                    stacked=tails if all(step.track for step in steps) else None)
    for layer, final, window in zip(layers, finals, end_windows.split(1)):
        layer.set_state(final, value_dim)
        layer.conv = window
        if layer.fixed and layer.carry == 0:
            layer.add_transition_columns(key_dim)
    core = torch.cat([out1[:, :-tail], torch.where(after[:, :, None, None], out2, out1[:, -tail:])], dim=1)
    return _zero_padding(glue.output(module, core, z), valid)


def gdn_restore_rows_forward(glue: GDNGlue, module, hidden: torch.Tensor, starts: list[int],
                             layers: list[GDNLayerState], steps: list[GDNStep], cache: dict | None = None):
    """`gdn_rows_forward` for n batch rows that each restore deferred rows of their pending plan and then feed at
    most one decode row (``num_restore > 0``, no new plan's boundary: an eager fused decode step; a row that stopped
    restores without a decode row), in one call of each piece for all of them: one short conv (every row's deferred
    rows after its prefix window, then every decode row after its live window), one kernel call for the deferred
    rows from the stacked prefix checkpoints, every row's join at once, one kernel call per P_tail width for the
    decode rows. `hidden` ``[n, q, hidden]``, right-aligned as in `gdn_prefill_rows_forward`: row j's rows are
    positions ``starts[j]:``, its deferred rows first. Returns ``[n, q, hidden]`` (padding positions zero)."""
    cache = {} if cache is None else cache
    num_v_heads, key_dim, value_dim, channels, kernel = glue.dims(module)
    n, length = hidden.shape[0], hidden.shape[1]
    if len(starts) != n or len(layers) != n or len(steps) != n:
        raise ValueError("gdn_restore_rows_forward: starts, layers and steps need one entry per row of hidden")
    ends, alive = [], []
    for start, step, layer in zip(starts, steps, layers):
        live = length - start - step.num_restore
        if not 0 <= start < length or step.num_restore < 1 or step.checkpoint_plan is not None or live not in (0, 1):
            raise ValueError("gdn_restore_rows_forward: every row needs deferred rows then at most one decode row (no "
                             f"checkpoint) and 0 <= start < {length}, got start {start}")
        prefix = layer.prefix
        if prefix is None or prefix.plan_id != step.restore_plan or not layer.carry:
            raise RuntimeError("Raincheck GDN state: deferred rows without the checkpoint of their plan")
        ends.append(start + step.num_restore)
        alive.append(live == 1)
    every = all(alive)
    # every row carries as many deferred rows and decodes (the common fused step): no padding, nothing inert
    uniform = every and not any(starts)
    qkv, z, b, a = glue.project(module, hidden)
    if not uniform:
        valid, restoring, _, where = _checkpoint_indices(cache, starts, ends, length, kernel, hidden.device)
        qkv = _zero_padding_inputs(qkv, valid)
    # [prefix window | deferred rows (right-aligned; a decode row at the end)] then [live window | decode row]: each
    # conv output reads the `kernel` inputs up to its own, so one conv serves both; the outputs over the live window
    # (and, for the deferred rows' kernel call, over the decode row) are not used
    prefix_convs = [layer.prefix.conv for layer in layers]
    placed = (torch.cat([stacked_rows(prefix_convs), qkv], dim=-1) if uniform
              else _placed_windows(cache, qkv, starts, prefix_convs, kernel))
    live_windows = stacked_rows([layer.conv for layer in layers])
    full = torch.cat([placed, live_windows, qkv[..., -1:]], dim=-1)
    conv_out = glue.conv_full(module, full)[:, kernel:]
    prefix_windows = (placed[..., length - 1 : length - 1 + kernel] if every
                      else placed.gather(-1, where.expand(-1, channels, -1)))
    end_windows = full[..., -kernel:]
    q, k, v, g, beta = glue.factors(module, conv_out, a, b)
    q, k, v = (t.split([length, kernel, 1], dim=1) for t in (q, k, v))
    if uniform:
        q1, k1, v1, g1, beta1 = q[0][:, :-1], k[0][:, :-1], v[0][:, :-1], g[:, :-1], beta[:, :-1]
    else:
        (q1, k1, v1), (g1, beta1) = (q[0], k[0], v[0]), _inert(restoring, g, beta)
    backend = steps[0].backend
    old_prefix = stacked_rows([layer.prefix.recurrent for layer in layers])
    out1, new_prefix = advance(backend, q1, k1, v1, g1, beta1, old_prefix)
    # every row's join at once: S_live += P_tail (S_prefix_new - S_prefix_old)
    states = stacked_rows([layer.state for layer in layers])
    transition = states[..., value_dim:]
    joined = torch.baddbmm(states[..., :value_dim].reshape(-1, key_dim, value_dim),
                           transition.reshape(-1, key_dim, key_dim),
                           (new_prefix - old_prefix).reshape(-1, key_dim, value_dim))
    joined = torch.cat([joined.view(n, num_v_heads, key_dim, value_dim), transition], dim=-1)
    # per-row views by one `split` each (eager steps are host-bound: a slice per row and GDN layer adds up); a row
    # that decodes gets its joined state only as the decode call's input
    members, live_states = [], []
    for j, (layer, step, recurrent, window, state) in enumerate(zip(layers, steps, new_prefix.split(1),
                                                                    prefix_windows.split(1), joined.split(1))):
        layer.prefix.recurrent, layer.prefix.conv = recurrent, window
        if alive[j] and step.track:
            members.append(j)
            live_states.append(state)
            continue
        layer.set_state(state, value_dim)
        if alive[j]:  # the plan finished with this step: P_tail is dropped before the decode row
            layer.release()
            members.append(j)
            live_states.append(layer.state)
    if not members:
        core = out1
    else:
        pick = (lambda t: t) if every else (lambda t: t.index_select(0, cached_index(cache, members, t.device)))
        q2, k2, v2 = pick(q[2]), pick(k[2]), pick(v[2])
        g2, beta2 = pick(g[:, -1:]), pick(beta[:, -1:])
        out2, finals, _ = _advance_rows(cache, backend, q2, k2, v2, g2, beta2, live_states,
                                        [state.shape[-1] - value_dim for state in live_states],
                                        (num_v_heads, key_dim, value_dim),
                                        stacked=joined if every and all(step.track for step in steps) else None)
        windows = end_windows.split(1)
        for j, final in zip(members, finals):
            layers[j].set_state(final, value_dim)
            layers[j].conv = windows[j]
        if not every:
            out2 = out1[:, -1:].index_copy(0, cached_index(cache, members, out1.device), out2)
        core = torch.cat([out1 if uniform else out1[:, :-1], out2], dim=1)
    out = glue.output(module, core, z)
    return out if uniform else _zero_padding(out, valid)


def gdn_decode_rows_forward(glue: GDNGlue, module, hidden: torch.Tensor, layers: list[GDNLayerState],
                            steps: list[GDNStep]) -> torch.Tensor:
    """`gdn_rows_forward` for n batch rows that each run one decode row on their own live state, in one call of
    each piece (projections, short conv, gates, kernel, output) for all of them: `hidden` ``[n, 1, hidden]``, row j
    on `layers[j]` as `steps[j]` says. Every state stays a new tensor (never written in place, as
    `gdn_rows_forward`: a transaction's rollback keeps the old ones). Rows whose states carry P_tail and rows that
    do not run together: the kernel acts on the state's columns one by one, so a row without P_tail runs with zero
    columns in its place, which it drops after. Returns ``[n, 1, hidden]``."""
    qkv, z, b, a = glue.project(module, hidden)
    for layer, step in zip(layers, steps):
        if layer.state is None:
            raise RuntimeError("Raincheck GDN state: a decode row without a live state")
        if not step.track and layer.carry:  # (the pending plan finished: its P_tail is no longer extended)
            layer.release()
    windows = stacked_rows([layer.conv for layer in layers])
    conv_out, new_windows = glue.conv(module, qkv, windows)
    q, k, v, g, beta = glue.factors(module, conv_out, a, b)
    value_dim = layers[0].value_dim
    carries = [layer.carry for layer in layers]
    most = max(carries)
    states = stacked_rows([layer.state if c == most else F.pad(layer.state, (0, most - c))
                           for layer, c in zip(layers, carries)])
    out, final = advance(steps[0].backend, q, k, v, g, beta, states, most)
    for layer, c, state, window in zip(layers, carries, final.split(1), new_windows.split(1)):
        layer.set_state(state if c == most else state[..., : value_dim + c].contiguous(), value_dim)
        layer.conv = window
    return glue.output(module, out, z)
