"""`runtime/downstream.py`, the router's HTTP/1.1 server, over real sockets with raw requests:
kept connections, pipelined requests answered in order, chunked bodies, `Expect:
100-continue`, HEAD, 404 / 405, malformed requests and bodies over the limit (a 400 or the
handler's answer, then the connection closes), HTTP/1.0, a handler's failure (a 500, the
server goes on), streams (chunked; a client that leaves cancels its handler) and a stream
written faster than its client reads (it waits) or to one that reads nothing (dropped after
`STALL_S`)."""

from __future__ import annotations

import asyncio
import socket

import orjson

from dserve.runtime import downstream
from dserve.runtime.downstream import Connection, Reply, Server, Stream, json_reply, serve

LIMIT = 1000
BIG = 256  # chunks of 64 KB: more than loopback sockets buffer


def handlers(seen: list):
    async def echo(request):
        seen.append(request)
        if request.too_large:
            return json_reply({"too_large": True}, 400)
        return Reply(200, request.body, "text/plain")

    async def hello(request):
        return json_reply({"hello": request.path})

    async def events(request):
        resp = await Stream(200, {"Content-Type": "text/event-stream"}).prepare(request)
        for i in range(3):
            await resp.write(b"data: %d\n\n" % i)
        return resp

    async def forever(request):
        resp = await Stream(200).prepare(request)
        await resp.write(b"first")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        return resp

    async def fails(request):
        raise RuntimeError("boom")

    async def big(request):
        resp = await Stream(200).prepare(request)
        try:
            for _ in range(BIG):
                await resp.write(b"x" * 65536)
        except ConnectionResetError:
            seen.append("dropped")
            raise
        return resp

    return {
        ("POST", "/echo"): echo,
        ("GET", "/hello"): hello,
        ("GET", "/events"): events,
        ("GET", "/forever"): forever,
        ("GET", "/fails"): fails,
        ("GET", "/big"): big,
    }


def run(scenario):
    """`scenario(port, seen)` against a server on a free port."""

    async def main():
        seen = []
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = await serve(Server(handlers(seen), LIMIT), sock)
        try:
            await asyncio.wait_for(scenario(sock.getsockname()[1], seen), 20)
        finally:
            server.close()

    asyncio.run(main())


async def answer(reader) -> tuple[int, dict, bytes]:
    """One answer off `reader`: status, headers, body (Content-Length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    line, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines if x)}
    if "content-length" in headers:
        return (
            int(line.split()[1]),
            headers,
            await reader.readexactly(int(headers["content-length"])),
        )
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        data = await reader.readexactly(size + 2)
        if not size:
            return int(line.split()[1]), headers, body
        body += data[:-2]


def post(path: str, body: bytes, extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


async def closed(reader) -> bool:
    return await asyncio.wait_for(reader.read(), 5) == b""


def test_kept_and_pipelined_requests_are_answered_in_order():
    async def scenario(port, seen):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/echo", b"one"))
        plain = {"content-type": "text/plain", "content-length": "3"}
        assert await answer(reader) == (200, plain, b"one")
        hello = b"GET /hello?x=1 HTTP/1.1\r\n\r\nGET http://h:1/hello?y HTTP/1.1\r\n\r\n"
        writer.write(post("/echo", b"two") + hello + post("/echo", b""))
        assert (await answer(reader))[2] == b"two"
        for _ in range(2):  # the query dropped; the absolute form's path
            status, headers, body = await answer(reader)
            assert status == 200 and orjson.loads(body) == {"hello": "/hello"}
            assert headers["content-type"] == "application/json"
        assert (await answer(reader))[2] == b""
        writer.close()

    run(scenario)


def test_chunked_bodies_continue_and_head():
    async def scenario(port, seen):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        chunked = "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        writer.write(chunked.encode() + b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: 1\r\n\r\n")
        assert (await answer(reader))[2] == b"abcde"
        # the body waits for the 100 (Continue), which comes before the answer
        writer.write(b"POST /echo HTTP/1.1\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"ok")
        assert (await answer(reader))[2] == b"ok"
        writer.write(b"HEAD /hello HTTP/1.1\r\n\r\nGET /hello HTTP/1.1\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        length = len(orjson.dumps({"hello": "/hello"}))
        assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: %d" % length in head
        assert orjson.loads((await answer(reader))[2]) == {"hello": "/hello"}  # no body before
        writer.close()

    run(scenario)


def test_unknown_routes_and_malformed_requests():
    async def scenario(port, seen):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /nowhere HTTP/1.1\r\n\r\nGET /echo HTTP/1.1\r\n\r\n")
        assert (await answer(reader))[0] == 404
        assert (await answer(reader))[0] == 405  # the path is served, not with GET
        writer.write(b"NONSENSE\r\n\r\n")
        status, _, body = await answer(reader)
        assert status == 400 and "request line" in orjson.loads(body)["error"]["message"]
        assert await closed(reader)
        for bad in (b"POST /echo HTTP/1.1\r\nContent-Length: x\r\n\r\n", b"A" * 70000):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(bad)
            assert (await answer(reader))[0] == 400
            assert await closed(reader)

    run(scenario)


def test_bodies_over_the_limit_reach_the_handler_unread_and_close():
    async def scenario(port, seen):
        for body in (post("/echo", b"x" * (LIMIT + 1)), _chunked(b"y" * (LIMIT + 1))):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(body)
            status, headers, answer_body = await answer(reader)
            assert status == 400 and orjson.loads(answer_body) == {"too_large": True}
            assert headers["connection"] == "close" and await closed(reader)
        assert [r.too_large and r.body == b"" for r in seen] == [True, True]

    run(scenario)


def _chunked(data: bytes) -> bytes:
    head = b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)


def test_http_1_0_and_connection_close_end_the_connection():
    async def scenario(port, seen):
        one_zero = b"GET /hello HTTP/1.0\r\n\r\n"
        close = b"GET /hello HTTP/1.1\r\nConnection: close\r\n\r\n"
        for request in (one_zero, close):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request + b"GET /hello HTTP/1.1\r\n\r\n")  # not answered
            assert (await answer(reader))[0] == 200
            assert await closed(reader)
        # a stream to HTTP/1.0: not chunked, up to the connection's end
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /events HTTP/1.0\r\n\r\n")
        got = await asyncio.wait_for(reader.read(), 5)
        head, _, body = got.partition(b"\r\n\r\n")
        assert b"chunked" not in head and b"Connection: close" in head
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"

    run(scenario)


def test_streams_a_failing_handler_and_a_client_that_leaves():
    async def scenario(port, seen):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /events HTTP/1.1\r\n\r\nGET /fails HTTP/1.1\r\n\r\n")
        status, headers, body = await answer(reader)
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert headers["content-type"] == "text/event-stream"
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        status, _, body = await answer(reader)
        assert status == 500 and b"failed" in body
        writer.write(b"GET /forever HTTP/1.1\r\n\r\n")  # the same connection still serves
        await reader.readuntil(b"first\r\n")
        writer.close()  # the client leaves mid-stream: its handler is cancelled
        for _ in range(100):
            if "cancelled" in seen:
                break
            await asyncio.sleep(0.02)
        assert "cancelled" in seen

    run(scenario)


def test_a_stream_faster_than_its_client_waits_for_it(monkeypatch):
    pauses = []
    pause = Connection.pause_writing
    monkeypatch.setattr(Connection, "pause_writing", lambda c: (pauses.append(1), pause(c)))

    async def scenario(port, seen):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /big HTTP/1.1\r\n\r\n")
        await asyncio.sleep(0.3)  # the socket buffers fill: the server's writes wait
        status, _, body = await answer(reader)
        assert status == 200 and body == b"x" * (BIG * 65536)
        assert pauses
        writer.close()

    run(scenario)


def test_a_client_that_reads_nothing_is_dropped(monkeypatch):
    monkeypatch.setattr(downstream, "STALL_S", 0.3)

    async def scenario(port, seen):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /big HTTP/1.1\r\n\r\n")  # and never reads
        for _ in range(100):
            if "dropped" in seen:
                break
            await asyncio.sleep(0.05)
        assert seen == ["dropped"]  # its handler's write failed within the deadline
        writer.close()

    run(scenario)
