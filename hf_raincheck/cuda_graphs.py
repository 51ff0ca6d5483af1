"""Capturing a function as a CUDA graph, the one way the package does it (`capture`).

Used by the MMTok greedy loop (`pruning.greedy`) and by eager prefills' GDN calls (`gdn_state.graphed`).
"""

from __future__ import annotations

from typing import Callable

import torch


def capture(fn: Callable, device: torch.device, error_mode: str = "global") -> tuple[torch.cuda.CUDAGraph, object]:
    """`fn` run once on a side stream (warm-up: autotuning, compiling, allocator pools, as torch.cuda.graphs asks),
    then captured. Returns ``(graph, what fn returned during the capture)``: tensors in the graph's pool, which each
    ``graph.replay()`` rewrites. The capture stream is made on `device` explicitly: torch.cuda.graph's default one
    is created once, on the device current at its first use, so a later capture for another GPU (a model on cuda:1)
    would switch to the first GPU and fail ("operation not permitted when stream is capturing"). `error_mode`:
    torch.cuda.graph's ``capture_error_mode`` (``"thread_local"``: other threads' CUDA calls are not this capture's
    business)."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(device=device), capture_error_mode=error_mode):
        result = fn()
    return graph, result
