"""One Gated DeltaNet layer over a forward shared by a batch's rows (`hf_raincheck.generation.shared_rows`): each
batch row on its own states, as `layer.gdn_rows_forward` runs it alone (docs/design.md rule 3).

`gdn_shared_forward` sorts the batch rows by what their rows do in this forward (one decode row; live rows only;
live rows with a new plan's boundary inside; deferred rows then at most one decode row; deferred rows then a
prompt) and runs each kind's rows together through `batch_rows` (one call of each piece for all of them); a kind
with a single row, and the rare shapes no batched piece takes, run one by one through `gdn_rows_forward`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .batch_rows import (
    cached_index,
    gdn_checkpoint_rows_forward,
    gdn_decode_rows_forward,
    gdn_prefill_rows_forward,
    gdn_restore_rows_forward,
)
from .layer import GDNGlue, GDNStep, gdn_rows_forward


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
        rows = hidden if every else hidden.index_select(0, cached_index(steps.cache, chosen, hidden.device))
        rows_out = fn(glue, module, rows, [start for start, _, _ in items],
                      [layers(module.layer_idx) for _, _, layers in items], [step for _, step, _ in items], steps.cache)
        if every and out is None:
            out = rows_out
        else:
            if out is None:
                out = rows_out.new_zeros((hidden.shape[0], hidden.shape[1], rows_out.shape[-1]))
            out.index_copy_(0, cached_index(steps.cache, chosen, hidden.device), rows_out)
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
        rows = cached_index(cache, [chosen[j] for j in group], hidden.device)
        prompt_out = fn(glue, module, hidden[:, low:].index_select(0, rows),
                        [starts[j] + counts[j] - low for j in group], [layers[j] for j in group],
                        [prompt_steps[j] for j in group], cache)
        out[:, low:].index_copy_(0, rows, prompt_out)  # (zeros before each prompt: its deferred rows come next)
    out.view(batch * total, -1).index_copy_(0, place, restored.reshape(-1, restored.shape[-1]).index_select(0, take))
