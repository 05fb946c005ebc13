"""The router's requests to its instances: a lean HTTP/1.1 client on kept connections.

A request's first token waits for one upstream request (the prefill's) and the relay of its
first event. Here a request leaves in one write (head and body, before the caller's next
await), its answer is parsed by hand (status line, headers, then a body of a Content-Length,
chunked, or up to the connection's end), and a connection that finished an answer is kept for
the instance's next request (`Response.keep`: also one whose caller stopped at its last
event). Against aiohttp's client the router's hop at 1k-token prompts went from 0.74 to 0.53
ms on a 2-core host, 1.42 to 1.10 at 16k (`bench.router_overhead`,
bench/notes/session37-h100-2026-11-27.md).

Its scope is the instances' own answers (aiohttp servers: JSON with a Content-Length, event
streams chunked). Errors: `UpstreamError` (a ConnectionError) for a connection refused or lost
and an answer that is not HTTP; `asyncio.TimeoutError` past the request's deadline (the
connection is dropped then). `Response.close()` before the end of an answer drops its
connection: the instance sees its client leave and aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from urllib.parse import urlsplit

KEEP_IDLE_S = 15.0  # a kept connection idle longer is closed, not reused (aiohttp's default)
KEEP_WAIT_S = 1.0  # `Response.keep`: how long the end of an answer may take to come
MAX_HEAD_BYTES = 64 * 1024  # a status line and headers longer than this are not an answer


class UpstreamError(ConnectionError):
    """A connection to an instance failed, or its answer was not HTTP."""


class _Connection(asyncio.Protocol):
    """One TCP connection: what it received and not yet parsed, and a
    waiter for more."""

    def __init__(self, key: tuple[str, int]):
        self.key, self.buffer = key, bytearray()
        self.transport: asyncio.Transport | None = None
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.idle_since = time.monotonic()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._wake()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc) -> None:
        if self.error is None:
            self.error = UpstreamError(f"the connection to {self.key} was lost: {exc or 'closed'}")
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def more(self) -> None:
        """Until more bytes came; the connection's error if it ended
        with none."""
        size = len(self.buffer)
        if self.error is None:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        if len(self.buffer) == size and self.error is not None:
            raise self.error

    def expire(self) -> None:
        """The request's deadline passed: the connection is dropped."""
        self.error = asyncio.TimeoutError("the instance's answer took too long")
        self.close()

    def close(self) -> None:
        if self.error is None:
            self.error = UpstreamError(f"the connection to {self.key} was closed")
        if self.transport is not None:
            self.transport.close()
        self._wake()

    @property
    def reusable(self) -> bool:
        fresh = time.monotonic() - self.idle_since < KEEP_IDLE_S
        return self.error is None and fresh and not self.transport.is_closing()


class Response:
    """An instance's answer: `status`, `headers` (lower-case names),
    `content_type` (without parameters), its body read by `readany` and
    `read`; `close` drops an answer not read to its end, `keep` reads that
    end in the background."""

    def __init__(self, conn: _Connection, pool: Upstreams, head: bytes, timer):
        self._conn, self._pool, self._timer = conn, pool, timer
        status_line, *lines = head.decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            conn.close()
            raise UpstreamError(f"not an HTTP answer: {status_line[:80]!r}")
        self.status = int(parts[1])
        self.headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self.content_type = self.headers.get("content-type", "").split(";")[0].strip()
        self._keep = parts[0] == "HTTP/1.1" and self.headers.get("connection") != "close"
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        length = self.headers.get("content-length")
        if length and not length.isdigit():
            conn.close()
            raise UpstreamError(f"not a Content-Length: {length[:40]!r}")
        self._left = int(length) if length and not self._chunked else None  # None: not counted
        self._chunk_left = 0  # bytes of the current chunk still to come (chunked)
        self._done = self._keeping = False
        if self._left == 0 or self.status in (204, 304):
            self._finish()

    async def readany(self) -> bytes:
        """The body's next bytes (as many as have come); b"" at its end."""
        while not self._done:
            conn = self._conn
            if conn is None:
                raise UpstreamError("the answer was closed before its end")
            data = self._take(conn.buffer)
            if data or self._done:
                return data
            try:
                await conn.more()
            except UpstreamError:
                if self._left is None and not self._chunked:  # a body up to the end
                    self._finish(keep=False)
                    return b""
                raise
        return b""

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    def close(self) -> None:
        """Drop the connection unless the answer ended (then it is kept) or
        its end is being read (`keep`)."""
        if self._conn is not None and not self._done and not self._keeping:
            self._timer.cancel()
            self._conn.close()
            self._conn = None

    def keep(self, within_s: float = KEEP_WAIT_S) -> None:
        """The caller has what it needs (a stream's last event): the rest of
        the answer (its end) is read in the background, so that the
        connection is kept; it is dropped if that takes over `within_s`."""
        if self._conn is None or self._done or self._keeping:
            return
        self._keeping = True
        self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + within_s, self._conn.expire)
        self._pool.track(self._read_to_end())

    async def _read_to_end(self) -> None:
        with contextlib.suppress(UpstreamError, asyncio.TimeoutError):
            await self.read()
        self._keeping = False
        self.close()

    def _take(self, buffer: bytearray) -> bytes:
        """The body bytes `buffer` holds, consumed (the end of the answer
        releases the connection)."""
        if not self._chunked:
            n = len(buffer) if self._left is None else min(len(buffer), self._left)
            data = bytes(buffer[:n])
            del buffer[:n]
            if self._left is not None:
                self._left -= n
                if self._left == 0:
                    self._finish()
            return data
        out = bytearray()
        while not self._done:
            if self._chunk_left:
                n = min(len(buffer), self._chunk_left)
                if not n:
                    break
                out += buffer[:n]
                del buffer[:n]
                self._chunk_left -= n
                continue
            if not self._next_chunk(buffer):
                break
        return bytes(out)

    def _next_chunk(self, buffer: bytearray) -> bool:
        """Consumes a chunk's size line (and the line end of the chunk
        before it): False until a whole line is there."""
        start = 2 if buffer[:2] == b"\r\n" else 0
        try:
            found = chunk_size(buffer, start)
        except ValueError as e:
            self._conn.close()
            raise UpstreamError(str(e)) from None
        if found is None:
            return False
        size, end = found
        if size == 0:  # the last chunk: no trailers (the instances send none)
            if len(buffer) < end + 4:
                return False
            del buffer[: end + 4]
            self._finish()
            return True
        del buffer[: end + 2]
        self._chunk_left = size
        return True

    def _finish(self, keep: bool = True) -> None:
        self._done = True
        self._timer.cancel()
        conn, self._conn = self._conn, None
        if keep and self._keep and not conn.buffer:
            self._pool.release(conn)
        else:
            conn.close()


class Upstreams:
    """Kept connections to instances, and requests over them."""

    def __init__(self, request_timeout_s: float, connect_timeout_s: float = 10.0):
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        # per instance, its kept connections, the longest idle first
        self.idle: dict[tuple[str, int], deque[_Connection]] = {}
        self.reading: set[asyncio.Task] = set()  # answers' ends read to keep their connections

    async def post(self, url: str, body: bytes) -> Response:
        """POST `body` (JSON) to `url` (http://host:port/path); returns
        once the answer's head has come."""
        parts = urlsplit(url)
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        conn = self._kept(key) or await self._connect(key)
        head = (
            f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {key[0]}:{key[1]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        conn.transport.write(head.encode() + body)
        loop = asyncio.get_running_loop()
        timer = loop.call_at(loop.time() + self.request_timeout_s, conn.expire)
        try:
            return Response(conn, self, await _head(conn), timer)
        except BaseException:  # cancelled too: the request is dropped with its connection
            timer.cancel()
            conn.close()
            raise

    def track(self, reading) -> None:
        task = asyncio.ensure_future(reading)
        self.reading.add(task)
        task.add_done_callback(self.reading.discard)

    def release(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        conns = self.idle.setdefault(conn.key, deque())
        conns.append(conn)
        while conns and not conns[0].reusable:  # idle too long, or closed by the instance
            conns.popleft().close()

    def close(self) -> None:
        for task in self.reading:
            task.cancel()
        for conns in self.idle.values():
            for conn in conns:
                conn.close()
        self.idle.clear()

    def _kept(self, key) -> _Connection | None:
        conns = self.idle.get(key, ())
        while conns:
            conn = conns.pop()
            if conn.reusable:
                return conn
            conn.close()
        return None

    async def _connect(self, key) -> _Connection:
        loop = asyncio.get_running_loop()
        connect = loop.create_connection(lambda: _Connection(key), *key)
        try:
            _, conn = await asyncio.wait_for(connect, self.connect_timeout_s)
        except OSError as e:
            raise UpstreamError(f"cannot connect to {key[0]}:{key[1]}: {e}") from e
        return conn


def chunk_size(buffer: bytearray, at: int) -> tuple[int, int] | None:
    """(the size of the chunk whose size line starts at `at`, where that line ends), None until
    the line has come; ValueError for a size that is not hexadecimal (chunked HTTP/1.1 bodies:
    the instances' answers here, the clients' requests in `downstream.py`)."""
    end = buffer.find(b"\r\n", at)
    if end < 0:
        return None
    size_text = bytes(buffer[at:end]).split(b";")[0].strip()
    try:
        return int(size_text, 16), end
    except ValueError:
        raise ValueError(f"not a chunk size: {size_text[:40]!r}") from None


async def _head(conn: _Connection) -> bytes:
    """The answer's status line and headers (consumed from the buffer)."""
    while True:
        end = conn.buffer.find(b"\r\n\r\n")
        if end >= 0:
            head = bytes(conn.buffer[:end])
            del conn.buffer[: end + 4]
            return head
        if len(conn.buffer) > MAX_HEAD_BYTES:
            raise UpstreamError("an answer's head is too long")
        await conn.more()
