"""Timing of GPU work for the benchmarks: CUDA events around a call, median over repeats; the
device copy bandwidth they compare against."""

from __future__ import annotations

import statistics

import torch


def median_seconds(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of `fn()` on the current stream, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graph_seconds(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of one replay of `fn` captured in a CUDA graph: the GPU time of its kernels
    without the host's launch cost, as a step inside a captured decode step sees it."""
    return graph_seconds_each([fn], repeats, warmup)


def graph_seconds_each(fns: list, repeats: int, warmup: int = 3) -> float:
    """Median seconds per call of `fns` captured back to back in one CUDA graph. Calls that
    each read their own copy of the operands (more bytes in all than the L2 cache holds) are
    timed as a step reads its weights: from memory, one after another."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return median_seconds(graph.replay, repeats) / len(fns)


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Bytes per second (read + write) of a large device-to-device copy on the current GPU: the
    limit the memory-bound kernels are held against."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), repeats)
