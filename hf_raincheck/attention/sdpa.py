"""PyTorch SDPA for Raincheck's forwards, with the same boolean visibility mask as the naive reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Same contract as `naive_attention`; returns ``[B, q, Hq, D]``."""
    enable_gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=visible, scale=scaling, enable_gqa=enable_gqa
    )
    return out.transpose(1, 2).contiguous()
