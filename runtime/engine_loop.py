"""Runs an `Engine` in its own thread so an asyncio server never blocks on a forward pass.

Everything that touches engine state runs on that thread: the asyncio side hands it functions
(`call`, `post`) and reads each request's output from an `asyncio.Queue` the thread fills. The
engine's connector (prefill or decode of a disaggregated pair) is polled between steps for
transfer events and deadlines (`Engine.poll`), and decides when a finished request's answer may
go out (after its KV was sent).
`merge` reads the streams of several requests (a batch, `n` choices) as one, by index.
A stream may take its first token apart (`first_apart`): the chunk of that token alone, computed
as a running request's, as soon as it exists, even while the request's answer waits (a prefill's,
for its KV to leave) or ends with it. A pair that shares a client's stream (the prefill sends the
first token's events, the decode the rest) so makes the same first chunk on both sides.

With no step to run, the thread sleeps in a poll (which releases the GIL) until a job arrives
(each `post` / `call` writes a byte to a wake-up pipe) or, for a connector, until its transfer
agents report (the connector's `events_socket`). It never spins: a spinning thread would hold the
GIL and delay the HTTP thread beside it by the interpreter's 5 ms switch interval at every turn
(measured: a room's registration took ~40 ms to cross the prefill's bootstrap server).
For the same reason, once it handed a request's first tokens over, the thread waits (a
millisecond at most) until the asyncio side has taken them before it plans the next step: that
side then writes them out while the GIL is free, not in the gaps of the step's Python (a step
that holds the GIL 3 ms before its forward, as kernel launches do: a disaggregated decode's
first token left 3.8 ms after it was handed over, 0.2 ms with the wait; 2-core CPU host).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import zmq

from dserve.runtime.engine import Engine
from dserve.runtime.executor import RankFailure
from dserve.runtime.output import StreamChunk, make_result
from dserve.runtime.pd import mark
from dserve.scheduler.request import Request

log = logging.getLogger("dserve.runtime")
IDLE_WAIT_S = 0.05  # nothing at all to do: wake up this often anyway (to see `running`)
SIDE_WAIT_S = 0.01  # rooms in flight: how often their deadlines are checked
HANDOFF_WAIT_S = 0.001  # the most the engine thread waits for a request's first tokens taken
RUN_HERE_CHECK_S = 1.0  # how often a `run_here` caller checks that the engine thread lives


class NullStats:
    """No log lines or counters (an engine loop outside a server)."""

    def finished(self, req: Request) -> None:
        pass

    def after_step(self) -> None:
        pass

    def idle(self) -> None:
        pass


class EngineLoop:
    def __init__(self, engine: Engine, stats=None):
        """`stats` (runtime/stats.Stats) hears of every step and every request answered."""
        self.engine, self.connector = engine, engine.connector
        self.stats = stats or NullStats()
        self.inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.subscribers: dict[str, Subscriber] = {}
        self.failure: str | None = None
        self.running = True
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self.poller = zmq.Poller()
        self.poller.register(self._wake_r, zmq.POLLIN)
        if self.connector.events_socket is not None:
            self.poller.register(self.connector.events_socket, zmq.POLLIN)
        self.thread = threading.Thread(target=self._run, name="dserve-engine", daemon=True)
        self.thread.start()

    # ---- asyncio side -----------------------------------------------------------------------------
    def post(self, fn: Callable, *args) -> None:
        """Run `fn(*args)` on the engine thread, not waiting for it."""
        self._put(lambda: fn(*args))

    def _put(self, job: Callable[[], None]) -> None:
        self.inbox.put(job)
        with contextlib.suppress(BlockingIOError):  # the pipe is full of wake-ups already
            os.write(self._wake_w, b"\0")

    def run_here(self, fn: Callable, *args):
        """Run `fn(*args)` on the engine thread and wait for its result, from a thread that is
        not an event loop's (the instance's start: its warm-up runs where steps will run, so
        what CUDA keeps per thread, cuBLAS's handles and workspaces, is made before ready). An
        engine thread that has ended fails the wait within `RUN_HERE_CHECK_S`."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def job() -> None:
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)

        self._put(job)
        while not done.done():  # the job (a warm-up) has no bound, a dead engine thread has one
            if not self.thread.is_alive():
                raise RuntimeError("the engine thread ended before it ran the job")
            concurrent.futures.wait([done], timeout=RUN_HERE_CHECK_S)
        return done.result()

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

        self._put(job)
        return await future

    async def stream(
        self, req: Request, start: Callable[[Request], None], first_apart: bool = False
    ) -> AsyncIterator[StreamChunk]:
        """Start `req` with `start` (on the engine thread) and yield its chunks; the last one is
        `finished`. Leaving early (client gone) aborts the request and frees what it holds.
        `first_apart`: the first token comes alone, in a chunk of its own (module docstring)."""
        if self.failure:
            raise RuntimeError(self.failure)
        q: asyncio.Queue = asyncio.Queue()
        finished = False
        subscriber = Subscriber(asyncio.get_running_loop(), q, first_apart)
        try:  # a client gone while the start waits for the engine thread: it still starts, then aborts
            await self.call(self._subscribe, req, subscriber, start)
            while not finished:
                chunk, taken = await q.get()
                if taken is not None:  # the engine thread waits for a first chunk to be taken
                    taken.set()
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:
                self.post(self._abort, req.rid)

    # ---- engine thread ----------------------------------------------------------------------------
    def _subscribe(self, req: Request, subscriber: Subscriber, start) -> None:
        self.subscribers[req.rid] = subscriber
        try:
            start(req)
        except BaseException:
            self.subscribers.pop(req.rid, None)
            raise

    def _abort(self, rid: str) -> None:
        subscribed = self.subscribers.pop(rid, None) is not None
        if not self.connector.abort(rid):
            self.engine.abort(rid)
        req = self.engine.requests.get(rid)
        if subscribed and req is not None:
            self.stats.finished(req)
        if req is not None and req.finished and not self.connector.busy(rid):
            self.engine.forget(rid)

    def _run(self) -> None:
        while self.running:
            if self.engine.has_work and not self.engine.stalled:
                self._drain()
            else:  # a stalled engine retries when a job or a transfer event comes, or soon
                busy = self.connector.has_work or self.engine.has_work
                self._wait(SIDE_WAIT_S if busy else IDLE_WAIT_S)
            try:
                if self.engine.poll():  # a request joined or ended: tell its client now
                    self._publish()
                if self.engine.has_work and not self.failure:
                    self.engine.step()
                    self.stats.after_step()
                else:
                    self.stats.idle()
            except RankFailure as e:
                self.failure = str(e)
                log.error("the instance failed: %s", e)
            except Exception:  # noqa: BLE001 - a bug must not kill the serving thread silently
                log.exception("engine step failed")
                self.engine._fail_all("internal error in the engine step (see the server log)")
            self._publish()

    def _wait(self, timeout_s: float) -> None:
        """Sleep until a job or a transfer event arrives (or `timeout_s`), then run the jobs."""
        self.poller.poll(timeout_s * 1000)
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 1 << 16)
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                return
            job()

    def _publish(self) -> None:
        handed = []  # first tokens of requests still running
        for rid, subscriber in list(self.subscribers.items()):
            req = self.engine.requests.get(rid)
            if req is None:
                continue
            first = self.engine.trackers[rid].sent_tokens == 0
            for chunk in self._chunks(req, subscriber):
                taken = None
                if chunk.token_ids:
                    mark(req, "published")
                    if first and not chunk.finished:
                        taken = threading.Event()
                        handed.append(taken)
                subscriber.put(chunk, taken)
        deadline = time.monotonic() + HANDOFF_WAIT_S
        for taken in handed:
            taken.wait(max(deadline - time.monotonic(), 0.0))

    def _chunks(self, req: Request, subscriber: Subscriber) -> list[StreamChunk]:
        """What `req`'s stream gets now: what is new, the first token apart when asked, the
        last chunk once its answer may go (then the request is forgotten here)."""
        rid, tracker = req.rid, self.engine.trackers[req.rid]
        done = req.finished and not self.connector.busy(rid)
        chunks = []
        if subscriber.first_apart and tracker.sent_tokens == 0 and req.output_ids:
            if len(req.output_ids) != 1:  # a bug: the pair's other half misses the others
                log.error("%s: %d tokens at its first publish", rid, len(req.output_ids))
            chunks.append(tracker.chunk(final=False))
        if done:
            self.stats.finished(req)
            chunks.append(tracker.chunk(make_result(req, tracker.text)))
            self.engine.forget(rid)
            del self.subscribers[rid]
        elif not req.finished:
            chunk = tracker.chunk()
            if chunk.text or chunk.token_ids:
                chunks.append(chunk)
        return chunks

    def stop(self) -> None:
        self.running = False
        self._put(lambda: None)
        self.thread.join(timeout=10)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)


@dataclass
class Subscriber:
    """Where a request's chunks go (an asyncio queue, filled from the engine thread)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    first_apart: bool = False

    def put(self, chunk: StreamChunk, taken: threading.Event | None) -> None:
        """`taken`: set by the reader when it took the chunk (the engine thread may wait)."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (chunk, taken))


async def merge(streams: list) -> AsyncIterator[tuple[int, StreamChunk]]:
    """(index, chunk) from every stream as they come; leaving early (or a failure of one)
    closes them all, which aborts their requests. One stream is read as it is: no task and
    queue between it and the reader, whose chunk then goes out a turn of the event loop sooner
    (a turn that, on a busy instance, can wait for the GIL)."""
    if len(streams) == 1:
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:
            await streams[0].aclose()
        return
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
