"""``hf_raincheck::gated_delta``: the kernel call of `kernels.gated_delta` as a ``torch.library`` custom op.

Compiled static steps (`generation.decode.StaticStep`) call the GDN kernels through this op, so dynamo keeps each
call as one opaque node and the kernel runs as it does eagerly. Traced into, transformers' torch kernels are Python
loops over rows and chunks, unrolled in every GDN layer (a compiled Qwen3.5-9B shape, 24 GDN layers, had not
finished compiling after 285 s on the H200), and fla-core's Triton launchers traced by dynamo did not finish
compiling either. Eager forwards call `kernels.gated_delta` directly. Importing this module needs no fla-core:
`kernels.functions` imports a backend's kernels on first use, outside any trace.
"""

import torch

from . import kernels


@torch.library.custom_op("hf_raincheck::gated_delta", mutates_args=())
def gated_delta_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.gated_delta` of `backend` (``"torch"`` or ``"fla"``): rows ``q, k [B, T, H_k, K]``, ``v [B, T, H_v,
    V]``, ``g, beta [B, T, H_v]`` from `state` ``[B, H_v, K, V]`` (None: zeros). Returns ``(o [B, T, H_v, V] in q's
    dtype, final state [B, H_v, K, V] float32)``, both new tensors."""
    out, final = kernels.gated_delta(backend, q, k, v, g, beta, state)
    # transformers' kernels return q's dtype, fla's chunked one v's; the same tensor dtype in every family here
    return out.to(q.dtype), final


@gated_delta_op.register_fake
def _(q, k, v, g, beta, state, backend):
    batch, _, heads, value_dim = v.shape
    return v.new_empty(v.shape, dtype=q.dtype), v.new_empty(batch, heads, k.shape[-1], value_dim, dtype=torch.float32)
