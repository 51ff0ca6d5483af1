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
run inside graphs of their own). `graphed_split` (`kernels.gated_delta_split`, from `ops.advance_split`) puts a
Raincheck first prefill's two calls, the rows before a new boundary and the short tail after it in the one-chunk
kernel, in one graph.
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
#: graphs kept (the most recently used): a forward needs one (two for a Raincheck prompt with a tail longer than
#: `TAIL_ROWS`), and a background completion's chunks one more
MAX_GRAPHS = 3

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


#: tail rows of a split call (`graphed_split`): one chunk of the one-chunk kernel (`chunk_triton.CHUNK`)
TAIL_ROWS = 64


def takes_split(cut: int, tail: int, batch: int, device: torch.device) -> bool:
    """Whether `graphed_split` runs a call with `cut` rows before a boundary and `tail` after it: the rows before it
    as `takes`, 1 to `TAIL_ROWS` after it."""
    return 1 <= tail <= TAIL_ROWS and takes(cut, batch, device)


def _static_rows(rows: int, q, k, v, g, beta) -> tuple:
    with torch.inference_mode(False):  # normal tensors: a later call outside inference mode writes them too
        return tuple(x.new_zeros(1, rows, *x.shape[2:]) for x in (q, k, v, g, beta))


def _stale(static: tuple, t: int, filled: int) -> None:
    """Re-zero g and beta of the rows of `static` the last call filled past t (inert again)."""
    if t < filled:
        for x in static[3:]:
            x[:, t:filled].zero_()


class _Runner:
    """One bucket's static inputs (rows past the last call's inert), its state, and ``run`` (a CUDA graph's replay,
    or, with ``capture=False``, the call itself on the static buffers: tests without a GPU). With a `tail` function
    (`graphed_split`), `TAIL_ROWS` more static rows that `tail` runs from the bucket's final state."""

    def __init__(self, chunk: Callable, rows: int, q, k, v, g, beta, capture: bool, tail: Callable | None = None):
        num_v_heads, key_dim, value_dim = v.shape[2], k.shape[3], v.shape[3]
        self.rows = _static_rows(rows, q, k, v, g, beta)
        self.tail_rows = None if tail is None else _static_rows(TAIL_ROWS, q, k, v, g, beta)
        with torch.inference_mode(False):
            self.state = torch.zeros(1, num_v_heads, key_dim, value_dim, dtype=torch.float32, device=v.device)
        self.filled = self.tail_filled = 0  # rows the last call wrote (the rest hold zeros)
        self.zero_state = True
        self._views, self._views_key = [], None  # `_destinations` of the last call's shape

        def call():
            sq, sk, sv, sg, sbeta = self.rows
            out, final = chunk(sq, sk, sv, g=sg, beta=sbeta, initial_state=self.state, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
            if tail is None:
                return out, final
            return (out, final) + tuple(tail(*self.tail_rows, final.float()))

        if not capture:
            self.run = call
            return
        # thread-local capture mode: a background completion thread's CUDA calls are not this capture's business
        graph, outputs = capture_graph(call, v.device, error_mode="thread_local")
        self.graph = graph
        self.run = lambda: (graph.replay(), outputs)[1]

    def __call__(self, q, k, v, g, beta, state, cut: int | None = None):
        rows = (q, k, v, g, beta)
        t = q.shape[1] if cut is None else cut
        tail = 0 if cut is None else q.shape[1] - cut
        if cut is None:
            src = list(rows)
        else:  # one split per row tensor: the rows before the boundary and the tail
            src = [part for x in rows for part in x.split((t, tail), dim=1)]
        _stale(self.rows, t, self.filled)
        self.filled = t
        if cut is not None:
            _stale(self.tail_rows, tail, self.tail_filled)
            self.tail_filled = tail
        if state is not None:
            src.append(state)
            self.zero_state = False
        elif not self.zero_state:
            self.state.zero_()
            self.zero_state = True
        torch._foreach_copy_(self._destinations(t, tail, state is not None), src)
        outputs = self.run()
        # copies, not views: the next call's replay (another GDN layer, another thread on this stream) rewrites the
        # static outputs
        if cut is None:
            out, final = outputs
            return out[:, :t].clone(), final.clone()
        out, boundary, tail_out, live = outputs
        return (torch.cat([out[:, :t], tail_out[:, :tail]], dim=1),
                boundary.to(torch.float32, copy=True), live.clone())

    def _destinations(self, t: int, tail: int, state: bool) -> list:
        """The static views a call of `t` rows (and a `tail`, 0 for a call without a boundary) copies into, in the
        order of its sources; kept for the next call of the same shape (the other GDN layers of a forward)."""
        key = (t, tail, state)
        if self._views_key != key:
            views = [x[:, :t] for x in self.rows]
            if tail:  # interleaved as the sources: each tensor's head rows, then its tail rows
                views = [view for pair in zip(views, (x[:, :tail] for x in self.tail_rows)) for view in pair]
            self._views, self._views_key = views + ([self.state] if state else []), key
        return self._views


def _runner(key, make: Callable):
    """The kept runner of `key` (made by `make` when there is none; None when its capture failed: its calls run
    the functions as they are). Called with `_LOCK` held."""
    runner = _GRAPHS.get(key)
    if runner is None and key not in _FAILED:
        try:
            runner = make()
        except Exception as error:  # a function that cannot be captured (another fla-core): run it as is
            _FAILED.add(key)
            warnings.warn(f"hf_raincheck: a GDN prefill call (fla-core's chunked function, or it and the tail "
                          f"kernel) could not be captured in a CUDA graph ({type(error).__name__}: {error}); eager "
                          f"prefills call the kernels directly", RuntimeWarning, stacklevel=3)
        else:
            _GRAPHS[key] = runner
            while len(_GRAPHS) > MAX_GRAPHS:
                _GRAPHS.popitem(last=False)
    if runner is not None:
        _GRAPHS.move_to_end(key)
    return runner


def _key(kind: str, fns: tuple, rows: int, q, k, v, g, beta, capture: bool) -> tuple:
    stream = torch.cuda.current_stream(q.device).stream_id if capture else 0
    return (kind, fns, rows, tuple(q.shape[2:]), tuple(v.shape[2:]), q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
            q.device, stream)


def graphed_chunk(chunk: Callable, q, k, v, g, beta, state, capture: bool = True):
    """``chunk(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)``
    (fla-core's chunked function, rows ``[1, T, ...]`` with `takes`) through its bucket's graph: returns ``(o [1, T,
    H_v, V], final state [1, H_v, K, V] float32)``, new tensors. `capture=False` runs `chunk` on the bucket's
    static buffers without a graph (tests of the padding on the CPU)."""
    rows = -(-q.shape[1] // BUCKET) * BUCKET
    key = _key("chunk", (chunk,), rows, q, k, v, g, beta, capture)
    with _LOCK:
        runner = _runner(key, lambda: _Runner(chunk, rows, q, k, v, g, beta, capture))
        if runner is None:
            return chunk(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)
        return runner(q, k, v, g, beta, state)


def graphed_split(chunk: Callable, tail: Callable, q, k, v, g, beta, state, cut: int, capture: bool = True):
    """A Raincheck first prefill's GDN call with a new plan's boundary after row `cut` (`takes_split`), in one
    graph: `chunk` (as `graphed_chunk`) on rows ``:cut`` from `state`, then ``tail(q, k, v, g, beta, boundary) ->
    (o, [S_T | P_tail])`` (the one-chunk kernel from ``[S_b | I]``, `kernels.gated_delta_with_transition`) on the
    rows after it, padded to `TAIL_ROWS` inert rows. Returns ``(o [1, T, H_v, V], boundary [1, H_v, K, V], live [1,
    H_v, K, V + K])``, new tensors, as `ops.advance_split`; None where the graph could not be captured (the caller
    makes the two calls itself). One replay where the calls cost the host two launches through fla's and Triton's
    Python."""
    rows = -(-cut // BUCKET) * BUCKET
    key = _key("split", (chunk, tail), rows, q, k, v, g, beta, capture)
    with _LOCK:
        runner = _runner(key, lambda: _Runner(chunk, rows, q, k, v, g, beta, capture, tail))
        return None if runner is None else runner(q, k, v, g, beta, state, cut)
