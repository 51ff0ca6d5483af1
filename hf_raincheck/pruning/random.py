"""`random`: a seeded random subset of each span.

Options: ``seed`` (default None: ``RaincheckConfig.seed``).
"""

from __future__ import annotations

import torch

from .base import SelectionContext, check_int_or_none, register_selector


@register_selector("random", options={"seed": None}, checks={"seed": check_int_or_none("seed")})
def select_random(ctx: SelectionContext) -> torch.Tensor:
    seed = select_random.options.resolve(ctx.options)["seed"]
    generator = torch.Generator().manual_seed(int(ctx.seed if seed is None else seed))
    parts = []
    for (start, stop), budget in zip(ctx.spans, ctx.budgets):
        offsets = torch.randperm(stop - start, generator=generator)[:budget]
        parts.append(start + torch.sort(offsets).values)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
