"""Sequential greedy loops (DivPrune, MMTok) without per-step launch overhead on CUDA.

A greedy selector runs ``b`` dependent steps of a few small kernels each; eager PyTorch spends ~10 us of CPU
time per kernel launch, so a 300-step loop costs tens of milliseconds even when the GPU work is tiny. On CUDA the
loop body is therefore captured once as a CUDA graph of ``CHUNK`` steps and replayed ``ceil(b / CHUNK)`` times.
The graph runs exactly the kernels of the eager loop (same results, bit for bit); it depends only on the tensor
shapes (not on the budget), and is cached per shape (LRU of ``CACHE_SIZE``). Steps past the budget in the last
chunk are computed and discarded.

Set ``HF_RAINCHECK_GREEDY_GRAPHS=0`` to run the eager loop everywhere.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable

import torch

CHUNK = 16
CACHE_SIZE = 8
MIN_STEPS = 2 * CHUNK  # shorter loops run eagerly (capturing would cost more than it saves)

_CACHE: "OrderedDict[tuple, _Loop]" = OrderedDict()


def graphs_enabled(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and os.environ.get("HF_RAINCHECK_GREEDY_GRAPHS", "1") != "0"
        and not torch.cuda.is_current_stream_capturing()
    )


class _Loop:
    """Static state tensors + a CUDA graph of `CHUNK` steps of ``step(state, picks, s)``."""

    def __init__(self, state: dict[str, torch.Tensor], step: Callable, batch: int):
        self.state = state
        self.picks = torch.zeros(batch, CHUNK, dtype=torch.long, device=next(iter(state.values())).device)
        self.step = step
        self.graph = None

    def _body(self) -> None:
        for s in range(CHUNK):
            self.step(self.state, self.picks, s)

    def capture(self) -> None:
        saved = {k: v.clone() for k, v in self.state.items()}
        device = self.picks.device
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs recommends
            self._body()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # an explicit capture stream on the state's device: torch.cuda.graph's default one is created once, on the
        # device current at its first use, so a later capture for another GPU (a model on cuda:1) would switch to
        # the first GPU and fail ("operation not permitted when stream is capturing")
        with torch.cuda.graph(self.graph, stream=torch.cuda.Stream(device=device)):
            self._body()
        for k, v in saved.items():
            self.state[k].copy_(v)

    def run(self, budget: int, order: torch.Tensor, start: int) -> None:
        for first in range(start, budget, CHUNK):
            self.graph.replay()
            take = min(CHUNK, budget - first)
            order[:, first : first + take] = self.picks[:, :take]


def run_greedy(
    kind: str, state: dict[str, torch.Tensor], step: Callable, order: torch.Tensor, start: int, budget: int
) -> None:
    """Runs steps ``start .. budget - 1`` of a greedy loop, writing each step's picks ``[B]`` to ``order[:, i]``.

    ``step(state, picks, s)`` must update `state` in place and write its pick to ``picks[:, s]``, with no host
    synchronisation. `state` is copied into the cached graph's static tensors (and left untouched)."""
    steps = budget - start
    device = order.device
    if steps <= 0:
        return
    if steps < MIN_STEPS or not graphs_enabled(device):
        picks = torch.zeros(order.shape[0], 1, dtype=torch.long, device=device)
        for i in range(start, budget):
            step(state, picks, 0)
            order[:, i] = picks[:, 0]
        return
    with torch.cuda.device(device):  # graphs capture and replay on the current device's streams
        _run_graphed(kind, state, step, order, start, budget, device)


def _run_graphed(kind, state, step, order, start, budget, device) -> None:
    key = (kind, device, *((name, tuple(t.shape), t.dtype) for name, t in sorted(state.items())))
    loop = _CACHE.get(key)
    if loop is None:
        loop = _Loop({name: torch.empty_like(t) for name, t in state.items()}, step, order.shape[0])
        for name, t in state.items():
            loop.state[name].copy_(t)
        loop.capture()
        _CACHE[key] = loop
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
        for name, t in state.items():
            loop.state[name].copy_(t)
    loop.run(budget, order, start)
