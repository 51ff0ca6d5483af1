"""Independent reference of Raincheck's semantics for hybrid Qwen3.5 models (Gated DeltaNet + attention).

Does NOT import ``hf_raincheck``. Builds on ``reference_qwen3_vl`` (schedules, masks, logical inputs) and
adds docs/design.md rule 3 for the GDN layers, computed the slow, literal way:

* every row's short-conv input window and recurrence are simulated token by token (float64), in the
  processing order of the forwards;
* a deferred row of plan P continues P's prefix state: the GDN state and conv window right before P's
  boundary in the live order (the checkpoint), advanced by P's deferred rows restored earlier;
* after the deferred rows of a forward, the live state is RECOMPUTED: start from P's new prefix state and
  replay every live row processed after P's boundary so far with its recorded factors (k, v, g, beta as
  computed when that row was processed). No transition maps, no joins: that is the package's shortcut,
  this is the definition it must equal;
* every other row continues the live state.

Attention layers use ``reference_qwen3_vl.build_mask`` over all rows at once (sweep layer by layer: a
row's layer-l input depends only on rows processed no later than it, all available in the sweep).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from reference_qwen3_vl import (  # noqa: F401  (re-exported for tests)
    ReferenceLogits,
    _check_forwards,
    _normalize_plans,
    build_mask,
    build_schedule,
    encode_conversation,
    find_spans,
    plan_boundary,
)

F64 = torch.float64


@dataclass
class _Plan:
    deferred: set
    boundary: int
    prefix_state: torch.Tensor | None = None  # [Hv, K, V]
    prefix_window: torch.Tensor | None = None  # [k-1, C]
    tail: list = field(default_factory=list)  # recorded (k, v, decay, beta) of live rows after the boundary


def _l2(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class _GDNRows:
    """Per-row quantities of one GDN layer that do not depend on the state."""

    def __init__(self, module, h):  # h [N, hidden]
        self.m = module
        self.qkv = module.in_proj_qkv(h).to(F64)  # [N, C] pre-conv
        self.z = module.in_proj_z(h)  # [N, Hv*V]
        self.beta = module.in_proj_b(h).to(F64).sigmoid()  # [N, Hv]
        a = module.in_proj_a(h).to(F64)
        self.decay = (-module.A_log.to(F64).exp() * F.softplus(a + module.dt_bias.to(F64))).exp()  # [N, Hv]
        self.w = module.conv1d.weight.to(F64)[:, 0]  # [C, k]
        self.k = module.conv_kernel_size

    def conv(self, window, r):
        """silu(causal conv) of row r given the previous k-1 pre-conv rows `window` [k-1, C]."""
        full = torch.cat([window, self.qkv[r][None]], dim=0)  # [k, C]
        out = (full.T * self.w).sum(-1)
        if self.m.conv1d.bias is not None:
            out = out + self.m.conv1d.bias.to(F64)
        return F.silu(out), full[1:]

    def factors(self, conv_out, r):
        m = self.m
        q, k, v = torch.split(conv_out, [m.key_dim, m.key_dim, m.value_dim])
        hv = m.num_v_heads
        rep = hv // m.num_k_heads
        q = _l2(q.view(m.num_k_heads, m.head_k_dim)).repeat_interleave(rep, 0) * m.head_k_dim ** -0.5
        k = _l2(k.view(m.num_k_heads, m.head_k_dim)).repeat_interleave(rep, 0)
        v = v.view(hv, m.head_v_dim)
        return q, (k, v, self.decay[r], self.beta[r])


def _step(state, factors):
    k, v, decay, beta = factors  # [Hv, K], [Hv, V], [Hv], [Hv]
    state = decay[:, None, None] * state
    kv = torch.einsum("hk,hkv->hv", k, state)
    return state + beta[:, None, None] * k[:, :, None] * (v - kv)[:, None, :]


def _gdn_layer(module, h, rows, forwards, plans):
    """Output [N, hidden] of one GDN layer for rows in processing order."""
    m = module
    g = _GDNRows(m, h)
    hv, kd, vd = m.num_v_heads, m.head_k_dim, m.head_v_dim
    live_state = torch.zeros(hv, kd, vd, dtype=F64)
    live_window = torch.zeros(g.k - 1, g.qkv.shape[1], dtype=F64)
    out = torch.zeros(len(rows), hv, vd, dtype=F64)
    plan_of = {}
    for p in plans:
        for d in p.deferred:
            plan_of[d] = p
    pos = 0
    for fwd in forwards:
        restored_plan = None
        for r_idx in fwd:
            row = pos
            pos += 1
            p = plan_of.get(r_idx)
            if p is not None:  # a deferred row: continue the plan's prefix
                if p.prefix_state is None:
                    raise AssertionError("deferred row before its plan's boundary was reached")
                c, p.prefix_window = g.conv(p.prefix_window, row)
                q, f = g.factors(c, row)
                p.prefix_state = _step(p.prefix_state, f)
                out[row] = torch.einsum("hk,hkv->hv", q, p.prefix_state)
                restored_plan = p
                continue
            if restored_plan is not None:  # the live state after this forward's deferred rows: recompute
                live_state = restored_plan.prefix_state.clone()
                for f in restored_plan.tail:
                    live_state = _step(live_state, f)
                restored_plan = None
            for q_plan in plans:
                if q_plan.prefix_state is None and r_idx >= q_plan.boundary:
                    q_plan.prefix_state, q_plan.prefix_window = live_state.clone(), live_window.clone()
            c, live_window = g.conv(live_window, row)
            q, f = g.factors(c, row)
            for q_plan in plans:
                if r_idx >= q_plan.boundary:
                    q_plan.tail.append(f)
            live_state = _step(live_state, f)
            out[row] = torch.einsum("hk,hkv->hv", q, live_state)
        if restored_plan is not None:  # a forward of deferred rows only
            live_state = restored_plan.prefix_state.clone()
            for f in restored_plan.tail:
                live_state = _step(live_state, f)
    core = out.to(h.dtype).reshape(-1, vd)
    core = m.norm(core, g.z.reshape(-1, vd))
    return m.out_proj(core.reshape(len(rows), -1))


@torch.no_grad()
def run_reference(model, conv, forwards, plans=(), visibility: str = "boundary") -> ReferenceLogits:
    """Layer-by-layer sweep over all processed rows (GDN layers simulated, attention layers masked)."""
    rows = _check_forwards(forwards)
    text = model.model.language_model
    device = conv.embeds.device
    idx = torch.tensor(rows, dtype=torch.long, device=device)
    x = conv.embeds[idx][None]
    positions = conv.positions[:, idx][:, None, :]
    pos_emb = text.rotary_emb(x, positions)
    mask = build_mask(forwards, plans, visibility, dtype=x.dtype, device=device)
    plan_objs = [_Plan(deferred=d, boundary=b) for d, b in _normalize_plans(plans)]
    for i, layer in enumerate(text.layers):
        h = layer.input_layernorm(x)
        if text.config.layer_types[i] == "linear_attention":
            for p in plan_objs:  # fresh per layer
                p.prefix_state = p.prefix_window = None
                p.tail = []
            a = _gdn_layer(layer.linear_attn, h[0], rows, forwards, plan_objs)[None]
        else:
            a, _ = layer.self_attn(hidden_states=h, attention_mask=mask, position_embeddings=pos_emb)
        x = x + a
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    hidden = text.norm(x)[0]
    logits = model.lm_head(hidden).float()
    return ReferenceLogits(logits=logits, rows=rows, row_of={r: k for k, r in enumerate(rows)}, hidden=hidden)


def reference_logits(model, conv_inputs, forwards, plans=(), visibility: str = "boundary") -> ReferenceLogits:
    return run_reference(model, encode_conversation(model, conv_inputs), forwards, plans, visibility)
