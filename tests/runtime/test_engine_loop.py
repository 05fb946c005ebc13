"""The engine thread's asyncio front (`runtime/engine_loop.py`): a client that leaves ends its request
and frees its pages, even when it leaves while the start still waits behind a busy engine thread; a
job run on the engine thread from outside an event loop (`run_here`, the warm-up) hands back its
outcome, and fails within a second when the engine thread is gone."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from dserve.runtime import SamplingParams
from dserve.runtime.engine_loop import RUN_HERE_CHECK_S, EngineLoop


def test_client_gone_while_the_start_waits_aborts(tiny_dir, make_engine):
    engine = make_engine(tiny_dir("deepseek_v3"))
    loop, busy = EngineLoop(engine), threading.Event()
    params = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)

    async def scenario():
        loop.post(busy.wait)  # the engine thread is in a long step
        req = engine.make_request(input_ids=[10, 11, 12, 13], sampling_params=params)
        first = asyncio.ensure_future(anext(loop.stream(req, engine.submit)))
        await asyncio.sleep(0.2)  # the start is queued behind the step
        first.cancel()  # the client leaves
        with pytest.raises(asyncio.CancelledError):
            await first
        busy.set()  # the start runs, and the abort after it
        return await loop.call(lambda: (dict(engine.requests), dict(engine.groups[0].kv.tables)))

    try:
        requests, tables = asyncio.run(scenario())
    finally:
        busy.set()
        loop.stop()
    assert requests == {} and tables == {}


def test_run_here_runs_on_the_engine_thread_and_hands_back_its_outcome(tiny_dir, make_engine):
    """The instance's warm-up goes through `run_here`: it runs where the steps run (CUDA keeps
    cuBLAS handles per thread), and the caller gets its result or its exception."""
    loop = EngineLoop(make_engine(tiny_dir("deepseek_v3")))
    try:
        assert loop.run_here(lambda: threading.current_thread()) is loop.thread
        with pytest.raises(ValueError, match="warm-up failed"):
            loop.run_here(_fail, "warm-up failed")
        assert loop.run_here(lambda x: x + 1, 41) == 42  # the thread still serves
    finally:
        loop.stop()


def test_run_here_fails_at_once_when_the_engine_thread_has_ended(tiny_dir, make_engine):
    """A job queued behind an engine thread that is gone never runs: the caller gets an error
    within a second (RUN_HERE_CHECK_S), not a hang."""
    loop = EngineLoop(make_engine(tiny_dir("deepseek_v3")))
    loop.running = False
    loop.post(lambda: None)  # wakes the thread, which leaves its loop
    loop.thread.join(timeout=10)
    assert not loop.thread.is_alive()
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="engine thread ended"):
            loop.run_here(lambda: 42)
        assert time.monotonic() - start < 2 * RUN_HERE_CHECK_S
    finally:
        loop.stop()


def _fail(message: str) -> None:
    raise ValueError(message)


@pytest.mark.parametrize("max_new_tokens", [1, 5])
def test_first_token_apart_comes_alone_as_a_running_requests(tiny_dir, make_engine, max_new_tokens):
    """`first_apart` (the chunks of a stream a disaggregated pair shares): the first chunk holds
    the first token alone, its text held back as while the request runs (`final=False`), even
    when the request ended at that token; then come the others. The chunks add up to the
    stream's without it, token for token and character for character."""
    engine = make_engine(tiny_dir("deepseek_v3"))
    loop = EngineLoop(engine)
    prompt = [10, 11, 12, 13]
    # the first token's text as a stop string's start: the first chunk holds it back
    probe = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
    assert probe.text  # (the tiny tokenizer's token texts are not empty)
    stop = probe.text + "\uffff"
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True, stop=stop
    )

    async def chunks(apart: bool) -> list:
        req = engine.make_request(input_ids=prompt, sampling_params=params)
        return [c async for c in loop.stream(req, engine.submit, first_apart=apart)]

    try:
        whole = asyncio.run(chunks(False))
        apart = asyncio.run(chunks(True))
    finally:
        loop.stop()
    first = apart[0]
    assert len(first.token_ids) == 1 and not first.finished
    assert first.text == ""  # could still grow into the stop string
    assert apart[-1].finished and apart[-1].result.finish_reason == "length"
    if max_new_tokens == 1:
        assert len(apart) == 2 and apart[1].token_ids == [] and len(whole) == 1
    assert "".join(c.text for c in apart) == "".join(c.text for c in whole)
    assert [t for c in apart for t in c.token_ids] == [t for c in whole for t in c.token_ids]
