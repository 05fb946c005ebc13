"""Many streams through the router at once, over real HTTP, against small aiohttp servers
standing in for a prefill and a decode (the router's relaying is under test, not the
instances): 120 shared streams are open at the same time, each holding a connection to the
decode until the test lets them end, and every one of them gets its first event meanwhile. A
cap on the router's upstream connections (aiohttp's default is 100) would hold the later
requests back until earlier streams end: here, never."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from dserve.runtime.router import Router
from dserve.runtime.server_config import RouterConfig
from dserve.runtime.startup import listening_socket
from tests.runtime.stubs import StubInstance
from tests.servers import free_port

STREAMS = 120
FIRST = b'data: {"text": "a", "output_ids": [7]}\n\n'
NEXT = b'data: {"text": "b", "output_ids": [8]}\n\n'
END = b"data: [DONE]\n\n"


class Stub(StubInstance):
    """A stand-in whose `/generate` streams one event: the prefill's the first token; the
    decode's the next one, then it waits for `release` before it ends."""

    def __init__(self, role: str, release: asyncio.Event):
        super().__init__(self.stream)
        self.role, self.release, self.open_streams = role, release, 0

    async def stream(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.role == "prefill":
            await resp.write(FIRST + END)
            return resp
        self.open_streams += 1
        await resp.write(NEXT)
        await self.release.wait()
        await resp.write(END)
        self.open_streams -= 1
        return resp


async def first_event(session, url: str, firsts: list, ends: list) -> None:
    """One streamed request: note its first event when it comes, and its end."""
    body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 2}}
    async with session.post(url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        seen = b""
        async for chunk in resp.content.iter_any():
            if not seen:
                firsts.append(chunk)
            seen += chunk
        ends.append(seen)


def test_streams_beyond_a_hundred_connections_all_start():
    async def scenario():
        release = asyncio.Event()
        prefill, decode = Stub("prefill", release), Stub("decode", release)
        for stub in (prefill, decode):
            await stub.start()
        router = Router([prefill.url], [decode.url], RouterConfig(health_interval_s=60))
        port = free_port()
        server = await router.open(listening_socket("127.0.0.1", port, "the router"))
        url = f"http://127.0.0.1:{port}"
        firsts, ends = [], []
        client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        try:
            streams = [
                asyncio.ensure_future(first_event(client, url, firsts, ends))
                for _ in range(STREAMS)
            ]
            deadline = asyncio.get_running_loop().time() + 20
            # the first token comes through the prefill; a stream's decode
            # request may reach the decode a moment later (both leave at once)
            started = lambda: len(firsts) == decode.open_streams == STREAMS  # noqa: E731
            while not started() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            # every stream has its first token while every decode stream is still open
            assert len(firsts) == STREAMS, f"{len(firsts)} of {STREAMS} streams started"
            assert decode.open_streams == STREAMS and not ends
            release.set()
            await asyncio.wait_for(asyncio.gather(*streams), 20)
            assert len(ends) == STREAMS
            assert all(b'"a"' in e and b'"b"' in e and e.endswith(END) for e in ends), ends[0]
        finally:
            release.set()
            await client.close()
            await router.close(server)
            for stub in (prefill, decode):
                await stub.stop()

    asyncio.run(scenario())
