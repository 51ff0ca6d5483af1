"""Sequential greedy loops (DivPrune, MMTok) without per-step launch overhead on CUDA.

A greedy selector runs ``b`` dependent steps of a few small kernels each; eager PyTorch spends CPU time on every
kernel launch, so a loop of hundreds of steps is bound by launches even when the GPU work is tiny. On CUDA the
loop body is therefore captured once as a CUDA graph of ``CHUNK`` steps and replayed ``ceil(b / CHUNK)`` times.
The graph runs exactly the kernels of the eager loop (same results, bit for bit); it depends only on the tensor
shapes (not on the budget), and is cached per shape (LRU of ``CACHE_SIZE``). Steps past the budget in the last
chunk are computed and discarded.

Checked loops (``run_greedy(..., check=Checked(...))``, MMTok's lazy greedy): the fast step may be unable to
certify its pick (a data-dependent condition, which a graph cannot branch on). It then raises its flag
``state[check.flag][:, s]`` and carries on (its pick, and the steps after it, are then worthless). Such a loop runs
in chunks of ``CHUNK`` steps on every device (graphed on CUDA, eager elsewhere: the same chunk logic either way).
Each chunk first saves ``check.mutable`` (inside the graph); after it the host reads the chunk's flags (one
synchronisation per chunk) and keeps the picks before the first flagged step ``s``. If there is one, it calls
``check.rewind(state, saved, picks[:, :s])`` (the state after those ``s`` steps, from the one saved before the
chunk) and ``check.refresh(state)``, and the next chunk starts at that step. ``refresh`` also runs once before
the first step; it must leave a state in which the next step certifies (so every chunk makes progress). On CUDA
``refresh`` is captured as a graph of its own (cached with the loop's).

``run_greedy(..., graphs=False)`` runs the eager loop everywhere (mmtok's ``cuda_graphs`` option).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from ..cuda_graphs import capture

CHUNK = 16
CACHE_SIZE = 8
MIN_STEPS = 2 * CHUNK  # shorter loops run eagerly (capturing would cost more than it saves)

_CACHE: "OrderedDict[tuple, _Loop]" = OrderedDict()


@dataclass(frozen=True)
class Checked:
    """How to check a loop whose fast step may fail to certify its pick, and how to resume after a failure.

    - ``flag``: a state entry, bool ``[B, CHUNK]``: ``step(state, picks, s)`` sets ``flag[:, s]`` where its pick
      is not certified (the loop zeroes the flags before each chunk);
    - ``mutable``: the state entries that the steps change (saved before each chunk);
    - ``rewind(state, saved, done)``: puts into `state` the state after the steps whose picks are ``done
      [B, s]`` (certified), starting from ``saved`` (the `mutable` entries before them); no graph, may be eager;
    - ``refresh(state)``: run before the first step and after each rewind (graph-capturable); after it the next
      step must certify its pick.
    """

    flag: str
    mutable: tuple
    rewind: Callable
    refresh: Callable


# counters for tests and benchmarks: chunks run, and rewinds (flagged chunks) of checked loops
STATS = {"chunks": 0, "rewinds": 0}


def graphs_enabled(device: torch.device, graphs: bool = True) -> bool:
    """Whether a loop on `device` runs as CUDA graphs: on CUDA, unless `graphs` is False or a capture is under way."""
    return graphs and device.type == "cuda" and not torch.cuda.is_current_stream_capturing()


class _Loop:
    """Static state tensors + a CUDA graph of `CHUNK` steps of ``step(state, picks, s)`` (+ the checked extras)."""

    def __init__(self, state: dict[str, torch.Tensor], step: Callable, batch: int, check: Checked | None):
        self.state = state
        self.picks = torch.zeros(batch, CHUNK, dtype=torch.long, device=next(iter(state.values())).device)
        self.step = step
        self.check = check
        self.saved = {k: torch.empty_like(state[k]) for k in check.mutable} if check else {}
        self.graph = None
        self.refresh_graph = None

    def _body(self) -> None:
        if self.check is not None:
            _save(self.check, self.state, self.saved)
        for s in range(CHUNK):
            self.step(self.state, self.picks, s)

    def _capture(self, fn: Callable) -> torch.cuda.CUDAGraph:
        return capture(fn, self.picks.device)[0]

    def capture(self) -> None:
        saved = {k: v.clone() for k, v in self.state.items()}
        self.graph = self._capture(self._body)
        if self.check is not None:
            self.refresh_graph = self._capture(lambda: self.check.refresh(self.state))
        for k, v in saved.items():
            self.state[k].copy_(v)

    def run(self, budget: int, order: torch.Tensor, start: int) -> None:
        if self.check is None:
            for first in range(start, budget, CHUNK):
                self.graph.replay()
                take = min(CHUNK, budget - first)
                order[:, first : first + take] = self.picks[:, :take]
            return
        self.refresh_graph.replay()
        first, stalled = start, False
        while first < budget:
            self.graph.replay()
            kept = _verify_chunk(self.check, self.state, self.picks, self.saved, order, first, budget,
                                 self.refresh_graph.replay)
            first, stalled = first + kept, _stalled(kept, stalled)


def _save(check: Checked, state, saved) -> None:
    for k, v in saved.items():
        v.copy_(state[k])
    state[check.flag].zero_()


def _stalled(kept: int, stalled: bool) -> bool:
    """A chunk right after a refresh must keep a step (`Checked`): else the loop would never end."""
    if kept == 0 and stalled:
        raise RuntimeError("checked greedy loop: the step after a refresh was not certified")
    return kept == 0


def _verify_chunk(check: Checked, state, picks, saved, order, first: int, budget: int, refresh) -> int:
    """After a chunk from step `first`: keeps the picks before its first flagged step (rewinding to there and
    refreshing if there is one); returns how many steps were kept."""
    STATS["chunks"] += 1
    take = min(CHUNK, budget - first)
    flagged = state[check.flag][:, :take].any(dim=0).tolist()  # the chunk's one host synchronisation
    good = flagged.index(True) if True in flagged else take
    order[:, first : first + good] = picks[:, :good]
    if good < take:
        STATS["rewinds"] += 1
        check.rewind(state, saved, picks[:, :good])
        refresh()
    return good


def run_greedy(
    kind: str,
    state: dict[str, torch.Tensor],
    step: Callable,
    order: torch.Tensor,
    start: int,
    budget: int,
    check: Checked | None = None,
    graphs: bool = True,
) -> None:
    """Runs steps ``start .. budget - 1`` of a greedy loop, writing each step's picks ``[B]`` to ``order[:, i]``.

    ``step(state, picks, s)`` must update `state` in place and write its pick to ``picks[:, s]``, with no host
    synchronisation. `state` is copied into the cached graph's static tensors (and left untouched) where the loop
    is graphed, and updated in place where it runs eagerly. With `check`, see `Checked` and the module docstring.
    `graphs=False`: the eager loop on CUDA too (the same picks)."""
    steps = budget - start
    device = order.device
    if steps <= 0:
        return
    if steps < MIN_STEPS or not graphs_enabled(device, graphs):
        _run_eager(state, step, order, start, budget, check)
        return
    with torch.cuda.device(device):  # graphs capture and replay on the current device's streams
        _run_graphed(kind, state, step, order, start, budget, device, check)


def _run_eager(state, step, order, start, budget, check) -> None:
    batch = order.shape[0]
    if check is None:
        picks = torch.zeros(batch, 1, dtype=torch.long, device=order.device)
        for i in range(start, budget):
            step(state, picks, 0)
            order[:, i] = picks[:, 0]
        return
    # checked: the chunks of the graphed loop, run eagerly (the same saving, flags, verification and rewinds)
    picks = torch.zeros(batch, CHUNK, dtype=torch.long, device=order.device)
    saved = {k: torch.empty_like(state[k]) for k in check.mutable}
    check.refresh(state)
    first, stalled = start, False
    while first < budget:
        _save(check, state, saved)
        for s in range(min(CHUNK, budget - first)):
            step(state, picks, s)
        kept = _verify_chunk(check, state, picks, saved, order, first, budget, lambda: check.refresh(state))
        first, stalled = first + kept, _stalled(kept, stalled)


def _run_graphed(kind, state, step, order, start, budget, device, check) -> None:
    key = (kind, device, check is not None, *((name, tuple(t.shape), t.dtype) for name, t in sorted(state.items())))
    loop = _CACHE.get(key)
    if loop is None:
        loop = _Loop({name: torch.empty_like(t) for name, t in state.items()}, step, order.shape[0], check)
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
