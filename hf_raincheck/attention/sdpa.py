"""PyTorch SDPA for Raincheck's forwards, with the same boolean visibility mask as the naive reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import bias


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None,
    scaling: float,
    causal_lower_right: bool = False,
) -> torch.Tensor:
    """Same contract as `naive_attention`; returns ``[B, q, Hq, D]``."""
    enable_gqa = query.shape[1] != key.shape[1]
    if causal_lower_right:
        if query.shape[2] == 1:  # one row that sees every key: no mask at all
            mask = None
        else:
            mask = bias.causal_lower_right(query.shape[2], key.shape[2])
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=enable_gqa)
        return out.transpose(1, 2).contiguous()
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=visible, scale=scaling, enable_gqa=enable_gqa
    )
    return out.transpose(1, 2).contiguous()
