"""Gated delta rule kernels behind one interface (`gated_delta`): transformers' torch path, or fla-core's Triton
kernels. `ops.py` wraps the call as a custom op for compiled steps and holds `advance`, the call GDN layers make;
`naive.py` is the per-token reference both are tested against. `gated_delta_with_transition` runs rows from
``[state | I]`` in one launch of the one-chunk Triton kernel.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

import torch

from ..triton_support import interpreted, triton_importable
from . import graphed as _graphed

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


#: fla-core 0.6's recurrent forward kernel takes these arguments (`_fla_recurrent_kernel` checks them: another
#: signature falls back to fla's public function and a copy).
_FLA_RECURRENT_KERNEL_ARGS = (
    "q", "k", "v", "g", "gk", "gv", "beta", "A_log", "dt_bias", "o", "h0", "ht", "cu_seqlens", "scale", "T", "H",
    "HV", "K", "V", "BK", "BV", "USE_G", "USE_GK", "USE_GV", "USE_QK_L2NORM_IN_KERNEL", "IS_BETA_HEADWISE",
    "USE_INITIAL_STATE", "STORE_FINAL_STATE", "STATE_V_FIRST", "IS_VARLEN", "USE_GATE_IN_KERNEL", "HAS_DT_BIAS",
    "APPLY_BETA_SIGMOID", "ALLOW_NEG_EIGVAL",
)


@functools.lru_cache(maxsize=None)
def _fla_recurrent_kernel():
    """fla-core's recurrent forward Triton kernel when its signature is the one `gated_delta_` was written for,
    else None. The one place this package reaches inside fla-core (fla's public function allocates the final state,
    so a caller that keeps its state in a fixed buffer pays a copy of it per call)."""
    try:
        from fla.ops.gated_delta_rule import fused_recurrent as module
    except Exception:
        return None
    kernel = getattr(module, "fused_recurrent_gated_delta_rule_fwd_kernel", None)
    if tuple(getattr(kernel, "arg_names", ())) != _FLA_RECURRENT_KERNEL_ARGS:
        return None
    return kernel


def gated_delta_(backend: str, q, k, v, g, beta, state):
    """`gated_delta` of rows from `state` (``[B, H_v, K, V]`` float32, updated in place) by the recurrent kernel:
    returns the outputs ``[B, T, H_v, V]`` in v's dtype; `state` holds the final state.

    fla: its recurrent forward kernel with the state as both initial and final state (each kernel program loads its
    block of the state before the rows and stores it after them, so reading and writing one buffer is safe), which
    saves the allocation and the copy of a new final state: at a batch of 16 rows of the Qwen3.5-9B shape
    ``[S | P_tail]`` is 67 MB a GDN layer. Falls back to `gated_delta` and a copy for the torch kernels, a state that
    is not a contiguous float32 buffer, or an fla-core whose kernel has another signature.
    """
    kernel = _fla_recurrent_kernel() if backend == "fla" else None
    if kernel is None or not _kernel_state(state):
        out, final = gated_delta(backend, q, k, v, g, beta, state, recurrent_rows=q.shape[1])
        state.copy_(final)
        return out.to(v.dtype)
    return _launch_recurrent(kernel, q, k, v, g, beta, state, state)


def _kernel_state(state) -> bool:
    """A state fla's recurrent kernel reads and writes as ``[B, H_v, K, V]``: a contiguous float32 buffer."""
    return state is not None and state.dtype == torch.float32 and state.is_contiguous()


def _launch_recurrent(kernel, q, k, v, g, beta, initial: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """fla-core's recurrent forward kernel, launched as its own launcher does (fla 0.6), from state `initial` into
    `final` (the same buffer, or a new one); returns the outputs ``[B, T, H_v, V]`` in v's dtype."""
    import triton

    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    batch, rows, heads, key_dim = k.shape
    num_v_heads, value_dim = v.shape[2], v.shape[3]
    out = torch.empty_like(v)
    block_v = min(8, triton.next_power_of_2(value_dim))  # as fla's own launcher
    grid = (triton.cdiv(value_dim, block_v) * batch * num_v_heads,)
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        kernel[grid](q=q, k=k, v=v, g=g, gk=None, gv=None, beta=beta, A_log=None, dt_bias=None, o=out, h0=initial,
                     ht=final, cu_seqlens=None, scale=key_dim ** -0.5, T=rows, H=heads, HV=num_v_heads, K=key_dim,
                     V=value_dim, BK=triton.next_power_of_2(key_dim), BV=block_v, IS_BETA_HEADWISE=beta.ndim != v.ndim,
                     USE_QK_L2NORM_IN_KERNEL=True, APPLY_BETA_SIGMOID=False, ALLOW_NEG_EIGVAL=False,
                     STATE_V_FIRST=False, num_warps=1, num_stages=3)
    return out


# The one-chunk kernel (`chunk_triton`), decided at import as the package's other Triton kernels
# (``HF_RAINCHECK_TRITON=0`` keeps fla's chunked function)
_chunk_kernel = None
if os.environ.get("HF_RAINCHECK_TRITON", "1") != "0" and triton_importable():
    try:
        from . import chunk_triton as _chunk_kernel
    except Exception:  # a broken Triton install: fla's chunked function
        _chunk_kernel = None


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=256)  # (called per GDN layer and forward: the answer of a few ints, kept)
def one_chunk_block_columns(rows: int, batch: int, value_heads: int, value_dim: int, sm_count: int) -> int:
    """fla backend, `rows` from a state: the V columns per program with which `chunk_triton.chunk_gated_delta` takes
    the call instead of fla's chunked function, or 0 where fla's function takes it. The kernel takes 2 to
    `chunk_triton.CHUNK` rows at every batch size: `chunk_triton.BLOCK_V` (32) columns per program where its
    programs (one per batch row, value head and block of columns) fit one wave of the GPU's `sm_count` SMs (a fused
    step's window at batch 1 at Qwen3.5-9B's heads: 128 programs on an H200's 132 SMs), `chunk_triton.WIDE_BLOCK_V`
    (64) past one wave (batches: half the programs, each computing the rows' inverse once for twice the columns).
    On the H200, 63 rows: 15.7 us per call at B = 1, 18.8 / 27.7 / 53.5 / 104.7 at B = 2 / 4 / 8 / 16, against fla's
    37.4 / 47.0 / 60.5 / 94.4 / 163.6 (`chunk_triton`'s docstring). Only for a V that its column blocks divide (every
    Qwen3.5 has V = 128): the kernel's first GPU test run hit a CUDA illegal memory access at V = 48 (with 8 warps;
    not explained), so ragged column blocks stay with fla."""
    from .chunk_triton import CHUNK

    if not 2 <= rows <= CHUNK:
        return 0
    block = _one_wave_columns(batch, value_heads, value_dim, value_dim, sm_count)
    return block if value_dim % block == 0 else 0


def _one_wave_columns(batch: int, value_heads: int, value_dim: int, state_columns: int, sm_count: int) -> int:
    """Columns per program of `chunk_triton`'s kernel over `state_columns` state columns (V, or V + K from ``[S |
    I]``): `chunk_triton.BLOCK_V` where its programs (batch row x value head x block) fit one wave of `sm_count`
    SMs, `chunk_triton.WIDE_BLOCK_V` past it (each at most V rounded up to a power of two: `block_columns`)."""
    from .chunk_triton import BLOCK_V, WIDE_BLOCK_V, block_columns

    block = block_columns(value_dim, BLOCK_V)
    if batch * value_heads * -(-state_columns // block) > sm_count:
        return block_columns(value_dim, WIDE_BLOCK_V)
    return block


def lazy_window_(q, k, v, g, beta, prefix, pending, live, columns: int):
    """`chunk_triton.lazy_window_` with `columns` V columns per program (`one_chunk_columns`)."""
    return _chunk_kernel.lazy_window_(q, k, v, g, beta, prefix, pending, live, block_v=columns)


def one_chunk_columns(q, v, state) -> int:
    """V columns per program of the one-chunk kernel for these rows from `state`, or 0 where it does not run (no
    CUDA or Triton, a state that is not fp32, rows it does not take: `one_chunk_block_columns`)."""
    if _chunk_kernel is None or state is None or state.dtype != torch.float32 or q.device.type != "cuda":
        return 0
    return one_chunk_block_columns(q.shape[1], v.shape[0], v.shape[2], v.shape[3], _sm_count(q.device))


def tail_kernel_takes(backend: str, rows: int, key_dim: int, value_dim: int, device: torch.device) -> bool:
    """Whether `chunk_triton.chunk_gated_delta_with_transition` runs a Raincheck first prefill's `rows` after a new
    plan's boundary (`ops.advance_split`): fla backend on CUDA (or Triton's interpreter on the CPU: tests), 1 to
    `chunk_triton.CHUNK` rows, V and K whole column blocks (of `tail_block_columns` columns per program)."""
    if _chunk_kernel is None or not 1 <= rows <= _chunk_kernel.CHUNK:
        return False
    if not ((backend == "fla" and device.type == "cuda") or (device.type == "cpu" and interpreted())):
        return False
    block = _chunk_kernel.block_columns(value_dim)
    return value_dim % block == 0 and key_dim % block == 0


@functools.lru_cache(maxsize=64)
def tail_block_columns(batch: int, value_heads: int, key_dim: int, value_dim: int, sm_count: int) -> int:
    """Columns of ``[S | I]`` per program of `chunk_triton.chunk_gated_delta_with_transition` (where
    `tail_kernel_takes`): as a window's (`_one_wave_columns`), 32 within one wave of the SMs and 64 past it, and 32
    where 64 do not divide V and K. At Qwen3.5-9B's heads (V + K = 256 columns, 32 value heads) 32 columns make 256
    programs at batch 1, two waves of an H200's 132 SMs; 64 make one: a tail of 30 rows took 18.8 us per call
    against 25.8, bit for bit the same outputs (CHANGELOG)."""
    from .chunk_triton import BLOCK_V, block_columns

    block = _one_wave_columns(batch, value_heads, value_dim, value_dim + key_dim, sm_count)
    return block if not (value_dim % block or key_dim % block) else block_columns(value_dim, BLOCK_V)


def gated_delta_with_transition(q, k, v, g, beta, state):
    """Rows ``[B, T, ...]`` from ``[state | I]`` with values ``[v | 0]`` in one Triton launch (where
    `tail_kernel_takes`), with `tail_block_columns` columns per program on a GPU: ``(o [B, T, H_v, V], [S_T | P]
    [B, H_v, K, V + K] float32)``."""
    columns = 0
    if q.device.type == "cuda":
        columns = tail_block_columns(v.shape[0], v.shape[2], k.shape[3], v.shape[3], _sm_count(q.device))
    return _chunk_kernel.chunk_gated_delta_with_transition(q, k, v, g, beta, state, block_v=columns)


def split_graph_takes(backend: str, cut: int, tail: int, q) -> bool:
    """Whether `gated_delta_split` runs a first prefill's call with `cut` rows before a new boundary and a `tail`
    that `tail_kernel_takes` after it, in one CUDA graph (`graphed.takes_split`: fla on CUDA, batch 1)."""
    return backend == "fla" and _graphed.takes_split(cut, tail, q.shape[0], q.device)


def gated_delta_split(q, k, v, g, beta, state, cut: int):
    """Rows ``[1, T, ...]`` from `state` with a new boundary after row `cut` (where `split_graph_takes`): fla's
    chunked function on the rows before it and the one-chunk kernel from ``[S_b | I]`` on the tail, replayed from
    one CUDA graph (`graphed.graphed_split`). Returns ``(o, boundary, [S_T | P_tail])`` as `ops.advance_split`, or
    None where that graph could not be captured."""
    return _graphed.graphed_split(functions("fla")[0], gated_delta_with_transition, q, k, v, g, beta, state, cut)


def gated_delta(backend: str, q, k, v, g, beta, state, recurrent_rows: int | None = None, graphed: bool = False):
    """Rows ``[1, T, ...]`` from `state` (``None``: zeros). Returns ``(o [1, T, H_v, V], final state fp32)``.

    Single rows with a state use the recurrent kernel, everything else the chunked one, as transformers does (fla:
    up to `recurrent_rows` rows from a state take the recurrent one, default `FLA_RECURRENT_MAX_ROWS`; one chunk of
    rows from a state runs `chunk_triton`'s single kernel instead of fla's chunked function, with
    `one_chunk_block_columns` columns per program: a fused step's window). fla's recurrent kernel is launched here
    (`_launch_recurrent`, into a new final state) where the state is a contiguous float32 buffer: its public
    function's host work (autograd function, input checks) is what eager steps, host-bound on a GPU, pay per GDN
    layer and call. `graphed` (eager forwards): fla's chunked function through a CUDA graph of its bucket of rows
    where `graphed.takes` (`graphed.graphed_chunk`: its host time, not its GPU time, is what an eager prefill of a
    pruned prompt waits for).
    """
    chunk, recurrent = functions(backend)
    most = (FLA_RECURRENT_MAX_ROWS if recurrent_rows is None else recurrent_rows) if backend == "fla" else 1
    fn = recurrent if (state is not None and q.shape[1] <= most) else chunk
    columns = one_chunk_columns(q, v, state) if fn is chunk and backend == "fla" else 0
    if columns:
        return _chunk_kernel.chunk_gated_delta(q, k, v, g, beta, state, block_v=columns)
    if fn is chunk and backend == "fla" and graphed and _graphed.takes(q.shape[1], q.shape[0], q.device):
        return _graphed.graphed_chunk(chunk, q, k, v, g, beta, state)
    if fn is recurrent and backend == "fla" and _kernel_state(state):
        kernel = _fla_recurrent_kernel()
        if kernel is not None:  # fla's recurrent kernel without its public function's host work (eager steps)
            final = torch.empty_like(state)
            return _launch_recurrent(kernel, q, k, v, g, beta, state, final), final
    out, final = fn(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    return out, final.float()

