"""Stand-ins for an instance on real HTTP, for tests of the router's policy and relaying (not of
the instances): `/health`, `/server_info` and, where a test gives one, a handler for every POST
(`/generate`, the OpenAI routes). Served in the test's own event loop, or on a thread of their
own for a test that is not async (`served_in_thread`)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from aiohttp import web

from tests.servers import free_port


class StubInstance:
    """`/health` answering `status` (after `delay_s`); `/server_info` with a bootstrap port;
    every POST answered by `generate` when given."""

    def __init__(self, generate=None):
        self.status, self.delay_s, self.port, self.runner = 200, 0.0, free_port(), None
        self.generate = generate

    async def health(self, _):
        await asyncio.sleep(self.delay_s)
        return web.json_response({}, status=self.status)

    async def server_info(self, _):
        return web.json_response({"bootstrap_port": 1})

    async def start(self):
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/server_info", self.server_info)
        if self.generate is not None:
            app.router.add_post("/{path:.*}", self.generate)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self):
        await self.runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def served_in_thread(stub: StubInstance):
    """`stub` served on an event loop of its own thread while the block runs."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(stub.start(), loop).result(10)
    try:
        yield stub
    finally:
        asyncio.run_coroutine_threadsafe(stub.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
