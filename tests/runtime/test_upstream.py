"""The router's HTTP client (`runtime/upstream.py`) against a raw TCP server that answers as
each test scripts it: bodies of every framing in pieces of any size, kept and dropped
connections, and what a caller gets when the instance fails, is gone or takes too long."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from dserve.runtime.upstream import UpstreamError, Upstreams
from tests.runtime.stubs import StubInstance


class Script:
    """A server on a free port: each connection's requests are answered by `answer(head, body,
    writer)`, which may return "close" (the connection ends) or "hold" (the answer never ends:
    the server waits for the client to leave). It counts connections and notes a client that
    left (`dropped`)."""

    def __init__(self, answer):
        self.answer, self.connections, self.dropped = answer, 0, asyncio.Event()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/generate"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                then = await self.answer(head, body, writer)
                if then == "hold":
                    await reader.read()  # until the client leaves
                    self.dropped.set()
                if then in ("close", "hold"):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.dropped.set()
        writer.close()


def chunked(*parts: bytes, piece: int = 0) -> list[bytes]:
    """A chunked answer's bytes, cut into pieces of `piece` bytes (0: one piece a chunk)."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked"
    raw = [head + b"\r\n\r\n"]
    raw += [b"%x\r\n%s\r\n" % (len(p), p) for p in parts] + [b"0\r\n\r\n"]
    if not piece:
        return raw
    joined = b"".join(raw)
    return [joined[i : i + piece] for i in range(0, len(joined), piece)]


async def send(writer, pieces: list[bytes]) -> None:
    for piece in pieces:
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(0)


@pytest.mark.parametrize("piece", [0, 1, 3, 7])
def test_chunked_answers_in_any_pieces_and_the_connection_is_kept(piece):
    events = [b'data: {"text": "a"}\n\n', b"data: [DONE]\n\n"]

    async def answer(head, body, writer):
        await send(writer, chunked(*events, piece=piece))

    async def main():
        async with Script(answer) as server:
            upstreams = Upstreams(request_timeout_s=5)
            for _ in range(3):
                resp = await upstreams.post(server.url, b'{"x": 1}')
                assert (resp.status, resp.content_type) == (200, "text/event-stream")
                assert await resp.read() == b"".join(events)
            assert server.connections == 1  # one connection served all three
            upstreams.close()

    asyncio.run(main())


def test_content_length_and_read_to_the_end_bodies():
    async def answer(head, body, writer):
        if b'"close"' in body:  # no length: the body ends with the connection
            writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n")
            await send(writer, [b'{"text": ', b'"b"}'])
            return "close"
        text = b'{"echo": %s}' % body
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json; charset=utf-8")
        await send(writer, [b"\r\nContent-Length: %d\r\n\r\n" % len(text), text])

    async def main():
        async with Script(answer) as server:
            upstreams = Upstreams(request_timeout_s=5)
            resp = await upstreams.post(server.url, b"1")
            assert (resp.status, resp.content_type) == (400, "application/json")
            assert await resp.read() == b'{"echo": 1}'
            resp = await upstreams.post(server.url, b'"close"')
            assert await resp.read() == b'{"text": "b"}'
            resp = await upstreams.post(server.url, b"2")  # the closed one is not reused
            assert await resp.read() == b'{"echo": 2}'
            assert server.connections == 2
            upstreams.close()

    asyncio.run(main())


def test_closing_a_stream_early_drops_its_connection():
    """The instance sees its client leave (what aborts its request and frees its pages)."""

    async def answer(head, body, writer):
        await send(writer, chunked(b"data: 1\n\n")[:2])
        return "hold"

    async def main():
        async with Script(answer) as server:
            upstreams = Upstreams(request_timeout_s=60)
            resp = await upstreams.post(server.url, b"{}")
            assert await resp.readany() == b"data: 1\n\n"
            resp.close()
            await asyncio.wait_for(server.dropped.wait(), 5)
            assert not any(upstreams.idle.values())  # not kept
            upstreams.close()

    asyncio.run(main())


def test_failures_are_upstream_errors_or_timeouts():
    async def answer(head, body, writer):
        if body == b"garbage":
            writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        elif body == b"no length":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n")
        elif body == b"cut":  # the instance dies mid-answer
            writer.write(chunked(b"data: 1\n\n")[0] + b"20\r\npartial")
            await writer.drain()
            return "close"
        elif body == b"slow":
            return "hold"

    async def main():
        async with Script(answer) as server:
            upstreams = Upstreams(request_timeout_s=0.5)
            with pytest.raises(UpstreamError, match="not an HTTP answer"):
                await upstreams.post(server.url, b"garbage")
            with pytest.raises(UpstreamError, match="not a Content-Length"):
                await upstreams.post(server.url, b"no length")
            resp = await upstreams.post(server.url, b"cut")
            with pytest.raises(UpstreamError, match="lost"):
                await resp.read()
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(asyncio.TimeoutError):
                await upstreams.post(server.url, b"slow")
            assert loop.time() - start < 2
            await asyncio.wait_for(server.dropped.wait(), 5)  # the slow one's connection dropped
            server.server.close()
            await server.server.wait_closed()
            with pytest.raises(UpstreamError, match="cannot connect"):
                await upstreams.post(server.url, b"{}")
            upstreams.close()

    asyncio.run(main())


def test_an_aiohttp_instance_streams_through_kept_connections():
    """The instances' own server (aiohttp): JSON answers and chunked event streams."""

    async def generate(request: web.Request):
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"n": body["n"]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["n"]):
            await resp.write(b"data: %d\n\n" % i)
        return resp

    async def main():
        instance = StubInstance(generate)
        await instance.start()
        url = instance.url + "/generate"
        upstreams = Upstreams(request_timeout_s=5)
        try:
            for n in (1, 5, 200):
                resp = await upstreams.post(url, b'{"n": %d, "stream": true}' % n)
                got = await resp.read()
                assert got == b"".join(b"data: %d\n\n" % i for i in range(n))
                resp = await upstreams.post(url, b'{"n": %d}' % n)
                assert await resp.read() == b'{"n": %d}' % n
            assert sum(len(conns) for conns in upstreams.idle.values()) == 1
        finally:
            upstreams.close()
            await instance.stop()

    asyncio.run(main())


def test_a_kept_answer_reads_its_end_in_the_background():
    """`keep` once the caller has its last event: the end that follows keeps the connection
    for the next request; an end that does not come in time drops it."""
    last = b"data: [DONE]\n\n"

    async def answer(head, body, writer):
        raw = chunked(last)
        writer.write(b"".join(raw[:2]))
        await writer.drain()
        if body == b"late":
            return "hold"  # its end never comes
        await asyncio.sleep(0.05)
        writer.write(raw[2])

    async def main():
        async with Script(answer) as server:
            upstreams = Upstreams(request_timeout_s=5)
            for _ in range(2):
                resp = await upstreams.post(server.url, b"{}")
                assert await resp.readany() == last
                resp.keep()
                resp.close()  # the caller's usual close: the end is still read
                await asyncio.sleep(0.2)
                assert sum(map(len, upstreams.idle.values())) == 1
            assert server.connections == 1
            resp = await upstreams.post(server.url, b"late")
            assert await resp.readany() == last
            resp.keep(within_s=0.1)
            await asyncio.wait_for(server.dropped.wait(), 5)
            assert not any(upstreams.idle.values()) and not upstreams.reading
            upstreams.close()

    asyncio.run(main())


def test_connections_kept_too_long_or_closed_are_let_go(monkeypatch):
    """After a burst, the connections the next requests do not take are closed once idle
    longer than KEEP_IDLE_S (or closed by the instance), not kept for ever."""
    from dserve.runtime import upstream

    async def answer(head, body, writer):
        await send(writer, chunked(b"data: [DONE]\n\n"))

    async def main():
        async with Script(answer) as server:
            upstreams = Upstreams(request_timeout_s=5)
            burst = [upstreams.post(server.url, b"{}") for _ in range(5)]
            for resp in await asyncio.gather(*burst):
                await resp.read()
            (conns,) = upstreams.idle.values()
            assert len(conns) == 5 and server.connections == 5
            monkeypatch.setattr(upstream, "KEEP_IDLE_S", 0.05)
            await asyncio.sleep(0.1)
            resp = await upstreams.post(server.url, b"{}")  # a fresh connection
            await resp.read()
            assert len(conns) == 1 and server.connections == 6
            upstreams.close()

    asyncio.run(main())
