"""`dserve router`: one HTTP endpoint in front of prefill and decode instances.

For each request it picks a prefill and a decode instance (random, round_robin or least_load over the
healthy ones), adds `bootstrap_host/port/room` (the bootstrap port is learned from the prefill's
`/server_info`), sends the request to both at once and relays the decode's answer, streamed or whole.
If the prefill fails before the decode answers, the decode request is dropped (which aborts it) and
the client gets the prefill's error. Instances are probed on `/health`. One that is gone (connection
refused or dropped) or says it is unhealthy is out of rotation at once; one that is only slow to answer
stays in until `SLOW_PROBES_TO_REMOVE` probes in a row time out (a busy instance on a loaded host is
not a dead one). Either comes back at its next good answer; a request that finds no instance of a
kind in rotation has every instance probed again before it is refused. SGLang's admin routes
(`/health_generate`, `/flush_cache`, `/abort_request`) go to every instance; `/get_model_info`
to a decode instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
from dataclasses import dataclass
from urllib.parse import urlparse

import aiohttp
from aiohttp import web

from dserve.runtime.metrics import Metrics
from dserve.runtime.protocol import error_body

log = logging.getLogger("dserve.router")
POLICIES = ("random", "round_robin", "least_load")
SLOW_PROBES_TO_REMOVE = 3


@dataclass
class Backend:
    url: str
    healthy: bool = False
    slow_probes: int = 0  # probes in a row that timed out
    in_flight: int = 0
    bootstrap_port: int | None = None

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or "127.0.0.1"


class Router:
    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        policy: str = "round_robin",
        health_interval_s: float = 2.0,
        request_timeout_s: float = 3600.0,
        max_request_bytes: int = 4 << 20,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not prefill_urls or not decode_urls:
            raise ValueError("the router needs at least one --prefill and one --decode URL")
        self.prefills = [Backend(u.rstrip("/")) for u in prefill_urls]
        self.decodes = [Backend(u.rstrip("/")) for u in decode_urls]
        self.policy, self.health_interval_s = policy, health_interval_s
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=10)
        self.turns = {"prefill": itertools.count(), "decode": itertools.count()}
        self.metrics = Metrics("dserve_router")
        self.app = web.Application(client_max_size=max_request_bytes)
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            self.app.router.add_post(path, self.forward)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/metrics", self.metrics_text)
        for path in ("/health_generate", "/flush_cache"):  # SGLang's admin routes: every instance
            self.app.router.add_get(path, self.fan_out)
        for path in ("/flush_cache", "/abort_request"):
            self.app.router.add_post(path, self.fan_out)
        self.app.router.add_get("/get_model_info", self.models)
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    # ---- lifecycle and health -------------------------------------------------------------------
    async def _start(self, _app) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout)
        await self.check_all()
        self.prober = asyncio.ensure_future(self._probe_forever())

    async def _stop(self, _app) -> None:
        self.prober.cancel()
        await self.session.close()

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(b) for b in self.prefills + self.decodes))

    async def _check(self, backend: Backend) -> None:
        probe = aiohttp.ClientTimeout(total=max(self.health_interval_s, 1.0))
        slow = False
        try:
            async with self.session.get(backend.url + "/health", timeout=probe) as r:
                ok = r.status == 200
            if ok and backend in self.prefills and backend.bootstrap_port is None:
                async with self.session.get(backend.url + "/server_info", timeout=probe) as r:
                    backend.bootstrap_port = (await r.json())["bootstrap_port"]
        except asyncio.TimeoutError:
            ok, slow = False, True
        except (aiohttp.ClientError, KeyError, ValueError):
            ok = False
        backend.slow_probes = backend.slow_probes + 1 if slow else 0
        healthy = ok or (backend.healthy and slow and backend.slow_probes < SLOW_PROBES_TO_REMOVE)
        if healthy != backend.healthy:
            log.warning(
                "%s is %s",
                backend.url,
                "back in rotation" if healthy else "out of rotation (not answering)",
            )
        backend.healthy = healthy

    def pick(self, kind: str) -> Backend | None:
        pool = [b for b in (self.prefills if kind == "prefill" else self.decodes) if b.healthy]
        if not pool:
            return None
        if self.policy == "random":
            return random.choice(pool)
        if self.policy == "least_load":
            return min(pool, key=lambda b: b.in_flight)
        return pool[next(self.turns[kind]) % len(pool)]

    async def pick_pair(self) -> tuple[Backend | None, Backend | None]:
        """A prefill and a decode instance; where either kind has none in rotation, every
        instance is probed again first (one out of rotation since a slow or stale probe may be
        back: the request should not fail on a probe's old news)."""
        prefill, decode = self.pick("prefill"), self.pick("decode")
        if prefill is None or decode is None:
            await self.check_all()
            prefill, decode = self.pick("prefill"), self.pick("decode")
        return prefill, decode

    async def health(self, _: web.Request) -> web.Response:
        ok = any(b.healthy for b in self.prefills) and any(b.healthy for b in self.decodes)
        body = {
            "status": "ok" if ok else "degraded",
            "prefill": {b.url: b.healthy for b in self.prefills},
            "decode": {b.url: b.healthy for b in self.decodes},
        }
        return web.json_response(body, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        """/v1/models and /get_model_info: a decode instance's."""
        backend = self.pick("decode")
        if backend is None:
            return web.json_response(error_body("no healthy decode instance", 503), status=503)
        async with self.session.get(backend.url + request.path) as r:
            return web.json_response(await r.json(), status=r.status)

    async def fan_out(self, request: web.Request) -> web.Response:
        """The same request to every instance: 200 when all answered 200, else the first other
        status; the body has each instance's answer."""
        body = await request.read()
        backends = self.prefills + self.decodes
        answers = await asyncio.gather(*(self._ask(b, request, body) for b in backends))
        status = next((code for code, _ in answers if code != 200), 200)
        text = {b.url: answer for b, (_, answer) in zip(backends, answers)}
        return web.json_response(text, status=status)

    async def _ask(self, backend: Backend, request: web.Request, body: bytes) -> tuple[int, str]:
        url = backend.url + request.path
        try:
            async with self.session.request(request.method, url, data=body or None) as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return 502, f"{type(e).__name__}: {e}"

    async def metrics_text(self, _: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(), content_type="text/plain")

    # ---- forwarding --------------------------------------------------------------------------------
    async def forward(self, request: web.Request) -> web.StreamResponse:
        endpoint = request.path
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except web.HTTPRequestEntityTooLarge:
            return self._error(endpoint, "the body is too large", 400)
        except (ValueError, UnicodeDecodeError) as e:
            return self._error(endpoint, f"the body is not a JSON object: {e}", 400)
        prefill, decode = await self.pick_pair()
        if prefill is None or decode is None:
            return self._error(
                endpoint, "no healthy prefill and decode instance to serve the request", 503
            )
        body.update(
            bootstrap_host=prefill.host,
            bootstrap_port=prefill.bootstrap_port,
            bootstrap_room=random.getrandbits(63),
        )
        prefill.in_flight += 1
        decode.in_flight += 1
        try:
            return await self._both(request, endpoint, body, prefill, decode)
        finally:
            prefill.in_flight -= 1
            decode.in_flight -= 1

    async def _both(
        self, request, endpoint, body, prefill: Backend, decode: Backend
    ) -> web.StreamResponse:
        prefill_task = asyncio.ensure_future(self._prefill(prefill.url + endpoint, body))
        decode_cm = self.session.post(decode.url + endpoint, json=body)
        decode_task = asyncio.ensure_future(decode_cm.__aenter__())
        try:
            await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task.done() and prefill_task.result() is not None and not decode_task.done():
                decode_task.cancel()  # dropping the connection aborts the decode's request
                status, message = prefill_task.result()
                return self._error(endpoint, f"prefill {prefill.url} failed: {message}", status)
            try:
                upstream = await decode_task
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                return self._error(
                    endpoint, f"decode {decode.url} failed: {type(e).__name__}: {e}", 502
                )
            try:
                response = await self._relay(request, endpoint, upstream)
            except BaseException:
                upstream.close()  # the client left: dropping the decode's connection aborts its request
                raise
            upstream.release()
            return response
        finally:
            for task in (prefill_task, decode_task):
                if not task.done():
                    task.cancel()

    async def _prefill(self, url: str, body: dict) -> tuple[int, str] | None:
        """None when the prefill succeeded, else (HTTP status for the client, message)."""
        try:
            async with self.session.post(url, json={**body, "stream": False}) as r:
                if r.status == 200:
                    return None
                text = await r.text()
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    text = json.loads(text)["error"]["message"]
                return (r.status if r.status < 500 else 502), text
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return 502, f"{type(e).__name__}: {e}"

    async def _relay(
        self, request, endpoint, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        outcome = "ok" if upstream.status == 200 else "error"
        if not upstream.content_type.startswith("text/event-stream"):
            data = await upstream.read()
            self.metrics.request_done(endpoint, outcome)
            return web.Response(
                body=data, status=upstream.status, content_type=upstream.content_type
            )
        resp = web.StreamResponse(
            status=upstream.status,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
        )
        await resp.prepare(request)
        async for data in upstream.content.iter_any():
            await resp.write(data)
        self.metrics.request_done(endpoint, outcome)
        return resp

    def _error(self, endpoint: str, message: str, status: int) -> web.Response:
        self.metrics.request_done(endpoint, "bad_request" if status < 500 else "error")
        return web.json_response(error_body(message, status), status=status)


def run_router(
    prefill_urls: list[str],
    decode_urls: list[str],
    host: str,
    port: int,
    policy: str,
    health_interval_s: float = 2.0,
) -> None:
    from dserve.runtime.http_server import run_apps

    router = Router(prefill_urls, decode_urls, policy, health_interval_s)
    asyncio.run(run_apps([(router.app, host, port)]))
