"""Which cache slots each row of a Raincheck forward may attend to (docs/design.md, semantics rule 2)."""

from __future__ import annotations

import torch


def visible(present, row_slots, deferred_rows, boundary, deferred_slots, mode: str) -> torch.Tensor:
    """Boolean ``[q, width]``: tensors only (no host values), so compiled steps trace it into one graph.

    Args:
        present: bool ``[width]`` slots that hold an entry after this forward's writes.
        row_slots: ``[q]`` logical index (slot) of each row.
        deferred_rows: bool ``[q]`` rows that restore the plan's deferred tokens, or None (no such rows).
        boundary: the plan's boundary (int or 0-d tensor).
        deferred_slots: bool ``[width]``: the plan's deferred slots (False from the boundary on).
        mode: ``"boundary"`` or ``"causal"``.

    A live row (prompt, tail, generated token) at logical index i sees every present entry j <= i. A deferred
    row at d sees, under ``"boundary"``, every present entry before the boundary except deferred entries after d
    (its later chunk-mates); under ``"causal"`` it follows the live rule.
    """
    keys = torch.arange(present.shape[0], device=present.device)[None, :]
    rows = row_slots[:, None]
    live = present[None, :] & (keys <= rows)
    if deferred_rows is None or mode != "boundary":
        return live
    restoring = present[None, :] & (keys < boundary) & ~(deferred_slots[None, :] & (keys > rows))
    return torch.where(deferred_rows[:, None], restoring, live)


def visible_rows(present, keys, row_slots, deferred_rows, boundary, deferred_slots, mode: str) -> torch.Tensor:
    """`visible` for every batch row of a shared forward at once: boolean ``[B, q, width]``.

    `present` bool ``[B, width]``, `keys` ``arange(width)``, `row_slots` ``[B, q]``, `deferred_rows` bool ``[B, q]``
    or None, `boundary` ``[B]`` and `deferred_slots` bool ``[B, >= width]`` (each row's own plan; read only when
    `deferred_rows` is given and the mode is ``"boundary"``)."""
    rows = row_slots[:, :, None]
    seen = present[:, None, :] & (keys <= rows)
    if deferred_rows is None or mode != "boundary":
        return seen
    width = present.shape[1]
    restoring = present[:, None, :] & (keys < boundary[:, None, None]) \
        & ~(deferred_slots[:, None, :width] & (keys > rows))
    return torch.where(deferred_rows[:, :, None], restoring, seen)


def visibility_mask(
    filled: torch.Tensor,
    row_slots: torch.Tensor,
    deferred_rows: torch.Tensor | None,
    boundary: int,
    deferred_slots: torch.Tensor | None,
    mode: str,
    width: int,
) -> torch.Tensor:
    """Boolean ``[1, 1, q, width]`` mask for one forward (see `visible`).

    `filled` is bool ``[>= width]`` (slots that held an entry before this forward); `deferred_slots` bool
    ``[>= boundary]`` (the plan's deferred slots, read up to the boundary).
    """
    present = filled[:width].clone().index_fill_(0, row_slots, True)  # (a scalar fill: no host-to-device copy)
    slots_mask = None
    if deferred_rows is not None and mode == "boundary":
        slots_mask = torch.nn.functional.pad(deferred_slots[:boundary], (0, width - boundary))
    return visible(present, row_slots, deferred_rows, boundary, slots_mask, mode)[None, None]
