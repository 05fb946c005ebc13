"""The control plane between a decode instance and a prefill instance (HTTP + JSON, size-limited).

The prefill runs a bootstrap server on its `bootstrap_port`:
  GET  /bootstrap/info    -> the prefill's InstanceDescriptor (model identity, ranks, UCX worker addresses, pools)
  POST /bootstrap/peer    {peer_id, descriptor}: a decode instance registers once; incompatible -> 400
  POST /bootstrap/room    {room, peer_id, dp_rank, pages}: where the decode wants a room's KV
  POST /bootstrap/cancel  {room}: the decode gave the room up
The decode side keeps a `PeerDirectory`: one descriptor exchange per prefill address, checked on both
sides, then per request an `HTTPPrefillLink` that posts the room (or its cancellation) asynchronously.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import aiohttp
from aiohttp import web

from dserve.transfer.descriptor import IncompatiblePeer, InstanceDescriptor, check_compatible

log = logging.getLogger("dserve.bootstrap")
MAX_CONTROL_BYTES = 1 << 20
MAX_PAGES = 1 << 22


def bootstrap_app(engine_loop, connector) -> web.Application:
    """The prefill's bootstrap server over its `PrefillConnector`."""
    app = web.Application(client_max_size=MAX_CONTROL_BYTES)

    async def info(_: web.Request) -> web.Response:
        return web.json_response(connector.descriptor.to_dict())

    async def peer(request: web.Request) -> web.Response:
        body = await _json(request)
        try:
            peer_id = body["peer_id"]
            descriptor = InstanceDescriptor.from_dict(body["descriptor"])
            if not isinstance(peer_id, str) or not 0 < len(peer_id) <= 64:
                raise ValueError("peer_id must be a short string")
        except (KeyError, TypeError, ValueError) as e:
            raise web.HTTPBadRequest(text=f"bad peer registration: {e}") from e
        try:
            await engine_loop.call(connector.add_peer, peer_id, descriptor)
        except IncompatiblePeer as e:
            raise web.HTTPBadRequest(text=str(e)) from e
        return web.json_response({"ok": True})

    async def room(request: web.Request) -> web.Response:
        arrived = time.perf_counter()  # the engine thread takes it between steps
        body = await _json(request)
        try:
            room_id, peer_id, dp_rank, pages = (
                body["room"],
                body["peer_id"],
                body["dp_rank"],
                body["pages"],
            )
            ok = (
                _is_int(room_id)
                and isinstance(peer_id, str)
                and _is_int(dp_rank)
                and isinstance(pages, list)
                and 0 < len(pages) <= MAX_PAGES
                and all(_is_int(p) and p >= 0 for p in pages)
            )
            if not ok:
                raise ValueError("room, dp_rank must be integers and pages a list of page ids")
            await engine_loop.call(connector.register, room_id, peer_id, dp_rank, pages, arrived)
        except (KeyError, TypeError, ValueError) as e:
            raise web.HTTPBadRequest(text=f"bad room registration: {e}") from e
        return web.json_response({"ok": True})

    async def cancel(request: web.Request) -> web.Response:
        body = await _json(request)
        if not _is_int(body.get("room")):
            raise web.HTTPBadRequest(text="room must be an integer")
        engine_loop.post(connector.cancel, body["room"])
        return web.json_response({"ok": True})

    app.router.add_get("/bootstrap/info", info)
    app.router.add_post("/bootstrap/peer", peer)
    app.router.add_post("/bootstrap/room", room)
    app.router.add_post("/bootstrap/cancel", cancel)
    return app


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def _json(request: web.Request) -> dict:
    try:
        body = await request.json()
    except Exception as e:  # noqa: BLE001
        raise web.HTTPBadRequest(text=f"the body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the body must be a JSON object")
    return body


class PeerDirectory:
    """Decode side: the prefill instances met so far, each checked and registered once."""

    def __init__(self, local: InstanceDescriptor, timeout_s: float):
        self.local, self.peer_id = local, uuid.uuid4().hex
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.peers: dict[tuple[str, int], InstanceDescriptor] = {}
        self.locks: dict[tuple[str, int], asyncio.Lock] = {}
        self.session: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=self.timeout)
        return self.session

    async def get(self, host: str, port: int) -> InstanceDescriptor:
        """The prefill's descriptor; raises ConnectionError (unreachable) or IncompatiblePeer."""
        key = (host, port)
        async with self.locks.setdefault(key, asyncio.Lock()):
            if key not in self.peers:
                base = f"http://{host}:{port}/bootstrap"
                try:
                    async with self._session().get(f"{base}/info") as r:
                        r.raise_for_status()
                        remote = InstanceDescriptor.from_dict(await r.json())
                    check_compatible(self.local, remote)
                    body = {"peer_id": self.peer_id, "descriptor": self.local.to_dict()}
                    async with self._session().post(f"{base}/peer", json=body) as r:
                        if r.status == 400:
                            raise IncompatiblePeer(await r.text())
                        r.raise_for_status()
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    raise ConnectionError(
                        f"prefill bootstrap server {host}:{port} unreachable: "
                        f"{type(e).__name__}: {e}"
                    ) from e
                self.peers[key] = remote
        return self.peers[key]

    def link(self, host: str, port: int, rid: str, on_error) -> "HTTPPrefillLink":
        return HTTPPrefillLink(self, f"http://{host}:{port}/bootstrap", rid, on_error)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


class HTTPPrefillLink:
    """Called on the engine thread; the posts run on the server's event loop."""

    def __init__(self, directory: PeerDirectory, base: str, rid: str, on_error):
        self.directory, self.base, self.rid, self.on_error = directory, base, rid, on_error
        self.loop = asyncio.get_running_loop()

    def register(self, room: int, dp_rank: int, pages: list[int]) -> None:
        body = {"room": room, "peer_id": self.directory.peer_id, "dp_rank": dp_rank, "pages": pages}
        self.loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(self._post("room", body, fatal=True))
        )

    def cancel(self, room: int) -> None:
        self.loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(self._post("cancel", {"room": room}))
        )

    async def _post(self, what: str, body: dict, fatal: bool = False) -> None:
        try:
            async with self.directory._session().post(f"{self.base}/{what}", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:500]}")
        except Exception as e:  # noqa: BLE001 - the request fails with the reason
            log.warning("bootstrap %s for %s failed: %s", what, self.rid, e)
            if fatal:
                self.on_error(
                    self.rid,
                    f"registering the room with the prefill failed: {type(e).__name__}: {e}",
                )
