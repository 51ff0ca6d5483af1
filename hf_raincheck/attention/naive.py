"""Plain reference attention for Raincheck's forwards: explicit scores, an explicit boolean mask, fp32 softmax."""

from __future__ import annotations

import torch


def naive_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None,
    scaling: float,
    causal_lower_right: bool = False,
) -> torch.Tensor:
    """Attention of ``query [B, Hq, q, D]`` over ``key/value [B, Hkv, k, D]`` where ``visible [B|1, 1, q, k]`` is True.

    Grouped-query heads are repeated. A row that sees nothing returns zeros. Returns ``[B, q, Hq, D]``.
    """
    if causal_lower_right:  # row r of q sees keys [0, k - q + r]
        q_len, k_len = query.shape[2], key.shape[2]
        visible = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)[None, None]
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.matmul(probs, value.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous()
