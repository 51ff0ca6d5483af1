"""Eager prefill calls of fla-core's chunked gated delta rule, replayed from CUDA graphs (`graphed_chunk`).

An eager prefill (a first forward: Full's, Hard's, Raincheck's) calls fla-core's chunked function once per GDN
layer. On the H200's host that call costs 0.8-1.4 ms of Python and Triton launches (seven kernels, each through fla's
and Triton's autotuner layers) for ~0.12 ms of GPU work at 1,250 rows, so the prefill of a pruned Qwen3.5 prompt
waits on the host. The call's inputs are five row tensors and a state, of the same shapes in every GDN layer of a
forward, so one CUDA graph serves them all: the rows are copied into static buffers of a bucket of rows (`BUCKET`;
the positions past the call's own rows are inert, ``g = beta = 0``: they leave the state as it is, and no real
row's output reads a later row), the graph replays fla's kernels, and the outputs are copied off its static
outputs. A graph is captured on the first call of its bucket (rows, head shapes, dtypes, device, stream) and kept
(the `MAX_GRAPHS` most recently used; `release` drops them all); a capture that fails (a chunked function of
another fla-core that syncs, say) warns once and leaves that bucket's calls to the function itself. A graph holds
its static buffers and fla's intermediates: about 80 KB per bucket row at Qwen3.5-9B's heads (by their sizes).

`kernels.gated_delta` takes this path for eager fla calls of `MIN_ROWS` to `MAX_ROWS` rows at batch 1 on CUDA when
its caller asks (`graphed=True`: `ops.advance` and `ops.advance_split`, never the compiled steps' custom ops, which
run inside graphs of their own).
"""

from __future__ import annotations

import collections
import threading
import warnings
from typing import Callable

import torch

from ..cuda_graphs import capture as capture_graph

#: rows per bucket: a call of T rows runs the graph of ``ceil(T / BUCKET) * BUCKET`` rows
BUCKET = 256
#: fewer rows (an eager fused step's chunk, a decode row) take fla's recurrent kernel from a state: one launch
MIN_ROWS = 65
#: more rows run fla's function as is: a forward of that many rows keeps the GPU busy while the host launches
#: (Full's prefill of a 4096-token image), and a graph would keep their memory
MAX_ROWS = 4096
#: graphs kept (the most recently used)
MAX_GRAPHS = 2

_GRAPHS: collections.OrderedDict = collections.OrderedDict()
_FAILED: set = set()  # keys whose capture failed: their calls run the function as is
_LOCK = threading.Lock()


def takes(rows: int, batch: int, device: torch.device) -> bool:
    """Whether `graphed_chunk` runs a call of `rows` rows at batch `batch` on `device`: not with autograd recording
    (the graph's outputs are copies without a history), not inside a capture or a trace."""
    return (batch == 1 and MIN_ROWS <= rows <= MAX_ROWS and device.type == "cuda" and not torch.is_grad_enabled()
            and not torch.cuda.is_current_stream_capturing() and not torch.compiler.is_compiling())


def release() -> None:
    """Drop every kept graph (and the GPU memory its static buffers and intermediates hold)."""
    with _LOCK:
        _GRAPHS.clear()
        _FAILED.clear()


class _Runner:
    """One bucket's static inputs (rows past the last call's inert), its state, and ``run`` (a CUDA graph's replay,
    or, with ``capture=False``, the call itself on the static buffers: tests without a GPU)."""

    def __init__(self, chunk: Callable, rows: int, q, k, v, g, beta, capture: bool):
        num_v_heads, key_dim, value_dim = v.shape[2], k.shape[3], v.shape[3]
        with torch.inference_mode(False):  # normal tensors: a later call outside inference mode writes them too
            self.rows = tuple(x.new_zeros(1, rows, *x.shape[2:]) for x in (q, k, v, g, beta))
            self.state = torch.zeros(1, num_v_heads, key_dim, value_dim, dtype=torch.float32, device=v.device)
        self.filled = 0  # rows the last call wrote (the rest of the bucket holds zeros)
        self.zero_state = True

        def call():
            sq, sk, sv, sg, sbeta = self.rows
            return chunk(sq, sk, sv, g=sg, beta=sbeta, initial_state=self.state, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)

        if not capture:
            self.run = call
            return
        # thread-local capture mode: a background completion thread's CUDA calls are not this capture's business
        graph, (out, final) = capture_graph(call, v.device, error_mode="thread_local")
        self.graph = graph
        self.run = lambda: (graph.replay(), (out, final))[1]

    def __call__(self, q, k, v, g, beta, state):
        t = q.shape[1]
        if t < self.filled:  # the last call's rows past this one's: inert again
            for x in self.rows[3:]:
                x[:, t : self.filled].zero_()
        self.filled = t
        dst = [x[:, :t] for x in self.rows]
        src = [q, k, v, g, beta]
        if state is not None:
            dst.append(self.state)
            src.append(state)
            self.zero_state = False
        elif not self.zero_state:
            self.state.zero_()
            self.zero_state = True
        torch._foreach_copy_(dst, src)
        out, final = self.run()
        # copies, not views: the next call's replay (another GDN layer, another thread on this stream) rewrites the
        # static outputs
        return out[:, :t].clone(), final.clone()


def graphed_chunk(chunk: Callable, q, k, v, g, beta, state, capture: bool = True):
    """``chunk(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)``
    (fla-core's chunked function, rows ``[1, T, ...]`` with `takes`) through its bucket's graph: returns ``(o [1, T,
    H_v, V], final state [1, H_v, K, V] float32)``, new tensors. `capture=False` runs `chunk` on the bucket's
    static buffers without a graph (tests of the padding on the CPU)."""
    rows = -(-q.shape[1] // BUCKET) * BUCKET
    stream = torch.cuda.current_stream(q.device).stream_id if capture else 0
    key = (chunk, rows, tuple(q.shape[2:]), tuple(v.shape[2:]), q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
           q.device, stream)
    with _LOCK:
        runner = _GRAPHS.get(key)
        if runner is None and key not in _FAILED:
            try:
                runner = _Runner(chunk, rows, q, k, v, g, beta, capture)
            except Exception as error:  # a chunked function that cannot be captured (another fla-core): run it as is
                _FAILED.add(key)
                warnings.warn(f"hf_raincheck: fla-core's chunked function could not be captured in a CUDA graph "
                              f"({type(error).__name__}: {error}); eager prefills call it directly", RuntimeWarning,
                              stacklevel=2)
            else:
                _GRAPHS[key] = runner
                while len(_GRAPHS) > MAX_GRAPHS:
                    _GRAPHS.popitem(last=False)
        if runner is None:
            return chunk(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)
        _GRAPHS.move_to_end(key)
        return runner(q, k, v, g, beta, state)
