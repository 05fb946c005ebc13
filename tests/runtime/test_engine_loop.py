"""The engine thread's asyncio front (`runtime/engine_loop.py`): a client that leaves ends its request
and frees its pages, even when it leaves while the start still waits behind a busy engine thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dserve.runtime import SamplingParams
from dserve.runtime.engine_loop import EngineLoop


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
