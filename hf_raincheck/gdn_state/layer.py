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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .ops import advance, advance_, advance_split, join_prefix_, zero_like
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


@dataclass
class SharedGDNSteps:
    """The rows of a forward shared by a batch's rows (`hf_raincheck.generation.shared_rows`): per batch row, None
    (nothing of it in this forward) or ``(start, step, layers)``: its rows are positions ``start:`` (right-aligned;
    the positions before them are padding), split as `step` says, over its own states ``layers(layer_idx)``."""

    rows: list
    cache: dict = field(default_factory=dict)  # per forward: host-built index tensors shared by its GDN layers


def gdn_shared_forward(glue: GDNGlue, module, hidden: torch.Tensor, steps: SharedGDNSteps):
    """`gdn_rows_forward` for each batch row of a shared forward, on its own states; padding positions get zeros
    (no row sees them: their attention keys go to scratch slots). The rows whose only row is one decode row (a
    decode-only step; the rows that carry nothing in a fused step) run together (`gdn_decode_rows_forward`: one
    call of each piece for all of them); so do the rows that continue a live state with no deferred rows and no
    new plan's boundary (`gdn_prefill_rows_forward`: Full / Hard prompts, text-only prompts, decode rows beside
    them), and those whose live rows hold a new plan's boundary (`gdn_checkpoint_rows_forward`: Raincheck's first
    prefill with images), and those that restore deferred rows and then feed at most one decode row
    (`gdn_restore_rows_forward`: an eager fused decode step), and those that restore deferred rows and then run a
    prompt (a next turn folding the rows still pending: `_restore_then_prompt_rows`, both of the batched pieces
    in turn); the others (a kind with a single row; a boundary at a prompt's edge) run one by one."""
    out = None
    last = hidden.shape[1] - 1
    decode = [b for b, item in enumerate(steps.rows) if item is not None and _decode_row_only(item, last)]
    if len(decode) > 1:
        items = [steps.rows[b] for b in decode]
        rows = hidden[:, last:] if len(decode) == hidden.shape[0] else torch.cat([hidden[b : b + 1, last:]
                                                                                  for b in decode])
        decode_out = gdn_decode_rows_forward(glue, module, rows, [layers(module.layer_idx) for _, _, layers in items],
                                             [step for _, step, _ in items])
        out = decode_out.new_zeros((hidden.shape[0], hidden.shape[1], decode_out.shape[-1]))
        if len(decode) == hidden.shape[0]:
            out[:, last:] = decode_out
        else:
            for j, b in enumerate(decode):
                out[b, last] = decode_out[j, 0]
    else:
        decode = []
    together = set(decode)
    for kind, fn in ((_live_rows_only, gdn_prefill_rows_forward), (_checkpoint_inside, gdn_checkpoint_rows_forward),
                     (_restore_then_decode, gdn_restore_rows_forward)):
        chosen = [b for b, item in enumerate(steps.rows) if item is not None and b not in together and kind(item, last)]
        if len(chosen) < 2:
            continue
        together.update(chosen)
        items = [steps.rows[b] for b in chosen]
        every = len(chosen) == hidden.shape[0]
        rows = hidden if every else hidden.index_select(0, _cached_index(steps.cache, chosen, hidden.device))
        rows_out = fn(glue, module, rows, [start for start, _, _ in items],
                      [layers(module.layer_idx) for _, _, layers in items], [step for _, step, _ in items], steps.cache)
        if every and out is None:
            out = rows_out
        else:
            if out is None:
                out = rows_out.new_zeros((hidden.shape[0], hidden.shape[1], rows_out.shape[-1]))
            out.index_copy_(0, _cached_index(steps.cache, chosen, hidden.device), rows_out)
    chosen = [b for b, item in enumerate(steps.rows)
              if item is not None and b not in together and _restore_then_prompt(item, last)]
    if len(chosen) > 1:
        together.update(chosen)
        if out is None:
            out = hidden.new_zeros(hidden.shape)  # (the layer's output has the input's shape)
        _restore_then_prompt_rows(glue, module, hidden, chosen, [steps.rows[b] for b in chosen], steps.cache, out)
    for b, item in enumerate(steps.rows):
        if item is None or b in together:
            continue
        start, step, layers = item
        row_out = gdn_rows_forward(glue, module, hidden[b : b + 1, start:], layers(module.layer_idx), step)
        if out is None:
            out = row_out.new_zeros((hidden.shape[0], hidden.shape[1], row_out.shape[-1]))
        out[b, start:] = row_out[0]
    return out


def _decode_row_only(item, last: int) -> bool:
    """Whether a batch row's rows in a shared forward are one decode row continuing a live state (no deferred rows,
    no new plan's boundary)."""
    start, step, _ = item
    return start == last and step.num_restore == 0 and step.checkpoint_plan is None


def _live_rows_only(item, last: int) -> bool:
    """Whether a batch row's rows in a shared forward (at least one) all continue its live state: no deferred rows,
    no new plan's boundary."""
    start, step, _ = item
    return start <= last and step.num_restore == 0 and step.checkpoint_plan is None


def _checkpoint_inside(item, last: int) -> bool:
    """Whether a batch row's rows in a shared forward are live rows only with a new plan's boundary strictly inside
    them (rows on both sides)."""
    start, step, _ = item
    return (start <= last and step.num_restore == 0 and step.checkpoint_plan is not None
            and 0 < step.checkpoint_at < last + 1 - start)


def _restore_then_decode(item, last: int) -> bool:
    """Whether a batch row's rows in a shared forward are deferred rows of its pending plan followed by at most one
    decode row (no new plan's boundary): an eager fused decode step."""
    start, step, _ = item
    return (start <= last and step.num_restore > 0 and step.checkpoint_plan is None
            and last + 1 - start - step.num_restore in (0, 1))


def _restore_then_prompt(item, last: int) -> bool:
    """Whether a batch row's rows in a shared forward are deferred rows of its pending plan followed by a prompt (a
    next turn folding the rows still pending): at least two live rows without a new plan's boundary, or live rows
    with one strictly inside them."""
    start, step, _ = item
    live = last + 1 - start - step.num_restore
    if start > last or step.num_restore == 0 or live < 1:
        return False
    return live > 1 if step.checkpoint_plan is None else 0 < step.checkpoint_at < live


def _restore_then_prompt_rows(glue: GDNGlue, module, hidden: torch.Tensor, chosen: list[int], items: list,
                              cache: dict, out: torch.Tensor) -> None:
    """`gdn_rows_forward` for the batch rows `chosen` of a shared forward that restore deferred rows and then run a
    prompt (`_restore_then_prompt`), in the order `gdn_rows_forward` runs a row's pieces: every row's deferred rows
    at once (`gdn_restore_rows_forward`, each row's right-aligned in ``[n, most deferred rows]``, as rows that feed
    no decode row), then the prompts at once (`gdn_prefill_rows_forward`, and `gdn_checkpoint_rows_forward` for
    the rows whose prompt holds a new plan's boundary; the prompts are right-aligned in `hidden` already). Writes
    the rows' outputs into `out` ``[B, T, hidden]`` (contiguous)."""
    batch, total, _ = hidden.shape
    starts = [start for start, _, _ in items]
    counts = [step.num_restore for _, step, _ in items]
    layers = [get(module.layer_idx) for _, _, get in items]
    width = max(counts)
    key = ("restore_prompt", tuple(chosen), tuple(starts), tuple(counts), total, hidden.device)
    index = cache.get(key)
    if index is None:  # (host-built, one transfer, once per forward)
        gather, place, take = [], [], []
        for j, (b, start, n) in enumerate(zip(chosen, starts, counts)):
            gather += [b * total + start] * (width - n) + list(range(b * total + start, b * total + start + n))
            place += list(range(b * total + start, b * total + start + n))
            take += list(range(j * width + width - n, (j + 1) * width))
        moved = torch.tensor(gather + place + take, dtype=torch.long).to(hidden.device)
        index = cache[key] = moved.split([len(gather), len(place), len(take)])
    gather, place, take = index
    flat = hidden.reshape(batch * total, hidden.shape[-1])
    restore_steps = [GDNStep(step.restore_plan, step.num_restore, None, 0, step.track, step.backend)
                     for _, step, _ in items]
    restored = gdn_restore_rows_forward(glue, module, flat.index_select(0, gather).view(len(chosen), width, -1),
                                        [width - n for n in counts], layers, restore_steps, cache)
    # the prompts: positions from the earliest prompt start on (each row's own start after its deferred rows)
    low = min(start + n for start, n in zip(starts, counts))
    prompt_steps = [GDNStep(None, 0, step.checkpoint_plan, step.checkpoint_at, step.track, step.backend)
                    for _, step, _ in items]
    for boundary, fn in ((False, gdn_prefill_rows_forward), (True, gdn_checkpoint_rows_forward)):
        group = [j for j, step in enumerate(prompt_steps) if (step.checkpoint_plan is not None) == boundary]
        if not group:
            continue
        rows = _cached_index(cache, [chosen[j] for j in group], hidden.device)
        prompt_out = fn(glue, module, hidden[:, low:].index_select(0, rows),
                        [starts[j] + counts[j] - low for j in group], [layers[j] for j in group],
                        [prompt_steps[j] for j in group], cache)
        out[:, low:].index_copy_(0, rows, prompt_out)  # (zeros before each prompt: its deferred rows come next)
    out.view(batch * total, -1).index_copy_(0, place, restored.reshape(-1, restored.shape[-1]).index_select(0, take))


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


def _cached_index(cache: dict, rows, device) -> torch.Tensor:
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
            index = _cached_index(cache, members, q.device)
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
            core.index_copy_(0, _cached_index(cache, members, q.device), out)
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
        pick = (lambda t: t) if every else (lambda t: t.index_select(0, _cached_index(cache, members, t.device)))
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
            out2 = out1[:, -1:].index_copy(0, _cached_index(cache, members, out1.device), out2)
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


@dataclass
class GDNGraphStep:
    """The rows of a compiled static step, for every GDN layer (tensors and shapes only, see `gdn_rows_forward_graph`).

    Attributes:
        valid: bool ``[chunk]``: which of the leading chunk rows are real deferred rows (None: a plain decode step,
            one row).
        count: 0-d long tensor: how many are (the conv window after the chunk ends at the last real row).
        live: whether a decode row follows (False: the chunk alone, the unfused control).
        backend: ``"torch"`` or ``"fla"``.
    """

    valid: torch.Tensor | None
    count: torch.Tensor | None
    live: bool
    backend: str


def gdn_rows_forward_graph(glue: GDNGlue, module, hidden: torch.Tensor, layer: GDNLayerState, step: GDNGraphStep):
    """`gdn_rows_forward` for compiled static steps: fixed shapes, no host values, every update in place.

    Rows: ``chunk`` deferred rows (padding after the real ones: ``beta = 0`` and ``g = 0`` make a padding row the
    identity on the state, and the conv window after the chunk is taken at the last real row) then one decode row;
    or the decode row alone. The layer is in the fixed layout (``[S | P_tail]`` always). Kernels run through the
    ``hf_raincheck::gated_delta`` custom op (`ops.py`): one opaque node per call in the traced graph.
    """
    qkv, z, b, a = glue.project(module, hidden)
    outs = []
    if step.valid is not None:
        n = step.valid.shape[0]
        prefix = layer.prefix
        window = prefix.conv
        # channels last (`conv_tail`): [window | the chunk's rows] as [1, kernel + n, C]
        full = torch.cat([window.transpose(1, 2), qkv.transpose(1, 2)[:, :n]], dim=1)
        conv_out = glue.conv_tail(module, full, n)
        where = step.count + torch.arange(window.shape[-1], device=full.device)
        new_window = full.index_select(1, where).transpose(1, 2)
        q, k, v, g, beta = glue.factors(module, conv_out, a[:, :n], b[:, :n])
        # the kernels want contiguous rows (fla copies views, three eager copies per layer inside the opaque call);
        # made here, Inductor writes them in the kernel that computes them
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        valid = step.valid[None, :, None]
        g = torch.where(valid, g, torch.zeros_like(g))
        beta = torch.where(valid, beta, torch.zeros_like(beta))
        out, new_prefix = advance(step.backend, q, k, v, g, beta, prefix.recurrent, opaque=True)
        join_prefix_(layer.state, prefix.recurrent, new_prefix)  # S_live += P_tail (new - old); prefix <- new
        prefix.conv.copy_(new_window)
        outs.append(out)
    if step.live:
        full = torch.cat([layer.conv.transpose(1, 2), qkv.transpose(1, 2)[:, -1:]], dim=1)
        conv_out = glue.conv_tail(module, full, 1)
        layer.conv.copy_(full[:, 1:].transpose(1, 2))
        q, k, v, g, beta = glue.factors(module, conv_out, a[:, -1:], b[:, -1:])
        outs.append(advance_(step.backend, q, k, v, g, beta, layer.state, layer.carry))  # the state in place
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

    `live`, `valid` and `count` are set inside the traced graph (from the step's ``[4, B]`` index tensor)."""

    layers: dict
    backend: str
    live: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    count: torch.Tensor | None = None


def gdn_batch_forward_graph(glue: GDNGlue, module, hidden: torch.Tensor, buffers: dict, step: GDNBatchGraphStep):
    """`gdn_rows_forward_graph` for the B rows of a compiled static batch step, every row on its own states (rows
    of `buffers`, updated in place), in one kernel call per row block for all rows.

    `hidden` ``[B, chunk + 1, hidden]`` (row b: its deferred window, padding after its ``count[b]`` real rows, then
    its decode row) or ``[B, 1, hidden]`` (decode rows only). Per row, as `gdn_rows_forward` (docs/design.md rule
    3): the real deferred rows continue the row's prefix checkpoint (state and conv window; padding rows have
    ``g = beta = 0``, the identity, and the conv window is taken at the last real row), the live state is joined
    (``S_live += P_tail (S_prefix_new - S_prefix_old)``, only for rows that carried something), then the decode
    row continues the live ``[S | P_tail]`` (its transition multiplies into P_tail) and the live conv window. A row
    whose decode row is not live (it stopped) keeps its live state and conv window. `naive.naive_batch_graph_step`
    is the plain per-row reference."""
    qkv, z, b, a = glue.project(module, hidden)
    state, conv = buffers["state"], buffers["conv"]
    value_dim = buffers["prefix"].shape[-1]
    outs = []
    if step.valid is not None:
        n = step.valid.shape[1]
        prefix, prefix_conv = buffers["prefix"], buffers["prefix_conv"]
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
        out, new_prefix = advance(step.backend, q, k, v, g, beta, prefix, opaque=True)
        # a row that carried nothing ran identity rows only: its new prefix is its old one exactly and its join adds
        # P_tail 0 = 0 (the buffers hold finite values: zeros or states), so no row needs a select here
        join_prefix_(state, prefix, new_prefix)  # S_live += P_tail (new - old); prefix <- new, in the buffers
        prefix_conv.copy_(new_window)
        outs.append(out)
    live = step.live[:, None, None]
    full = torch.cat([conv.transpose(1, 2), qkv.transpose(1, 2)[:, -1:]], dim=1)  # [B, kernel + 1, C]
    conv_out = glue.conv_tail(module, full, 1)
    conv.copy_(torch.where(live, full[:, 1:].transpose(1, 2), conv))
    q, k, v, g, beta = glue.factors(module, conv_out, a[:, -1:], b[:, -1:])
    # a stopped row's decode position is the identity on its state (g = beta = 0), so the kernel's final state is
    # every row's new state: no select over the [B, H_v, K, V + K] states, which the kernel updates in place
    g = torch.where(live, g, torch.zeros_like(g))
    beta = torch.where(live, beta, torch.zeros_like(beta))
    outs.append(advance_(step.backend, q, k, v, g, beta, state, state.shape[-1] - value_dim))
    core = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return glue.output(module, core, z)
