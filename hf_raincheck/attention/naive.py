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


def naive_flash_kernel(q, k, v, used, scaling: float) -> torch.Tensor:
    """Reference of the flash kernel contract (`flash.py`): bottom-right causal attention of ``q [B, Q, Hq, D]`` over
    the first ``used[b]`` keys of ``k/v [B, N, Hkv, D]`` (``used`` int32 ``[B]``, None: all N): row r sees keys
    ``[0, used - Q + r]``. Returns ``[B, Q, Hq, D]``."""
    b, q_len, _, _ = q.shape
    n = k.shape[1]
    lengths = torch.full((b,), n, device=q.device) if used is None else used.to(torch.long)
    keys = torch.arange(n, device=q.device)[None, None, :]
    last = (lengths[:, None] - q_len + torch.arange(q_len, device=q.device)[None, :])[:, :, None]
    visible = (keys <= last) & (keys < lengths[:, None, None])  # [B, Q, N]
    return naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), visible[:, None], scaling)


def naive_masked_softmax(scores: torch.Tensor, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reference of the grouped path's masked softmax (`sdpa.grouped_softmax_torch`, `softmax_triton`), row by row
    in float64: ``scores [B, H, G, Q, K]``, ``visible`` broadcasting to ``[B, H, Q, K]`` (shared by the G query
    heads of a KV head) -> the softmax over each row's visible keys, 0 elsewhere and in a row that sees nothing,
    cast to `dtype`, ``[B, H, G * Q, K]``."""
    b, h, g, q, k = scores.shape
    seen = visible.expand(b, h, q, k).cpu()
    rows = scores.detach().cpu().double()
    out = torch.zeros(b, h, g, q, k, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for gi in range(g):
                for qi in range(q):
                    keys = seen[bi, hi, qi]
                    if keys.any():
                        x = rows[bi, hi, gi, qi][keys]
                        e = torch.exp(x - x.max())
                        out[bi, hi, gi, qi, keys] = e / e.sum()
    return out.to(device=scores.device, dtype=dtype).view(b, h, g * q, k)
