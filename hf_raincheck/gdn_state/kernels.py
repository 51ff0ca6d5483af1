"""Gated delta rule kernels behind one interface: transformers' torch path, or fla-core's Triton kernels.

``advance(...)`` runs rows from a state and, optionally, carries a transition map ``P`` along in the same call:
a gated delta rule run with ``v = 0`` from state ``P`` returns ``A_T ... A_1 P``, and the rule is linear in
``(v, S)`` column by column, so ``[S | P]`` with values ``[v | 0]`` gives the new state and the new map at once.
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
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    # the decorated names may resolve to fla when it is installed; __wrapped__ is transformers' torch code
    chunk = getattr(m.torch_chunk_gated_delta_rule, "__wrapped__", m.torch_chunk_gated_delta_rule)
    recurrent = getattr(m.torch_recurrent_gated_delta_rule, "__wrapped__", m.torch_recurrent_gated_delta_rule)
    return chunk, recurrent


def _fla_functions():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def gated_delta(backend: str, q, k, v, g, beta, state):
    """Rows ``[1, T, ...]`` from `state` (``None``: zeros). Returns ``(o [1, T, H_v, V], final state fp32)``.

    Single rows with a state use the recurrent kernel, everything else the chunked one, as transformers does.
    """
    chunk, recurrent = _fla_functions() if backend == "fla" else _torch_functions()
    fn = recurrent if (state is not None and q.shape[1] == 1) else chunk
    out, final = fn(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    return out, final.float()


def advance(backend: str, q, k, v, g, beta, state, transition=None):
    """`gated_delta`, also returning ``A_T ... A_1 transition`` when `transition` ``[1, H_v, K, K]`` is given.

    Returns ``(o, state, transition)`` (transition None when none was given).
    """
    if transition is None:
        out, final = gated_delta(backend, q, k, v, g, beta, state)
        return out, final, None
    dv = v.shape[-1]
    if state is None:
        state = torch.zeros(*transition.shape[:3], dv, dtype=torch.float32, device=v.device)
    stacked = torch.cat([state.float(), transition.float()], dim=-1)
    v_ext = torch.cat([v, v.new_zeros(*v.shape[:-1], transition.shape[-1])], dim=-1)
    out, final = gated_delta(backend, q, k, v_ext, g, beta, stacked)
    return out[..., :dv], final[..., :dv].contiguous(), final[..., dv:].contiguous()
