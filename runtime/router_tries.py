"""One try of a request on a prefill + decode pair, for `dserve router` (`router.py`).

`PairTries._try` sends the request to both instances at once (the prefill answers whole) and
relays the decode's answer once it is sure. `PairTries._try_shared` runs a stream that the pair
shares (`SharedStream`): the prefill's events of each request's first token go out as soon as
they come, then the decode's (once the prefill's stream ended: every request's KV has left). A try that fails before the client got anything returns a
`Failure` for the router to try again elsewhere; after that, a stream ends with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable

import orjson

from dserve.runtime.downstream import Reply, Stream
from dserve.runtime.protocol import ROUTER_FIELDS, ROUTES, EventStream
from dserve.runtime.router_policy import Backend
from dserve.runtime.sse import STREAM_END, EventReader, error_event, event_error, first_event
from dserve.runtime.upstream import Response, UpstreamError

log = logging.getLogger("dserve.router")
BLAME_GRACE_S = 1.0  # how long a failed decode waits to learn whether its prefill failed
# the decode gets them as the client sent them; the prefill too when the pair shares the stream,
# else it answers whole
STREAM_FIELDS = ("stream", "stream_options")
FAILED = (UpstreamError, asyncio.TimeoutError)  # a leg to an instance that failed
CONTINUE = object()  # `_pass_events`: the prefill's stream goes on


@dataclass
class Failure:
    """A try that failed: the status and message the client gets (if no other try succeeds,
    when it failed before the client got anything), whether another try may succeed, and the
    instance at fault."""

    status: int
    message: str
    retry: bool
    backend: Backend | None = None
    lost: bool = False  # the connection failed (not an answer)


@dataclass
class Ask:
    """A client's request as the tries send it: its endpoint, its body (parsed, and the bytes it
    came as), when it came, and the check of the body (`router.check_body`, by `checker`), which
    runs once: after the first try's requests have left (`PairTries._sent`), or before an answer
    that no try gave."""

    endpoint: str
    body: dict
    raw: bytes
    start: float
    checker: Callable[[], object]
    checked: bool = False
    _rest: bytes | None = None

    def check(self) -> Failure | None:
        """The body's check, the first time it is asked for: a 400 Failure if it is bad."""
        if self.checked:
            return None
        self.checked = True
        try:
            self.checker()
        except ValueError as e:
            return Failure(400, str(e), False)
        return None

    def rest(self) -> bytes:
        """The body's fields but the router's and the stream ones, as JSON: a long prompt (some
        100 KB of token ids at 16k tokens) is serialized once for every try, by orjson (with
        Python's json, reading and writing a 16k-token body took 4.5 ms on a 2-core host)."""
        if self._rest is None:
            own = {*ROUTER_FIELDS, *STREAM_FIELDS}
            self._rest = orjson.dumps({k: v for k, v in self.body.items() if k not in own})
        return self._rest

    def shared_body(self, fields: dict) -> bytes:
        """What both instances of a shared stream get: the client's body with the router's
        `fields`: its own bytes where it has none of them, else serialized again without
        them."""
        if not any(k in self.body for k in ROUTER_FIELDS):
            return _json_body(fields, self.raw)
        streamed = {k: self.body[k] for k in STREAM_FIELDS if k in self.body}
        return _json_body({**fields, **streamed}, self.rest())


@dataclass
class Opened:
    """An instance's answer once it is sure to succeed or to be relayed as it is (the decode's,
    or a shared stream's prefill's): its status and the bytes read so far (a whole body, or a
    stream's first event)."""

    upstream: Response
    head: bytes
    streamed: bool


class PairTries:
    """The router's tries on a pair (a mixin of `Router`: its `upstreams`, `metrics` and
    `config`)."""

    async def _try(self, request, ask: Ask, pair: tuple[Backend, Backend]):
        """One try on a pair: the client's response once the decode's answer is sure, else the
        Failure (both requests dropped)."""
        prefill, decode = pair
        boot, body = _bootstrap(prefill), ask.body
        streamed = {k: body[k] for k in STREAM_FIELDS if k in body}
        to_decode = _json_body({**boot, **streamed}, ask.rest())
        to_prefill = _json_body({**boot, "stream": False}, ask.rest())  # answered whole
        decode.in_flight += 1
        prefill.in_flight += 1
        endpoint = ask.endpoint
        prefill_task = asyncio.ensure_future(self._prefill(prefill, endpoint, to_prefill))
        prefill_task.add_done_callback(lambda _: _leave(prefill))
        decode_task = asyncio.ensure_future(self._open(decode, endpoint, to_decode))
        try:
            bad = await self._sent(ask, pair)
            if bad is not None:
                return bad
            opened = await self._settle(prefill_task, decode_task)
            if isinstance(opened, Failure):
                self._blame(opened)
                return opened
            try:
                return await self._relay(request, endpoint, opened, decode, ask.start)
            finally:
                opened.upstream.close()  # a client gone mid-stream: this aborts the decode's request
        finally:
            decode.in_flight -= 1
            for task in (prefill_task, decode_task):
                task.cancel()
            await _closed(decode_task)

    async def _try_shared(self, request, ask: Ask, pair: tuple[Backend, Backend]):
        """One try of a stream that the pair shares (`SharedStream`): the prefill's events of
        each request's first token go to the client as soon as they come, then the decode's of
        the rest. A failure before the first event is the caller's to retry; after
        it (the KV transfer's, or either instance's) it ends the stream with an error event."""
        prefill, decode = pair
        share = {"id": f"{random.getrandbits(96):024x}", "created": int(time.time())}
        data = ask.shared_body({**_bootstrap(prefill), "shared_stream": share})
        for backend in pair:
            backend.in_flight += 1
        endpoint, start = ask.endpoint, ask.start
        prefill_task = asyncio.ensure_future(self._open(prefill, endpoint, data))
        decode_task = asyncio.ensure_future(self._open(decode, endpoint, data))
        try:
            bad = await self._sent(ask, pair)
            if bad is not None:
                return bad
            opened = await self._settle_first(prefill_task, decode_task)
            if isinstance(opened, Failure):
                self._blame(opened)
                return opened
            if not opened.streamed and opened.upstream.status == 200:
                message = f"prefill {prefill.url} answered a shared stream whole"
                return Failure(502, message, False, prefill)
            if not opened.streamed:  # a 4xx answer
                return await self._relay(request, endpoint, opened, prefill, start)
            resp = await Stream(200, EventStream.HEADERS).prepare(request)
            first = time.perf_counter()
            failure = await self._prefill_events(resp, opened, prefill, decode_task)
            if failure is None:
                answer = await decode_task
                if isinstance(answer, Failure):
                    failure = answer
                elif not answer.streamed:
                    message = f"decode {decode.url} answered {answer.upstream.status}"
                    failure = Failure(502, message, False, decode)
                else:
                    return await self._relay(request, endpoint, answer, decode, start, resp, first)
            return await self._fail_stream(resp, endpoint, failure, start, first)
        except (ConnectionResetError, asyncio.CancelledError):
            self.metrics.requests.labels(ROUTES[endpoint], "client_gone").inc()
            raise
        finally:
            for backend in pair:
                backend.in_flight -= 1
            for task in (prefill_task, decode_task):
                task.cancel()
                await _closed(task)
                answer = _outcome(task)
                if isinstance(answer, Opened):  # a client gone: this aborts its request
                    answer.upstream.close()

    async def _sent(self, ask: Ask, pair: tuple[Backend, Backend]) -> Failure | None:
        """Once the try's two requests have left (on a kept connection each task writes its
        request on its first step: one turn of the loop; a new connection is still being made),
        the body's check if it is still to run (`Ask.check`): a bad body fails the try. The
        check's time so overlaps the instances' own reading of the body instead of delaying it
        (0.17 ms of the router's 0.8 on the way in at 1k tokens, H100 host)."""
        await asyncio.sleep(0)
        bad = ask.check()
        if bad is None:
            for backend in pair:
                self.metrics.sent(backend)
        return bad

    async def _settle_first(self, prefill_task, decode_task) -> Opened | Failure:
        """The prefill's opened stream (its first event), unless either side failed first
        (`_blamed`: which one takes the blame)."""
        await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
        if prefill_task.done() and isinstance(prefill_task.result(), Failure):
            return prefill_task.result()
        if decode_task.done() and isinstance(decode_task.result(), Failure):
            return await _blamed(decode_task.result(), prefill_task)
        return await prefill_task

    async def _prefill_events(
        self, resp: Stream, opened: Opened, prefill: Backend, decode_task
    ) -> Failure | None:
        """Relay the prefill's events (of the first tokens) until its stream ends: None when
        it ended well (the KV has left), else the Failure; the decode's failure meanwhile ends
        it at once. The events read with the first go out before anything is awaited."""
        reader = EventReader(opened.upstream, opened.head)
        ended = await self._pass_events(resp, reader, reader.ready(), prefill)
        if ended is not CONTINUE:
            return ended
        reading = asyncio.ensure_future(self._copy_events(resp, reader, prefill))
        try:
            await asyncio.wait({reading, decode_task}, return_when=asyncio.FIRST_COMPLETED)
            if not reading.done() and isinstance(decode_task.result(), Failure):
                return decode_task.result()
            return await reading
        finally:
            reading.cancel()
            await _closed(reading)

    async def _copy_events(self, resp, reader: EventReader, prefill: Backend) -> Failure | None:
        try:
            while events := await reader.batch():
                ended = await self._pass_events(resp, reader, events, prefill)
                if ended is not CONTINUE:
                    return ended
        except FAILED as e:
            return self._lost(prefill, e)
        message = f"prefill {prefill.url}: its stream ended before its last event"
        return Failure(502, message, False, prefill)

    async def _pass_events(self, resp, reader: EventReader, events: list[bytes], prefill: Backend):
        """The prefill's `events` (of `reader`) to the client up to its stream's end or an
        error event: then None (it ended well) or the Failure; else CONTINUE."""
        ends = [i for i, e in enumerate(events) if e == STREAM_END or event_error(e)]
        relayed = events[: ends[0]] if ends else events
        if relayed:
            await resp.write(b"".join(relayed))
        if not ends:
            return CONTINUE
        error = event_error(events[ends[0]])
        if error is None:
            prefill.breaker.success()
            reader.upstream.keep()  # its connection, for the prefill's next request
            return None
        return Failure(502, f"prefill {prefill.url}: {error}", False, prefill)

    async def _fail_stream(
        self, resp: Stream, endpoint: str, failure: Failure, start: float, first: float
    ) -> Stream:
        """A shared stream that failed after its first events: an error event ends it."""
        self._blame(failure)
        log.warning("a stream failed after its first token: %s", failure.message)
        self.metrics.answered(ROUTES[endpoint], "error", start, first)
        with contextlib.suppress(ConnectionResetError):
            await resp.write(error_event(failure.message, failure.status) + STREAM_END)
        return resp

    async def _settle(self, prefill_task, decode_task) -> Opened | Failure:
        """The decode's opened answer, unless either side failed first (`_blamed`: which one
        takes the blame)."""
        await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
        if prefill_task.done() and prefill_task.result() is not None:
            return prefill_task.result()
        opened = await decode_task
        if isinstance(opened, Failure):
            return await _blamed(opened, prefill_task)
        return opened

    def _blame(self, failure: Failure) -> None:
        """A 5xx or a lost connection counts against the instance's circuit breaker."""
        backend = failure.backend
        if backend is None or failure.status < 500:
            return
        backend.breaker.failure(time.monotonic())
        if backend.breaker.failures == self.config.cb_failure_threshold:
            log.warning(
                "%s: circuit open after %d failures in a row", backend.url, backend.breaker.failures
            )

    async def _prefill(self, backend: Backend, endpoint: str, body: bytes) -> Failure | None:
        """None when the prefill succeeded, else its Failure. The prefill answers whole (its
        answer is only a sign that the KV left)."""
        try:
            answer = await self.upstreams.post(backend.url + endpoint, body)
            try:
                raw = await answer.read()
            finally:
                answer.close()
            if answer.status == 200:
                backend.breaker.success()
                return None
            return _answer_failure(backend, answer.status, raw)
        except FAILED as e:
            return self._lost(backend, e)

    async def _open(self, backend: Backend, endpoint: str, body: bytes) -> Opened | Failure:
        """POST to the decode and read until its answer is sure: a whole body, or a stream's
        first event (an error event instead of tokens is a Failure)."""
        try:
            upstream = await self.upstreams.post(backend.url + endpoint, body)
        except FAILED as e:
            return self._lost(backend, e)
        try:
            streamed = upstream.content_type.startswith("text/event-stream")
            if upstream.status != 200 or not streamed:
                head = await upstream.read()
                if upstream.status >= 500:
                    upstream.close()
                    return _answer_failure(backend, upstream.status, head)
                return Opened(upstream, head, False)
            head = await first_event(upstream)
            error = event_error(head)
            if error is not None:
                upstream.close()
                return Failure(500, f"{backend.role} {backend.url}: {error}", True, backend)
            return Opened(upstream, head, True)
        except FAILED as e:
            upstream.close()
            return self._lost(backend, e)
        except asyncio.CancelledError:
            upstream.close()  # the other side failed first: dropping the connection aborts it
            raise

    def _lost(self, backend: Backend, error: Exception) -> Failure:
        """The connection failed: the instance leaves rotation until a probe finds it back."""
        if backend.healthy:
            log.warning("%s is out of rotation (%s)", backend.url, type(error).__name__)
        backend.healthy = False
        message = f"{backend.role} {backend.url} failed: {type(error).__name__}: {error}"
        return Failure(502, message, True, backend, lost=True)

    async def _relay(
        self,
        request,
        endpoint: str,
        opened: Opened,
        decode: Backend,
        start: float,
        resp: Stream | None = None,
        first: float | None = None,
    ) -> Stream | Reply:
        """The decode's answer to the client; `resp`: a stream the client has its first events
        of already (sent at `first`)."""
        upstream = opened.upstream
        outcome = "ok" if upstream.status == 200 else "bad_request"
        if upstream.status == 200:
            decode.breaker.success()
        if not opened.streamed:
            self.metrics.answered(ROUTES[endpoint], outcome, start, first=time.perf_counter())
            return Reply(upstream.status, opened.head, upstream.content_type or "application/json")
        if resp is None:
            resp = await Stream(upstream.status, EventStream.HEADERS).prepare(request)
        await resp.write(opened.head)
        first = first or time.perf_counter()
        answered = False  # the stream's last event went out: the client may leave now
        try:
            while data := await upstream.readany():
                await resp.write(data)
                if not answered and STREAM_END in data:
                    answered = True
                    self.metrics.answered(ROUTES[endpoint], outcome, start, first)
        except (ConnectionResetError, asyncio.CancelledError):
            if not answered:
                self.metrics.requests.labels(ROUTES[endpoint], "client_gone").inc()
            raise
        except FAILED as e:  # tokens went out: no retry
            if answered:
                return resp  # the upstream failed after its last event: the answer is whole
            outcome = "error"
            message = f"decode {decode.url} failed mid-stream: {type(e).__name__}"
            await resp.write(error_event(message, 502) + STREAM_END)
        if not answered:
            self.metrics.answered(ROUTES[endpoint], outcome, start, first)
        return resp


def _json_body(fields: dict, rest: bytes) -> bytes:
    """One JSON object of `fields` and the fields of `rest` (a JSON object with none of the
    same name)."""
    head, inner = orjson.dumps(fields), rest.strip()[1:-1].strip()
    return head[:-1] + b"," + inner + b"}" if inner else head


def _bootstrap(prefill: Backend) -> dict:
    """The fields that send a request's KV from `prefill`, under a fresh room."""
    return {
        "bootstrap_host": prefill.host,
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": random.getrandbits(63),
    }


def _leave(backend: Backend) -> None:
    backend.in_flight -= 1


async def _blamed(failure: Failure, prefill_task: asyncio.Task) -> Failure:
    """A decode's failure, or its prefill's: a decode that answers with an error may have
    failed for its prefill (which it reaches for the KV), so the prefill has `BLAME_GRACE_S`
    to say so and takes the blame if it failed too. A lost connection is the decode's own."""
    if failure.lost:
        return failure
    await asyncio.wait({prefill_task}, timeout=BLAME_GRACE_S)
    if prefill_task.done() and isinstance(prefill_task.result(), Failure):
        return prefill_task.result()
    return failure


def _outcome(task: asyncio.Task):
    """A finished task's result; None when it was cancelled or raised."""
    if task.cancelled() or task.exception() is not None:
        return None
    return task.result()


async def _closed(task: asyncio.Task) -> None:
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def _answer_failure(backend: Backend, status: int, raw: bytes) -> Failure:
    """An instance's error answer: 4xx relayed as it is, 5xx tried again elsewhere."""
    text = raw.decode(errors="replace")
    with contextlib.suppress(ValueError, KeyError, TypeError):
        text = json.loads(text)["error"]["message"]
    message = f"{backend.role} {backend.url} failed: {text}"
    if status < 500:
        return Failure(status, text, False, backend)
    return Failure(status if status == 503 else 502, message, True, backend)
