"""Gated delta rule kernels behind one interface: transformers' torch path, or fla-core's Triton kernels.

``advance(...)`` runs rows from a state and can carry a transition map ``P`` along in the same call: a gated
delta rule run with ``v = 0`` from state ``P`` returns ``A_T ... A_1 P``, and the rule acts on ``(v, S)`` column
by column, so a state ``[S | P]`` with values ``[v | 0]`` gives the new state and the new map at once.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

BACKENDS = ("auto", "torch", "fla")


@functools.lru_cache(maxsize=None)
def fla_available() -> bool:
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception:  # ImportError, or triton/CUDA errors at import
        return False
    return True


def resolve(name: str, device: torch.device) -> str:
    """``auto`` -> ``fla`` on CUDA when fla-core imports, else ``torch``."""
    if name not in BACKENDS:
        raise ValueError(f"gdn backend must be one of {list(BACKENDS)}, got {name!r}")
    if name == "auto":
        return "fla" if device.type == "cuda" and fla_available() else "torch"
    if name == "fla" and not fla_available():
        raise ValueError("gdn backend 'fla' needs fla-core (pip install 'hf_raincheck[gpu]') and a CUDA device")
    return name


def _torch_functions():
    from ..transformers_coupling import torch_gated_delta_rule_functions

    return torch_gated_delta_rule_functions()


def _fla_functions():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


_FUNCTIONS: dict[str, tuple] = {}


def functions(backend: str) -> tuple:
    """``(chunk, recurrent)`` of `backend`, imported once. Compiled steps call this eagerly before tracing
    (`StaticStep`): dynamo in torch 2.11 breaks the graph on an import of transformers' lazy modules ("Bad import
    result"), and a traced step then only reads this dict."""
    fns = _FUNCTIONS.get(backend)
    if fns is None:
        fns = _FUNCTIONS[backend] = _fla_functions() if backend == "fla" else _torch_functions()
    return fns


# fla-core only: rows from a state up to this many take the fused recurrent kernel instead of the chunked one. In the
# H200 profile of an eager Qwen3.5-9B fused step (32 rows), fla's chunked function cost 1.76 ms of host time per
# layer call against 0.31 ms for the recurrent one on a decode row (GPU time is small for both). Default 1 (as
# transformers): compiled (CUDA graphs, no host time per call), HF_RAINCHECK_FLA_RECURRENT_ROWS=64 made a fused step's
# GPU time longer on the H200 (8.15 vs 7.81 ms: the recurrent kernel takes 24 us per layer on 32 rows; README).
FLA_RECURRENT_MAX_ROWS = int(os.environ.get("HF_RAINCHECK_FLA_RECURRENT_ROWS", "1"))
# fla-core, eager forwards: rows from a state up to this many take the recurrent kernel. Eager forwards are
# host-bound on a GPU, and the chunked function's host time (~1.05-1.76 ms per call on the H200, several Triton
# launches and checks) is what a Raincheck forward adds per GDN layer: the tail after a new plan's boundary in a
# prefill (~40 rows), the chunk of an eager fused step. The recurrent kernel is one launch (~0.3 ms of host); its
# GPU time (~24 us for 32 rows) hides under that.
FLA_EAGER_RECURRENT_MAX_ROWS = int(os.environ.get("HF_RAINCHECK_FLA_EAGER_RECURRENT_ROWS", "64"))


def _restore_kernel_setting() -> bool:
    value = os.environ.get("HF_RAINCHECK_GDN_RESTORE_KERNEL", "")
    if value not in ("", "triton"):
        raise ValueError(f"HF_RAINCHECK_GDN_RESTORE_KERNEL must be 'triton' (the fused restoration kernel) or unset, "
                         f"got {value!r}")
    return value == "triton"


#: compiled fused steps restore their chunk and join P_tail in one Triton kernel (`restore_triton`): opt-in
#: (``HF_RAINCHECK_GDN_RESTORE_KERNEL=triton``); on the H200 it was slower than fla's kernels (1.27 vs 0.84 ms a step)
RESTORE_KERNEL = _restore_kernel_setting()


def restore_kernel_runs(device: torch.device, key_dim: int, value_dim: int) -> bool:
    """Whether compiled fused steps on `device` take the fused restoration kernel (`RESTORE_KERNEL` on, Triton runs
    there: CUDA, or the CPU under Triton's interpreter, and the head sizes fit); imports it (registering its op)
    when they do. Decided outside the traced step."""
    if not RESTORE_KERNEL:
        return False
    from ..pruning.triton_support import triton_enabled

    if not triton_enabled(device):
        return False
    from . import restore_triton

    return restore_triton.supported(key_dim, value_dim)


def gated_delta(backend: str, q, k, v, g, beta, state, recurrent_rows: int | None = None):
    """Rows ``[1, T, ...]`` from `state` (``None``: zeros). Returns ``(o [1, T, H_v, V], final state fp32)``.

    Single rows with a state use the recurrent kernel, everything else the chunked one, as transformers does (fla:
    up to `recurrent_rows` rows from a state take the recurrent one; default `FLA_RECURRENT_MAX_ROWS`).
    """
    chunk, recurrent = functions(backend)
    most = (FLA_RECURRENT_MAX_ROWS if recurrent_rows is None else recurrent_rows) if backend == "fla" else 1
    fn = recurrent if (state is not None and q.shape[1] <= most) else chunk
    out, final = fn(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    return out, final.float()


def advance(backend: str, q, k, v, g, beta, state, carry: int = 0, opaque: bool = False):
    """`gated_delta` on a state whose last `carry` columns hold a transition map ``P`` (advanced with ``v = 0``).

    `state` ``[1, H_v, K, V + carry]`` (``None``: zeros, only with ``carry = 0``). Returns ``(o [1, T, H_v, V],
    final state [1, H_v, K, V + carry])``: the first V columns are the new state, the last `carry` are
    ``A_T ... A_1 P``. Keeping ``[S | P]`` in one buffer costs one kernel call per row block for both.

    `opaque`: call the kernels through the ``hf_raincheck::gated_delta`` custom op (`ops.py`), one node in a traced
    graph (compiled steps, `gdn_rows_forward_graph`; `functions(backend)` must have run before tracing). Eager
    calls (not `opaque`) take fla's recurrent kernel up to `FLA_EAGER_RECURRENT_MAX_ROWS` rows from a state.
    """
    if carry:
        v = torch.cat([v, v.new_zeros(*v.shape[:-1], carry)], dim=-1)
    if opaque:
        out, final = torch.ops.hf_raincheck.gated_delta(q, k, v, g, beta, state, backend)
    else:
        out, final = gated_delta(backend, q, k, v, g, beta, state, FLA_EAGER_RECURRENT_MAX_ROWS)
    return (out[..., : out.shape[-1] - carry] if carry else out), final


# registers hf_raincheck::gated_delta (ops.py calls `gated_delta` above, through this module)
from . import ops as _ops  # noqa: E402,F401
