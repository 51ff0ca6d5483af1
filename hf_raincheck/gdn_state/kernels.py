"""Gated delta rule kernels behind one interface (`gated_delta`): transformers' torch path, or fla-core's Triton
kernels. `ops.py` wraps the call as a custom op for compiled steps and holds `advance`, the call GDN layers make;
`naive.py` is the per-token reference both are tested against.
"""

from __future__ import annotations

import functools
import importlib

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


#: fla-core, compiled steps (calls through the custom op): rows from a state up to this many take the fused recurrent
#: kernel instead of the chunked one. 1, as transformers: inside CUDA graphs the chunked function's host time is
#: gone, and on a fused step's chunk the recurrent kernel (rows one after another) made the step's GPU time longer.
FLA_RECURRENT_MAX_ROWS = 1
#: fla-core, eager forwards: rows from a state up to this many take the recurrent kernel. Eager forwards are
#: host-bound on a GPU, and the chunked function's host time (several Triton launches and checks) is what a
#: Raincheck forward adds per GDN layer: the tail after a new plan's boundary in a prefill (a few dozen rows), the
#: chunk of an eager fused step. The recurrent kernel is one launch; its GPU time for such rows hides under the
#: host time saved.
FLA_EAGER_RECURRENT_MAX_ROWS = 64


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
