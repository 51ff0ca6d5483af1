"""The kernel calls of GDN layers: `advance`, eagerly or through ``hf_raincheck::gated_delta``, the call of
`kernels.gated_delta` as a ``torch.library`` custom op.

Compiled static steps (`generation.decode.StaticStep`) call the GDN kernels through the op, so dynamo keeps each
call as one opaque node and the kernel runs as it does eagerly. Traced into, transformers' torch kernels are Python
loops over rows and chunks, unrolled in every GDN layer (a compiled Qwen3.5-9B shape, 24 GDN layers, did not finish
compiling in minutes), and fla-core's Triton launchers traced by dynamo did not finish compiling either. Eager
forwards call `kernels.gated_delta` directly. Importing this module needs no fla-core: `kernels.functions` imports a
backend's kernels on first use, outside any trace.

``advance_(...)`` (the ``hf_raincheck::gated_delta_`` op, which mutates its state) is the decode rows' call in
compiled steps: the state buffer is updated in place by fla's recurrent kernel (`kernels.gated_delta_`), not
returned as a new tensor and copied back.

``join_(state, delta)`` (the ``hf_raincheck::join_`` op, which mutates its state) is the compiled steps' join where
Triton does not run (see `join_prefix_` below),
``S_live += P_tail delta`` on the ``[S | P_tail]`` buffer: one batched GEMM that accumulates into the buffer's
first V columns (`torch.baddbmm_` on the view: cuBLAS reads and writes the strided columns where they are). Traced as
``matmul`` and ``+=`` instead, Inductor writes the product to a new tensor, adds it to S in a second pass into
another new tensor and copies that into the buffer in a third (each a pass over the fp32 states). Eager joins
(`state.GDNLayerState.join`, the eager batch forwards) use the same ``baddbmm``, out of place.

``join_prefix_(state, old, new)`` is the unfused control's whole join (a compiled step of deferred rows alone):
``S_live += P_tail (new - old)``, then the checkpoint ``old <- new``. A compiled fused step (batch 1 or a static
batch) joins nothing: ``lazy_window_`` (the ``hf_raincheck::lazy_window_`` op) leaves the window's change pending
and corrects the decode row's output, and ``join_pending_`` folds the pending change in once, when the fused steps
end. Where Triton runs (CUDA; decided at import, as the attention's softmax kernel: ``HF_RAINCHECK_TRITON=0``
keeps torch) the join is one kernel (`join_triton`); elsewhere `join_` on the difference and a copy.

``advance(...)`` runs rows from a state and can carry a transition map ``P`` along in the same call: a gated
delta rule run with ``v = 0`` from state ``P`` returns ``A_T ... A_1 P``, and the rule acts on ``(v, S)`` column
by column, so a state ``[S | P]`` with values ``[v | 0]`` gives the new state and the new map at once.
``advance_split(...)`` runs a prompt with a new plan's boundary inside it (a Raincheck first prefill): the state at
the boundary, the state after every row and the tail's ``P``, in two calls (see its docstring).
"""

import os

import torch

from ..triton_support import interpreted, triton_importable
from . import kernels

# The fused join's Triton kernel, decided at import (compiled steps trace the call: an import or a cached probe
# inside it would break the graph)
_join_prefix_kernel = None
if os.environ.get("HF_RAINCHECK_TRITON", "1") != "0" and triton_importable():
    try:
        from .join_triton import join_prefix_ as _join_prefix_kernel
    except Exception:  # a broken Triton install: the torch join
        _join_prefix_kernel = None
_JOIN_KERNEL_ON_CPU = interpreted()  # Triton's interpreter (tests): the kernel runs on CPU tensors too


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


@torch.library.custom_op("hf_raincheck::gated_delta_", mutates_args=("state",))
def gated_delta_inplace_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    """`kernels.gated_delta_` of `backend`: rows from `state` ``[B, H_v, K, V]`` float32, which ends holding the final
    state (mutated in place). Returns ``o [B, T, H_v, V]`` in q's dtype, a new tensor."""
    return kernels.gated_delta_(backend, q, k, v, g, beta, state).to(q.dtype)


@gated_delta_inplace_op.register_fake
def _(q, k, v, g, beta, state, backend):
    return v.new_empty(v.shape, dtype=q.dtype)


@torch.library.custom_op("hf_raincheck::join_", mutates_args=("state",))
def join_inplace_op(state: torch.Tensor, delta: torch.Tensor) -> None:
    """``state[..., :V] += state[..., V:] @ delta`` on ``state [..., K, V + K]`` float32 (``[S | P_tail]``) and
    ``delta [..., K, V]`` float32 (``S_prefix_new - S_prefix_old``), in place."""
    key_dim, value_dim = delta.shape[-2], delta.shape[-1]
    if state.is_contiguous():
        rows = state.view(-1, key_dim, state.shape[-1])
        rows[..., :value_dim].baddbmm_(rows[..., value_dim:], delta.reshape(-1, key_dim, value_dim))
    else:  # a view of a larger buffer: the same product, through a temporary
        state[..., :value_dim] += torch.matmul(state[..., value_dim:], delta)


@join_inplace_op.register_fake
def _(state, delta):
    return None


def join_(state: torch.Tensor, delta: torch.Tensor) -> None:
    """``S_live += P_tail delta`` on the ``[S | P_tail]`` buffer `state` (``[..., K, V + K]`` float32) in place,
    through the ``hf_raincheck::join_`` custom op (one opaque node in a traced graph; see the module docstring)."""
    torch.ops.hf_raincheck.join_(state, delta)


def join_prefix_(state: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> None:
    """A fused step's join and checkpoint update, in place: ``state[..., :V] += state[..., V:] @ (new - old)`` on
    the ``[S | P_tail]`` buffer `state` ``[B, H_v, K, V + K]``, then ``old <- new`` (`old` / `new` ``[B, H_v, K, V]``,
    the prefix checkpoint before and after the step's deferred rows), all fp32."""
    device = state.device
    if _join_prefix_kernel is not None and (device.type == "cuda" or (device.type == "cpu" and _JOIN_KERNEL_ON_CPU)):
        _join_prefix_kernel(state, old, new)  # one Triton kernel: see `join_triton`
    else:
        join_(state, new - old)
        old.copy_(new)


@torch.library.custom_op("hf_raincheck::lazy_window_", mutates_args=("prefix", "pending"))
def lazy_window_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    prefix: torch.Tensor,
    pending: torch.Tensor,
    live: torch.Tensor,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A compiled fused step's window with its join left pending (see `lazy_window_`): returns ``(o [B, T, H_v, V],
    o_live [B, 1, H_v, V])`` in q's dtype; `prefix` and `pending` change in place."""
    columns = kernels.one_chunk_columns(q, v, prefix) if backend == "fla" else 0
    if columns and pending.is_contiguous() and prefix.is_contiguous():
        out, live_out = kernels.lazy_window_(q, k, v, g, beta, prefix, pending, live, columns)
        return out.to(q.dtype), live_out.to(q.dtype)
    out, new = kernels.gated_delta(backend, q, k, v, g, beta, prefix)
    pending.add_(new - prefix)
    prefix.copy_(new)
    value_dim = prefix.shape[-1]
    u = live[:, 0, :, value_dim:]  # [B, H_v, K]: P_tail^T q of the decode row
    live_out = live[:, 0, :, :value_dim] + torch.matmul(u.unsqueeze(-2), pending).squeeze(-2)
    return out.to(q.dtype), live_out[:, None].to(q.dtype)


@lazy_window_op.register_fake
def _(q, k, v, g, beta, prefix, pending, live, backend):
    return v.new_empty(v.shape, dtype=q.dtype), v.new_empty(v.shape[0], 1, *v.shape[2:], dtype=q.dtype)


def lazy_window_(backend: str, q, k, v, g, beta, prefix, pending, state, q1, k1, v1, g1, beta1):
    """A compiled fused step's GDN rows with the join left pending: the decode row first, on the live ``[S |
    P_tail]`` buffer `state` as it is (no join of this step's window), then the window from the checkpoint `prefix`
    (in place), whose change adds to `pending` (``[B, H_v, K, V]`` fp32: the checkpoint's change not yet joined),
    and the decode row's output takes ``pending^T P_tail^T q``. Returns ``(o [B, T, H_v, V], o_live [B, 1, H_v,
    V])``.

    The live state is ``S + P_tail pending`` throughout: the decode row advances S and P_tail by the same affine
    map, so the product stays right, and its output is ``(S + P_tail pending)^T q = o_S + pending^T (P_tail^T
    q)``, where ``P_tail^T q`` is the kernel's output over P_tail's columns (the decode row runs in fp32, so both
    are taken before any rounding). This saves each fused step the join's ``P_tail (new - old)``, a K x K by K x V
    product per value head (`join_triton`); `join_pending_` folds the sum in once, when the fused steps end. On a
    GPU the window and the decode row's correction are one launch (`chunk_triton.lazy_window_`)."""
    key_dim = k.shape[-1]
    v1 = torch.cat([v1, v1.new_zeros(*v1.shape[:-1], key_dim)], dim=-1)
    live = torch.ops.hf_raincheck.gated_delta_(q1.float(), k1.float(), v1.float(), g1, beta1, state, backend)
    return torch.ops.hf_raincheck.lazy_window_(q, k, v, g, beta, prefix, pending, live, backend)


def join_pending_(state: torch.Tensor, pending: torch.Tensor) -> None:
    """Folds a pending difference into the live state (``S += P_tail pending``) and clears it, in place (eager)."""
    join_(state, pending)
    pending.zero_()


_ZERO: dict = {}  # (device, dtype) -> a 0-d zero, expanded (no copy) into P's value columns by eager calls


def zero_like(t: torch.Tensor) -> torch.Tensor:
    """A 0-d zero of `t`'s dtype on its device: persistent in eager calls (no fill kernel per use: `torch.where`
    with a Python scalar builds and fills one each time), a new tensor inside a traced graph."""
    if torch.compiler.is_compiling():
        return t.new_zeros(())
    key = (t.device, t.dtype)
    zero = _ZERO.get(key)
    if zero is None:
        zero = _ZERO[key] = torch.zeros((), dtype=t.dtype, device=t.device)
    return zero


def _zero_columns(v: torch.Tensor, carry: int) -> torch.Tensor:
    """Zeros ``[..., carry]`` next to `v`'s rows: a persistent 0-d zero expanded in eager calls (no fill kernel per
    GDN layer and step: eager steps are host-bound), a new tensor inside a traced graph."""
    if torch.compiler.is_compiling():
        return v.new_zeros(*v.shape[:-1], carry)
    return zero_like(v).expand(*v.shape[:-1], carry)


def advance(backend: str, q, k, v, g, beta, state, carry: int = 0, opaque: bool = False):
    """`kernels.gated_delta` on a state whose last `carry` columns hold a transition map ``P`` (advanced with
    ``v = 0``).

    `state` ``[1, H_v, K, V + carry]`` (``None``: zeros, only with ``carry = 0``). Returns ``(o [1, T, H_v, V],
    final state [1, H_v, K, V + carry])``: the first V columns are the new state, the last `carry` are
    ``A_T ... A_1 P``. Keeping ``[S | P]`` in one buffer costs one kernel call per row block for both.

    `opaque`: call the kernels through the ``hf_raincheck::gated_delta`` custom op, one node in a traced graph
    (compiled steps, `gdn_rows_forward_graph`; `kernels.functions(backend)` must have run before tracing). Eager
    calls (not `opaque`) take fla's recurrent kernel up to `kernels.FLA_EAGER_RECURRENT_MAX_ROWS` rows from a state,
    and its chunked function through a CUDA graph of the rows' bucket (`graphed`) where that applies.
    """
    if carry:
        v = torch.cat([v, _zero_columns(v, carry)], dim=-1)
    if opaque:
        out, final = torch.ops.hf_raincheck.gated_delta(q, k, v, g, beta, state, backend)
    else:
        out, final = kernels.gated_delta(backend, q, k, v, g, beta, state, kernels.FLA_EAGER_RECURRENT_MAX_ROWS,
                                         graphed=True)
    return (out[..., : out.shape[-1] - carry] if carry else out), final


_IDENTITY: dict = {}  # (H_v, K, device) -> I [1, H_v, K, K] float32 (expanded), read only


def _identity(num_v_heads: int, key_dim: int, device) -> torch.Tensor:
    """The identity maps ``[1, H_v, K, K]`` float32: one persistent matrix, expanded (no build per GDN layer)."""
    key = (num_v_heads, key_dim, device)
    eye = _IDENTITY.get(key)
    if eye is None:
        eye = _IDENTITY[key] = torch.eye(key_dim, dtype=torch.float32, device=device).expand(1, num_v_heads, key_dim,
                                                                                              key_dim)
    return eye


def advance_split(backend: str, q, k, v, g, beta, state, cut: int):
    """Rows ``[1, T, ...]`` from `state` (``[1, H_v, K, V]`` float32, None: zeros) with a new plan's boundary after
    row `cut` (``0 < cut < T``): returns ``(o [1, T, H_v, V], boundary [1, H_v, K, V], live [1, H_v, K, V + K])``,
    the outputs, the state after the first `cut` rows (the plan's checkpoint) and ``[S_T | P_tail]`` (P_tail the
    product of the transitions of rows ``cut:``, latest on the left).

    Two calls: the rows before the boundary from `state` (Hard's call on fewer rows: through the CUDA graph of its
    bucket on a GPU, `graphed`), then the tail from ``[S_b | I]`` with values ``[v | 0]``. A tail of at most one
    chunk (the question after the image; `kernels.tail_kernel_takes`) runs in one launch of the one-chunk Triton
    kernel, which builds neither; a longer one goes through `advance` (its own bucket's graph). Eager forwards are
    host-bound on a GPU, so what a Raincheck first prefill adds per GDN layer over Hard's call is host time: where
    the rows before the boundary take a graph and the tail the kernel, both run from one graph
    (`kernels.gated_delta_split`), one replay as Hard's call is.
    """
    num_v_heads, key_dim, value_dim = v.shape[2], k.shape[-1], v.shape[-1]
    if state is not None:
        state = state.contiguous()
    short = kernels.tail_kernel_takes(backend, q.shape[1] - cut, key_dim, value_dim, q.device)
    if short and kernels.split_graph_takes(backend, cut, q.shape[1] - cut, q):
        split = kernels.gated_delta_split(q, k, v, g, beta, state, cut)  # both calls in one CUDA graph
        if split is not None:  # (None: the graph could not be captured; the two calls below)
            return split
    head, boundary = kernels.gated_delta(backend, *(x[:, :cut] for x in (q, k, v, g, beta)), state,
                                         kernels.FLA_EAGER_RECURRENT_MAX_ROWS, graphed=True)
    rows = [x[:, cut:] for x in (q, k, v, g, beta)]
    if short:
        tail, live = kernels.gated_delta_with_transition(*rows, boundary)
    else:
        start = torch.cat([boundary, _identity(num_v_heads, key_dim, q.device)], dim=-1)
        tail, live = advance(backend, *rows, start, carry=key_dim)
    return torch.cat([head, tail], dim=1), boundary, live


def advance_(backend: str, q, k, v, g, beta, state, carry: int = 0):
    """`advance` with `state` updated in place (``[B, H_v, K, V + carry]`` float32, a fixed buffer of a compiled
    step: its last `carry` columns the transition map): returns the outputs ``[B, T, H_v, V]``. Through the
    ``hf_raincheck::gated_delta_`` custom op (one node in a traced graph, as `advance` with `opaque`), which runs
    fla's recurrent kernel on the buffer itself (`kernels.gated_delta_`): no new final state, no copy back."""
    if carry:
        v = torch.cat([v, _zero_columns(v, carry)], dim=-1)
    out = torch.ops.hf_raincheck.gated_delta_(q, k, v, g, beta, state, backend)
    return out[..., : out.shape[-1] - carry] if carry else out
