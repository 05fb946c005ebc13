"""Timing of GPU work for the benchmarks: CUDA events around a call, median over repeats; the
device copy bandwidth and bf16 matmul rate they compare against.

A graph replay (`graph_seconds`) is timed behind a short sleep kernel (`LEAD_CYCLES`), so its
start event runs only once the host has queued the replay: the events then bracket the GPU's
work, not the host's launch latency. Without it an empty kernel replayed from a CUDA graph timed
15.9 us on an H100 (the host's `cudaGraphLaunch`), where the kernel ran 0.9 us; a decode step pays
that latency once for its whole graph, not once per layer
(bench/notes/session33-h100-2026-11-27.md). Eager calls (`median_seconds` without `lead`, as the
step benches time a forward) keep the host's time in: there the user waits for it."""

from __future__ import annotations

import statistics

import torch

LEAD_CYCLES = 1_000_000
"""The sleep before each timed replay: about 0.5 ms at an H100's clocks, longer than the host
takes to queue a graph's replay."""


def median_seconds(fn, repeats: int, warmup: int = 3, lead: bool = False) -> float:
    """Median seconds of `fn()` on the current stream, after `warmup` untimed calls. `lead`:
    each call behind a sleep kernel, so the time runs from its first kernel (module
    docstring)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead:
            torch.cuda._sleep(LEAD_CYCLES)
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
    return median_seconds(graph.replay, repeats, lead=True) / len(fns)


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Bytes per second (read + write) of a large device-to-device copy on the current GPU: the
    limit the memory-bound kernels are held against."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), repeats)


def matmul_flops(n: int = 8192, repeats: int = 10) -> float:
    """Floating-point operations per second of a large bf16 matmul (n^3) on the current GPU:
    the limit the tensor-core-bound kernels are held against."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / median_seconds(lambda: a @ b, repeats)
