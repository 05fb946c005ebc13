"""Timing an engine's decode steps from the host's view once every request decodes, and running a
benchmark case in a fresh process: what the whole-step benchmarks share (`bench.engine_step`,
`bench.spec_decode`, `bench.pipeline`)."""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass

import torch


@dataclass
class DecodeTiming:
    steps: int
    seconds: float
    tokens: int
    """Tokens the requests gained over the timed steps."""


def time_decode(engine, prompts: list[list[int]], output_len: int, steps: int | None = None):
    """Greedy requests for `prompts`: step until each has a few tokens (its prompt done), then
    time `steps` engine steps (default: until the first request ends); then finish them all."""
    from dserve.runtime import SamplingParams

    params = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
    reqs = [engine.requests[engine.add_request(input_ids=p, sampling_params=params)]
            for p in prompts]  # fmt: skip
    while not all(len(r.output_ids) > 2 for r in reqs):
        engine.step()
    before, done = sum(len(r.output_ids) for r in reqs), 0
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    while done < steps if steps else not any(r.finished for r in reqs):
        engine.step()
        done += 1
    elapsed = time.perf_counter() - start
    gained = sum(len(r.output_ids) for r in reqs) - before
    while not all(r.finished for r in reqs):
        engine.step()
    for r in reqs:
        engine.pop_result(r.rid)
    return DecodeTiming(done, elapsed, gained)


def _run(queue, fn, args) -> None:
    queue.put(fn(*args))


def in_process(fn, *args):
    """`fn(*args)` in a fresh process, which may start rank processes of its own (a pool's
    workers may not): each case's memory, GPU memory included, goes with it."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_run, args=(queue, fn, args))
    proc.start()
    result = queue.get()
    proc.join()
    return result
