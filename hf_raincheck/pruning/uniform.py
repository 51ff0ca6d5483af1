"""`uniform`: evenly spaced tokens in each span (cheap, content-blind baseline). No options."""

from __future__ import annotations

import torch

from .base import SelectionContext, register_selector


def uniform_offsets(num_tokens: int, budget: int) -> torch.Tensor:
    """``budget`` offsets in ``[0, num_tokens)`` spread evenly: the centre of each of ``budget`` equal bins."""
    k = torch.arange(budget, dtype=torch.float64)
    return torch.floor((k + 0.5) * num_tokens / budget).long() if budget else k.long()


@register_selector("uniform")
def select_uniform(ctx: SelectionContext) -> torch.Tensor:
    select_uniform.options.resolve(ctx.options)
    parts = [start + uniform_offsets(stop - start, budget) for (start, stop), budget in zip(ctx.spans, ctx.budgets)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
