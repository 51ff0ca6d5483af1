"""GPU time per call of a few kernels captured in one CUDA graph (the benchmarks of single GDN kernels)."""

from __future__ import annotations

import statistics

import torch


def graph_us_per_call(calls: list, iters: int) -> float:
    """Median GPU us per call: `calls` (argument-free callables, e.g. one per layer's buffers) run once on a side
    stream (compiles and autotunes outside the capture), are captured in order in one CUDA graph, and the graph is
    replayed `iters` times (CUDA events around each replay) after three warm replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / len(calls))
    return statistics.median(times)
