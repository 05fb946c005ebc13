"""Runs an `Engine` in its own thread so an asyncio server never blocks on a forward pass.

Everything that touches engine state runs on that thread: the asyncio side hands it functions
(`call`, `post`) and reads each request's output from an `asyncio.Queue` the thread fills. A role
side (prefill or decode of a disaggregated pair) is polled between steps for transfer events and
deadlines, and decides when a finished request's answer may go out (after its KV was sent).
`merge` reads the streams of several requests (a batch, `n` choices) as one, by index.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator, Callable

from dserve.runtime.engine import Engine
from dserve.runtime.executor import RankFailure
from dserve.runtime.output import StreamChunk, make_result
from dserve.scheduler.request import Request

log = logging.getLogger("dserve.runtime")
IDLE_WAIT_S = 0.005


class NullSide:
    """A colocated instance: nothing in flight beside the engine."""

    def poll(self) -> None:
        pass

    def busy(self, rid: str) -> bool:
        return False

    def abort(self, rid: str) -> bool:
        return False

    @property
    def has_work(self) -> bool:
        return False


class EngineLoop:
    def __init__(self, engine: Engine, side=None):
        self.engine, self.side = engine, side or NullSide()
        self.inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.failure: str | None = None
        self.running = True
        self.thread = threading.Thread(target=self._run, name="dserve-engine", daemon=True)
        self.thread.start()

    # ---- asyncio side -----------------------------------------------------------------------------
    def post(self, fn: Callable, *args) -> None:
        """Run `fn(*args)` on the engine thread, not waiting for it."""
        self.inbox.put(lambda: fn(*args))

    async def call(self, fn: Callable, *args):
        """Run `fn(*args)` on the engine thread and return its result (or raise its exception)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def job() -> None:
            try:
                result, error = fn(*args), None
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            loop.call_soon_threadsafe(_settle, future, result, error)

        self.inbox.put(job)
        return await future

    async def stream(
        self, req: Request, start: Callable[[Request], None]
    ) -> AsyncIterator[StreamChunk]:
        """Start `req` with `start` (on the engine thread) and yield its chunks; the last one is
        `finished`. Leaving early (client gone) aborts the request and frees what it holds."""
        if self.failure:
            raise RuntimeError(self.failure)
        q: asyncio.Queue = asyncio.Queue()
        finished = False
        try:  # a client gone while the start waits for the engine thread: it still starts, then aborts
            await self.call(self._subscribe, req, asyncio.get_running_loop(), q, start)
            while not finished:
                chunk = await q.get()
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:
                self.post(self._abort, req.rid)

    # ---- engine thread ----------------------------------------------------------------------------
    def _subscribe(self, req: Request, loop, q, start) -> None:
        self.subscribers[req.rid] = (loop, q)
        try:
            start(req)
        except BaseException:
            self.subscribers.pop(req.rid, None)
            raise

    def _abort(self, rid: str) -> None:
        self.subscribers.pop(rid, None)
        if not self.side.abort(rid):
            self.engine.abort(rid)
        req = self.engine.requests.get(rid)
        if req is not None and req.finished and not self.side.busy(rid):
            self.engine.forget(rid)

    def _run(self) -> None:
        while self.running:
            busy = self.engine.has_work or self.side.has_work
            self._drain(block=not busy)
            try:
                self.side.poll()
                if self.engine.has_work and not self.failure:
                    self.engine.step()
            except RankFailure as e:
                self.failure = str(e)
                log.error("the instance failed: %s", e)
            except Exception:  # noqa: BLE001 - a bug must not kill the serving thread silently
                log.exception("engine step failed")
                self.engine._fail_all("internal error in the engine step (see the server log)")
            self._publish()

    def _drain(self, block: bool) -> None:
        try:
            job = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            job()
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _publish(self) -> None:
        for rid, (loop, q) in list(self.subscribers.items()):
            req = self.engine.requests.get(rid)
            if req is None:
                continue
            done = req.finished and not self.side.busy(rid)
            if req.finished and not done:
                continue
            tracker = self.engine.trackers[rid]
            if done:
                result = make_result(req, tracker.text)
                chunk = tracker.chunk(result)
                self.engine.forget(rid)
                del self.subscribers[rid]
            else:
                chunk = tracker.chunk()
                if not (chunk.text or chunk.token_ids):
                    continue
            loop.call_soon_threadsafe(q.put_nowait, chunk)

    def stop(self) -> None:
        self.running = False
        self.thread.join(timeout=10)


async def merge(streams: list) -> AsyncIterator[tuple[int, StreamChunk]]:
    """(index, chunk) from every stream as they come; leaving early (or a failure of one)
    closes them all, which aborts their requests."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((index, chunk))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            queue.put_nowait((index, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    open_streams = len(streams)
    try:
        while open_streams:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            open_streams -= item.finished
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
