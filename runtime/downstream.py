"""The router's HTTP/1.1 server for its clients: lean, as `upstream.py` is its client.

On the H100 host, where each leg of a request runs cold (the router sleeps while the prefill
computes), aiohttp's server took ~0.25 ms of the router's hop before its handler had a 1k-token
body and ~0.19 ms to send a stream's first event (`prepare`, then `write`;
bench/notes/session40-h100-2026-11-27.md). Here a connection's bytes are parsed by hand
(request line, headers, a body of a Content-Length or chunked), its requests are answered one
after another (pipelined ones too, as HTTP/1.1 has it), and an answer leaves in one write: whole
(`Reply`), or as it is made (`Stream`: chunked, its head with its first part).

Its scope is what clients of an inference API send. `Expect: 100-continue` is answered; HTTP/1.0
and `Connection: close` end the connection after the answer; so do a malformed request (a 400)
and a body over the limit (the handler gets the request unread, `Request.too_large`). A client
that leaves cancels its handler (as aiohttp's `handler_cancellation`), one that reads nothing of
an answer for `STALL_S` is dropped; a connection idle for `IDLE_S` is closed. HEAD is answered as GET without the body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Awaitable, Callable
from urllib.parse import urlsplit

import orjson

from dserve.runtime.protocol import error_body
from dserve.runtime.upstream import chunk_size

log = logging.getLogger("dserve.router")
MAX_HEAD_BYTES = 64 * 1024  # a request line and headers longer than this are a 400
IDLE_S = 75.0  # a kept connection idle longer is closed (aiohttp's keep-alive timeout)
STALL_S = 60.0  # a client that takes none of an answer's bytes this long is dropped
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@dataclass
class Request:
    """A client's request: the path without its query, lower-case header names (a repeated
    header's values joined by commas), the whole body."""

    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    version: str = "HTTP/1.1"
    body: bytes = b""
    too_large: bool = False  # a body over the server's limit, not read
    keep_alive: bool = True
    malformed: str | None = None  # why it could not be parsed (answered 400)
    conn: Connection | None = field(default=None, repr=False)

    async def read(self) -> bytes:
        return self.body


@dataclass
class Reply:
    """A whole answer."""

    status: int
    body: bytes
    content_type: str = "application/json"


def json_reply(value, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(value))


Handler = Callable[[Request], Awaitable["Reply | Stream"]]


class Stream:
    """An answer sent as it is made, chunked (to an HTTP/1.0 client: up to the connection's
    end): its head leaves with the first `write` (in one write, as the instances'
    `EventStream`). A client gone: `write` raises ConnectionResetError."""

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None):
        self.status, self.headers = status, headers or {}
        self._conn: Connection | None = None
        self._head_sent = False
        self._chunked = True

    async def prepare(self, request: Request) -> Stream:
        self._conn = request.conn
        self._chunked = request.version != "HTTP/1.0"
        if not request.keep_alive:
            self.headers = {**self.headers, "Connection": "close"}
        return self

    async def write(self, data: bytes) -> None:
        conn = self._conn
        if conn is None or conn.closed:
            raise ConnectionResetError("the client left")
        if data and self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        conn.answering = True
        conn.transport.write(self._head() + data)
        if conn.paused:
            await conn.drained()

    def end(self) -> bytes:
        """The last chunk (with the head if nothing was written)."""
        return self._head() + (b"0\r\n\r\n" if self._chunked else b"")

    def _head(self) -> bytes:
        if self._head_sent:
            return b""
        self._head_sent = True
        lines = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items()).encode()
        return status_line(self.status) + lines + (CHUNKED if self._chunked else b"\r\n")


CHUNKED = b"Transfer-Encoding: chunked\r\n\r\n"


def status_line(status: int) -> bytes:
    return _STATUS_LINES.get(status) or f"HTTP/1.1 {status} {_phrase(status)}\r\n".encode()


def _phrase(status: int) -> str:
    with contextlib.suppress(ValueError):
        return HTTPStatus(status).phrase
    return "Unknown"


_STATUS_LINES = {s: f"HTTP/1.1 {s} {_phrase(s)}\r\n".encode() for s in (200, 400, 404, 503)}


class Server:
    """Routes ((method, path) -> handler) and the body limit, for every connection."""

    def __init__(self, routes: dict[tuple[str, str], Handler], max_body: int):
        self.routes, self.max_body = routes, max_body
        self.paths = {path for _, path in routes}

    def handler(self, request: Request) -> Handler | None:
        method = "GET" if request.method == "HEAD" else request.method
        return self.routes.get((method, request.path))

    async def answer(self, request: Request) -> Reply | Stream:
        if request.malformed is not None:
            return json_reply(error_body(request.malformed, 400), 400)
        handler = self.handler(request)
        if handler is None:
            status = 405 if request.path in self.paths else 404
            what = "not allowed" if status == 405 else "not found"
            message = f"{request.method} {request.path}: {what}"
            return json_reply(error_body(message, status), status)
        return await handler(request)


async def serve(server: Server, sock) -> asyncio.AbstractServer:
    """Accept connections on `sock` (bound) for `server`."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: Connection(server), sock=sock)


class Connection(asyncio.Protocol):
    """One client connection: its bytes not yet parsed, the requests parsed and not yet
    answered, the task answering them in order."""

    def __init__(self, server: Server):
        self.server = server
        self.buffer = bytearray()
        self.requests: deque[Request] = deque()
        self.transport = None
        self.task: asyncio.Task | None = None
        self.closed = self.paused = self.reading_done = False
        self.answering = False  # the current answer's first bytes went out
        self.head: tuple[Request, int | None] | None = None  # parsed, its body still coming
        self._drain: asyncio.Future | None = None
        self._idle: asyncio.TimerHandle | None = None

    # ---- the protocol -----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self._idle_from_now()

    def data_received(self, data: bytes) -> None:
        if self.reading_done:
            return
        self.buffer += data
        while not self.reading_done and (request := self._parse()) is not None:
            request.conn = self
            self.requests.append(request)
            if not request.keep_alive:
                self.reading_done = True  # its answer ends the connection
        if self.requests and self.task is None:
            if self._idle is not None:
                self._idle.cancel()
            self.task = asyncio.ensure_future(self._answer_all())

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.task is not None:
            self.task.cancel()  # the client left: its handler stops (its requests abort)
        if self._idle is not None:
            self._idle.cancel()
        self._wake_writer()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake_writer()

    async def drained(self) -> None:
        """Until the transport takes writes again (or the client left); a client that reads
        nothing for `STALL_S` is dropped, as one that left."""
        if self.paused and not self.closed:
            self._drain = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self._drain, STALL_S)
            except asyncio.TimeoutError:
                log.warning("a client read nothing for %.0f s: dropped", STALL_S)
                self.transport.abort()
                self.closed = True
        if self.closed:
            raise ConnectionResetError("the client left")

    def _wake_writer(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def _idle_from_now(self) -> None:
        loop = asyncio.get_running_loop()
        self._idle = loop.call_later(IDLE_S, self.transport.close)

    # ---- answering --------------------------------------------------------------------------
    async def _answer_all(self) -> None:
        while self.requests and not self.closed:
            request, self.answering = self.requests.popleft(), False
            try:
                answer = await self.server.answer(request)
            except asyncio.CancelledError:
                return
            except Exception:  # noqa: BLE001 - the client gets a 500, the server goes on
                log.exception("a handler failed on %s %s", request.method, request.path)
                if self.answering:  # a stream cut short: only closing tells the client
                    self.transport.close()
                    return
                answer = json_reply(error_body("the router failed on this request", 500), 500)
            if self.closed:
                return
            self.transport.write(_bytes_of(answer, request))
            if not request.keep_alive:
                self.transport.close()
                return
        self.task = None
        if not self.closed:
            self._idle_from_now()

    # ---- parsing ----------------------------------------------------------------------------
    def _parse(self) -> Request | None:
        """The next whole request in the buffer (consumed), or None until it has come."""
        if self.head is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    return _malformed("the request's head is too long")
                return None
            head = bytes(self.buffer[:end])
            del self.buffer[: end + 4]
            self.head = _head(head, self.server.max_body)
            request, length = self.head
            if request.malformed or request.too_large:
                self.head = None
                return request
            coming = length is None or len(self.buffer) < length
            if coming and request.headers.get("expect", "").lower() == "100-continue":
                self.transport.write(CONTINUE)
        request, length = self.head
        try:
            whole = _body(self.buffer, length, self.server.max_body)
        except _TooLarge:
            self.head = None
            request.too_large, request.keep_alive = True, False
            return request
        except ValueError as e:
            self.head = None
            return _malformed(str(e))
        if whole is None:
            return None
        request.body, used = whole
        del self.buffer[:used]
        self.head = None
        return request

    def __repr__(self) -> str:
        return f"Connection({len(self.requests)} waiting)"


class _TooLarge(Exception):
    """A chunked body past the server's limit."""


def _head(head: bytes, max_body: int) -> tuple[Request, int | None]:
    """The request of a head (its body still to read) and the body's length (None: chunked)."""
    line, *lines = head.decode("latin-1").split("\r\n")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return _malformed(f"not an HTTP/1.x request line: {line[:80]!r}"), 0
    method, target, version = parts
    headers: dict[str, str] = {}
    for text in lines:
        name, colon, value = text.partition(":")
        if not colon or not name or name != name.strip():
            return _malformed(f"not a header: {text[:80]!r}"), 0
        name, value = name.lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    connection = headers.get("connection", "").lower()
    keep = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    if not target.startswith("/"):  # absolute form (through a proxy)
        target = urlsplit(target).path or "/"
    request = Request(method, target.split("?", 1)[0], headers, version, keep_alive=keep)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return request, None
    length = headers.get("content-length", "0")
    if not length.isdigit():
        return _malformed(f"not a Content-Length: {length[:40]!r}"), 0
    if int(length) > max_body:
        request.too_large, request.keep_alive = True, False
    return request, int(length)


def _body(buffer: bytearray, length: int | None, max_body: int) -> tuple[bytes, int] | None:
    """The body at the start of `buffer` (`length` bytes, None: chunked), whole: (the body, the
    bytes it took), or None until it has come. Raises _TooLarge past `max_body` and ValueError
    for a chunk size that is not one."""
    if length is not None:
        return (bytes(buffer[:length]), length) if len(buffer) >= length else None
    parts, at, total = [], 0, 0
    while True:
        found = chunk_size(buffer, at)
        if found is None:
            return None
        size, end = found
        total += size
        if total > max_body:
            raise _TooLarge
        if size == 0:  # the last chunk, then trailers (if any) up to an empty line
            last = buffer.find(b"\r\n\r\n", end)
            return None if last < 0 else (b"".join(parts), last + 4)
        if len(buffer) < end + 2 + size + 2:
            return None
        parts.append(bytes(buffer[end + 2 : end + 2 + size]))
        at = end + 2 + size + 2


def _malformed(why: str) -> Request:
    return Request("", "", keep_alive=False, malformed=why)


def _bytes_of(answer: Reply | Stream, request: Request) -> bytes:
    """What is left to send of `answer` (a stream's last chunk; a reply whole)."""
    if isinstance(answer, Stream):
        return answer.end()
    close = b"" if request.keep_alive else b"Connection: close\r\n"
    head = status_line(answer.status) + b"Content-Type: %b\r\nContent-Length: %d\r\n%b\r\n" % (
        answer.content_type.encode(),
        len(answer.body),
        close,
    )
    return head if request.method == "HEAD" else head + answer.body
