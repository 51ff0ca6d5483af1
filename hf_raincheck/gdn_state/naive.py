"""Plain per-token reference of the gated delta rule and of the state maps Raincheck builds on it.

Written straight from the recurrence (docs/design.md rule 3), loops and all; the fast paths in `kernels.py` and
`layer.py` are tested against it. Shapes follow transformers / fla: ``q, k [B, T, H_k, K]``,
``v [B, T, H_v, V]``, ``g, beta [B, T, H_v]``, state ``[B, H_v, K, V]``.

One token t, per value head (k, q l2-normalised, q scaled by K^-1/2):
    S <- A_t S + beta_t k_t v_t^T,    A_t = exp(g_t) (I - beta_t k_t k_t^T),    o_t = S^T q_t
"""

from __future__ import annotations

import torch


def _expand_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    return x.repeat_interleave(num_v_heads // x.shape[2], dim=2) if x.shape[2] != num_v_heads else x


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def normalized_factors(q, k, g, beta, num_v_heads: int, dtype=torch.float64):
    """q (scaled), k (unit), exp(g), beta per value head, in `dtype`: ``[B, T, H_v, K]`` / ``[B, T, H_v]``."""
    q = _l2norm(_expand_heads(q, num_v_heads).to(dtype))
    k = _l2norm(_expand_heads(k, num_v_heads).to(dtype))
    return q * q.shape[-1] ** -0.5, k, g.to(dtype).exp(), beta.to(dtype)


def naive_gated_delta(q, k, v, g, beta, state=None, dtype=torch.float64):
    """Outputs ``[B, T, H_v, V]`` and final state, token by token."""
    b, t, hv, dv = v.shape
    q, k, decay, beta = normalized_factors(q, k, g, beta, hv, dtype)
    v = v.to(dtype)
    s = torch.zeros(b, hv, k.shape[-1], dv, dtype=dtype) if state is None else state.to(dtype).clone()
    out = torch.zeros(b, t, hv, dv, dtype=dtype)
    for i in range(t):
        for h in range(hv):
            kk = k[:, i, h]  # [B, K]
            s[:, h] = decay[:, i, h, None, None] * s[:, h]
            s[:, h] = s[:, h] - beta[:, i, h, None, None] * kk[:, :, None] * (kk[:, None, :] @ s[:, h])
            s[:, h] = s[:, h] + beta[:, i, h, None, None] * kk[:, :, None] * v[:, i, h][:, None, :]
            out[:, i, h] = (q[:, i, h][:, None, :] @ s[:, h])[:, 0]
    return out, s


def naive_transition(k, g, beta, num_v_heads: int, transition=None, dtype=torch.float64):
    """``A_T ... A_1 P`` per value head (``P``: `transition` ``[B, H_v, K, K]``, identity if None)."""
    _, k, decay, beta = normalized_factors(k, k, g, beta, num_v_heads, dtype)
    b, t, hv, dk = k.shape
    eye = torch.eye(dk, dtype=dtype)
    p = eye.expand(b, hv, dk, dk).clone() if transition is None else transition.to(dtype).clone()
    for i in range(t):
        for h in range(hv):
            kk = k[:, i, h]
            a = decay[:, i, h, None, None] * (eye - beta[:, i, h, None, None] * kk[:, :, None] * kk[:, None, :])
            p[:, h] = a @ p[:, h]
    return p


def naive_join(live_state, transition, old_prefix, new_prefix):
    """The live state after the prefix state moved from `old_prefix` to `new_prefix` under fixed tail factors."""
    return live_state + transition @ (new_prefix - old_prefix)
