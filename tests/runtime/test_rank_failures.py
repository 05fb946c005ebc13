"""A rank that dies at any moment fails the instance within seconds: while the ranks start (it
once left the front spinning forever on a closed pipe), in the middle of a step the front waits
for, and between steps (`test_parallel.py`). Every rank is reaped and the error names the dead."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from dserve.runtime import Engine, SamplingParams
from dserve.runtime.executor import RankFailure

pytestmark = pytest.mark.slow


def kill_rank_when_up(name: str, delay_s: float, freeze: str | None = None) -> threading.Thread:
    """Kill this process's child called `name` `delay_s` after it appears; the child called
    `freeze` (if any) is stopped the moment it appears, so `name` cannot get past start-up."""

    def child(wanted: str):
        return next((p for p in mp.active_children() if p.name == wanted), None)

    def watch():
        deadline = time.monotonic() + 30
        frozen = freeze is None
        while time.monotonic() < deadline:
            if not frozen and child(freeze) is not None:
                os.kill(child(freeze).pid, signal.SIGSTOP)
                frozen = True
            victim = child(name)
            if victim is not None and frozen:
                time.sleep(delay_s)
                os.kill(victim.pid, signal.SIGKILL)
                return
            time.sleep(0.001)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "delay_s, freeze", [(0.0, None), (2.0, "dserve-rank-0")], ids=["forked", "waiting"]
)
def test_rank_dead_at_start_up(delay_s, freeze, tiny_dir):
    """Killed the moment it exists, or while it waits for a (frozen) peer at start-up."""
    before = {p.pid for p in mp.active_children()}
    watcher = kill_rank_when_up("dserve-rank-1", delay_s, freeze)
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 died"):
        Engine(tiny_dir("deepseek_v3"), device="cpu", load_progress=False, tp_size=2)
    assert time.monotonic() - start < 30
    watcher.join(timeout=5)
    left = [p for p in mp.active_children() if p.pid not in before]
    assert not left, f"ranks left running: {left}"


def test_rank_dead_in_the_middle_of_a_step(tiny_dir, make_engine):
    """The rank is frozen while the front waits for its answer to a step, then killed: the step
    fails with the rank named, the requests with it, and the instance refuses further work."""
    engine = make_engine(tiny_dir("glm4_moe"), tp_size=2, collective_timeout_s=60)
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    rid = engine.add_request(input_ids=[5, 6, 7, 8, 9], sampling_params=params)
    for _ in range(3):
        engine.step()
    victim = engine.executor.procs[1]
    os.kill(victim.pid, signal.SIGSTOP)
    threading.Timer(1.0, os.kill, (victim.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 died"):
        for _ in range(50):
            engine.step()
    assert 1.0 <= time.monotonic() - start < 15
    assert not any(p.is_alive() for p in engine.executor.procs)
    result = engine.pop_result(rid)
    assert result.finish_reason == "abort" and "rank 1 died" in result.meta["error"]
    with pytest.raises(RankFailure, match="shut down"):
        engine.generate(input_ids=[1, 2, 3], sampling_params=params)
