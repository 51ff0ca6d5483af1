"""Which cache slots each row of a Raincheck forward may attend to (DESIGN.md, semantics rule 2)."""

from __future__ import annotations

import torch


def visibility_mask(
    filled: torch.Tensor,
    row_slots: torch.Tensor,
    deferred_rows: torch.Tensor | None,
    boundary: int,
    deferred_slots: torch.Tensor | None,
    mode: str,
    width: int,
) -> torch.Tensor:
    """Boolean ``[1, 1, q, width]`` mask for one forward.

    Args:
        filled: bool ``[>= width]`` slots that held an entry before this forward.
        row_slots: ``[q]`` logical index of each row (its slot).
        deferred_rows: bool ``[q]``: rows that restore deferred tokens of the plan being restored, or None.
        boundary: that plan's boundary.
        deferred_slots: bool ``[>= boundary]``: the plan's deferred slots.
        mode: ``"boundary"`` or ``"causal"``.
        width: key width (the slots the attention reads).

    A live row (prompt, tail, generated token) at logical index i sees every entry j <= i present after this
    forward's writes. A deferred row at d sees, under ``"boundary"``, every present entry before the boundary
    except deferred entries after d (its later chunk-mates); under ``"causal"`` it follows the live rule.
    """
    device = row_slots.device
    present = filled[:width].clone()
    present[row_slots] = True
    keys = torch.arange(width, device=device)
    rows = row_slots[:, None]
    visible = present[None, :] & (keys[None, :] <= rows)
    if deferred_rows is not None and mode == "boundary":
        later_deferred = torch.zeros(width, dtype=torch.bool, device=device)
        later_deferred[:boundary] = deferred_slots[:boundary]
        restoring = present[None, :] & (keys[None, :] < boundary) & ~(later_deferred[None, :] & (keys[None, :] > rows))
        visible = torch.where(deferred_rows[:, None], restoring, visible)
    return visible[None, None]
