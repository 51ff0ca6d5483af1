"""`random`: a seeded random subset of each span (``RaincheckConfig.seed``)."""

from __future__ import annotations

import torch

from .base import SelectionContext, register_selector


@register_selector("random")
def select_random(ctx: SelectionContext) -> torch.Tensor:
    generator = torch.Generator().manual_seed(int(ctx.options.get("seed", ctx.seed)))
    parts = []
    for (start, stop), budget in zip(ctx.spans, ctx.budgets):
        offsets = torch.randperm(stop - start, generator=generator)[:budget]
        parts.append(start + torch.sort(offsets).values)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
