"""Timing of GPU work for the benchmarks: CUDA events around a call, median over repeats."""
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
