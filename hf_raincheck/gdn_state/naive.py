"""Plain per-token reference of the gated delta rule and of the state maps Raincheck builds on it.

Written straight from the recurrence (docs/design.md rule 3), loops and all; the fast paths in `kernels.py` and
the layer forwards (`layer.py`, `batch_rows.py`, `graph_layer.py`) are tested against it. Shapes follow
transformers / fla: ``q, k [B, T, H_k, K]``, ``v [B, T, H_v, V]``, ``g, beta [B, T, H_v]``, state ``[B, H_v, K,
V]``.

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


def naive_batch_graph_step(glue, module, hidden, rows: list[dict], count: list[int], live: list[bool],
                           chunk: int | None):
    """Reference of `layer.gdn_batch_forward_graph`: row after row, token by token (float64 state maps), only the
    real rows of each (no padding rows, no identity factors).

    `hidden` ``[B, T, hidden]`` (``T = chunk + 1``: row b's first ``count[b]`` positions are its deferred rows,
    the last its decode row; `chunk` None: ``T = 1``, decode rows only). `rows[b]`: row b's ``state``
    ``[1, H_v, K, V + K]`` (``[S | P_tail]``), ``conv``, ``prefix`` ``[1, H_v, K, V]``, ``prefix_conv`` (not
    modified). Row b: its deferred rows continue ``prefix`` / ``prefix_conv`` and the live state takes the join
    ``S += P_tail (S_prefix_new - S_prefix_old)``; then, if ``live[b]``, its decode row continues ``S``, the conv
    window, and ``P_tail <- A P_tail``. Returns ``(out [B, T, hidden]``, the new `rows`); a
    position that is no real row gets the output of a zero core (not compared)."""
    batch, total, _ = hidden.shape
    outs, new_rows = [], []
    for b in range(batch):
        qkv, z, gate_b, gate_a = glue.project(module, hidden[b : b + 1])
        row = {name: t.clone() for name, t in rows[b].items()}
        value_dim = row["prefix"].shape[-1]
        kernel = row["conv"].shape[-1]
        heads = row["state"].shape[1]
        core = torch.zeros(1, total, heads, value_dim, dtype=torch.float64)
        n = count[b] if chunk is not None else 0
        if n:
            full = torch.cat([row["prefix_conv"], qkv[..., :n]], dim=-1)
            conv_out = glue.conv_full(module, full)[:, -n:]
            q, k, v, g, beta = glue.factors(module, conv_out, gate_a[:, :n], gate_b[:, :n])
            out, prefix = naive_gated_delta(q, k, v, g, beta, row["prefix"])
            core[:, :n] = out
            live_state = naive_join(row["state"][..., :value_dim].double(), row["state"][..., value_dim:].double(),
                                    row["prefix"].double(), prefix)
            row["state"] = torch.cat([live_state, row["state"][..., value_dim:].double()], dim=-1)
            row["prefix"], row["prefix_conv"] = prefix, full[..., -kernel:]
        if live[b]:
            full = torch.cat([row["conv"], qkv[..., -1:]], dim=-1)
            conv_out = glue.conv_full(module, full)[:, -1:]
            q, k, v, g, beta = glue.factors(module, conv_out, gate_a[:, -1:], gate_b[:, -1:])
            out, live_state = naive_gated_delta(q, k, v, g, beta, row["state"][..., :value_dim])
            transition = naive_transition(k, g, beta, heads, row["state"][..., value_dim:])
            core[:, -1:] = out
            row["state"] = torch.cat([live_state, transition], dim=-1)
            row["conv"] = full[..., -kernel:]
        outs.append(glue.output(module, core.to(hidden.dtype), z))
        new_rows.append(row)
    return torch.cat(outs), new_rows
