"""`dserve router`: one HTTP endpoint in front of prefill and decode instances.

A request's body is checked first (JSON, field shapes and types, as an instance parses it), so
bad input is a 400 whether or not any instance is up. Then the router picks a prefill and a
decode instance (`router_policy.py`), adds `bootstrap_host/port/room` (the bootstrap port learned
from the prefill's `/server_info`), sends the request to both at once and relays the decode's
answer, streamed or whole.

Retries: until the client has received a token, nothing is lost by starting again. A try whose
prefill or decode fails before that (connection refused or lost, a 5xx answer, a KV transfer that
failed, a stream whose first event is an error) is dropped (closing its connections aborts both
requests and frees their pages) and the request goes to another pair, up to `retry_max_retries`
times, instances not tried yet first. A 4xx answer is relayed as it is. An instance whose
connection fails leaves rotation at once; the circuit breaker takes out one that keeps failing.

Instances are probed on `/health`. One that is gone (connection refused or dropped) or says it is
unhealthy is out of rotation at once; one that is only slow to answer stays in until
`SLOW_PROBES_TO_REMOVE` probes in a row time out (a busy instance on a loaded host is not a dead
one). Either comes back at its next good answer; a request that finds no instance of a kind in
rotation has every instance probed again before it is refused. SGLang's admin routes
(`/health_generate`, `/flush_cache`, `/abort_request`) go to every instance; `/get_model_info`
to a decode instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from dserve.runtime.metrics import CONTENT_TYPE, RouterMetrics
from dserve.runtime.openai_protocol import PARSERS
from dserve.runtime.protocol import BOOTSTRAP_FIELDS, ROUTES, EventStream, error_body
from dserve.runtime.router_policy import Backend, Breaker, Picker
from dserve.runtime.server_config import RouterConfig
from dserve.runtime.sglang_compat import drop_no_op_fields
from dserve.scheduler.request import SamplingParams

log = logging.getLogger("dserve.router")
SLOW_PROBES_TO_REMOVE = 3
STREAM_END = b"data: [DONE]\n\n"  # a stream's last event, the router's and the instances'
BLAME_GRACE_S = 1.0  # how long a failed decode waits to learn whether its prefill failed
ANY_VOCABULARY = 2**62  # the router does not know the model: token ids are the instance's to check
# the decode gets them as the client sent them, the prefill answers whole
STREAM_FIELDS = ("stream", "stream_options")
JSON = {"Content-Type": "application/json"}


@dataclass
class Failure:
    """A try that ended before the client got anything: the status and message the client gets
    if no other try succeeds, whether another try may succeed, and the instance at fault."""

    status: int
    message: str
    retry: bool
    backend: Backend | None = None
    lost: bool = False  # the connection failed (not an answer)


@dataclass
class Opened:
    """The decode's answer once it is sure to succeed or to be relayed as it is: its status and
    the bytes read so far (a whole body, or a stream's first event)."""

    upstream: aiohttp.ClientResponse
    head: bytes
    streamed: bool


def check_body(endpoint: str, body: dict) -> None:
    """What can be checked without the model: the body as an instance parses it, and the sampling
    values (types and ranges); raises ValueError (the protocol's BadRequest) naming the field."""
    clean = {k: v for k, v in drop_no_op_fields(body).items() if k not in BOOTSTRAP_FIELDS}
    inp = PARSERS[ROUTES[endpoint]](clean)
    for part in inp.parts():
        SamplingParams.from_dict(dict(part.sampling)).validate(ANY_VOCABULARY)


class Router:
    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        config: RouterConfig | None = None,
    ):
        self.config = c = config or RouterConfig()
        if not prefill_urls or not decode_urls:
            raise ValueError("the router needs at least one --prefill and one --decode URL")
        self.picker = Picker(c)
        self.prefills = [self._backend(u, "prefill") for u in prefill_urls]
        self.decodes = [self._backend(u, "decode") for u in decode_urls]
        self.timeout = aiohttp.ClientTimeout(total=c.request_timeout_s, sock_connect=10)
        self.metrics = RouterMetrics(self.prefills + self.decodes)
        self.app = web.Application(client_max_size=c.max_request_bytes)
        for path in ROUTES:
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

    def _backend(self, url: str, role: str) -> Backend:
        breaker = Breaker(self.config.cb_failure_threshold, self.config.cb_timeout_s)
        return Backend(url.rstrip("/"), role, breaker)

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
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(b) for b in self.prefills + self.decodes))

    async def _check(self, backend: Backend) -> None:
        probe = aiohttp.ClientTimeout(total=max(self.config.health_interval_s, 1.0))
        slow = False
        try:
            async with self.session.get(backend.url + "/health", timeout=probe) as r:
                ok = r.status == 200
            if ok and backend.role == "prefill" and backend.bootstrap_port is None:
                async with self.session.get(backend.url + "/server_info", timeout=probe) as r:
                    backend.bootstrap_port = (await r.json())["bootstrap_port"]
        except asyncio.TimeoutError:
            ok, slow = False, True
        except (aiohttp.ClientError, KeyError, ValueError):
            ok = False
        backend.slow_probes = backend.slow_probes + 1 if slow else 0
        healthy = ok or (backend.healthy and slow and backend.slow_probes < SLOW_PROBES_TO_REMOVE)
        if healthy != backend.healthy:
            what = "back in rotation" if healthy else "out of rotation (not answering)"
            log.warning("%s is %s", backend.url, what)
        if healthy and not backend.healthy:
            backend.breaker.success()  # back from the dead (restarted): a fresh start
        backend.healthy = healthy

    def pick(self, role: str, blocks=(), tried=frozenset()) -> Backend | None:
        """An instance of `role` in rotation, one not in `tried` where there is one."""
        now = time.monotonic()
        every = self.prefills if role == "prefill" else self.decodes
        pool = [b for b in every if b.available(now)]
        fresh = [b for b in pool if b not in tried]
        if not pool:
            return None
        return self.picker.pick(role, fresh or pool, list(blocks))

    async def pick_pair(self, blocks=(), tried=frozenset()):
        """A prefill and a decode instance; where either kind has none in rotation, every
        instance is probed again first (one out of rotation since a slow or stale probe may be
        back: the request should not fail on a probe's old news)."""
        prefill, decode = self.pick("prefill", blocks, tried), self.pick("decode", (), tried)
        if prefill is None or decode is None:
            await self.check_all()
            prefill = self.pick("prefill", blocks, tried)
            decode = self.pick("decode", (), tried)
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
        try:
            async with self.session.get(backend.url + request.path) as r:
                return web.json_response(await r.json(), status=r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            failure = self._lost(backend, e)
            return web.json_response(error_body(failure.message, 502), status=502)

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
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # ---- forwarding --------------------------------------------------------------------------------
    async def forward(self, request: web.Request) -> web.StreamResponse:
        endpoint, start = request.path, time.perf_counter()
        try:
            body = orjson.loads(await request.read())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except web.HTTPRequestEntityTooLarge:
            return self._error(endpoint, "the body is too large", 400, start)
        except (ValueError, UnicodeDecodeError) as e:
            return self._error(endpoint, f"the body is not a JSON object: {e}", 400, start)
        try:
            check_body(endpoint, body)
        except ValueError as e:
            return self._error(endpoint, str(e), 400, start)
        blocks = self.picker.blocks(body)
        rest = _rest_json(body)
        tried: set[Backend] = set()
        failure = Failure(503, "no healthy prefill and decode instance to serve the request", False)
        for attempt in range(1 + self.config.retry_max_retries):
            prefill, decode = await self.pick_pair(blocks, tried)
            if prefill is None or decode is None:
                break
            if attempt:
                self.metrics.retries.inc()
                log.info("retrying on %s + %s: %s", prefill.url, decode.url, failure.message)
            tried |= {prefill, decode}
            result = await self._try(request, endpoint, body, rest, prefill, decode, start)
            if not isinstance(result, Failure):
                return result
            failure = result
            if not failure.retry:
                break
        return self._error(endpoint, failure.message, failure.status, start)

    async def _try(
        self, request, endpoint, body, rest, prefill: Backend, decode: Backend, start: float
    ) -> web.StreamResponse | Failure:
        """One try on a pair: the client's response once the decode's answer is sure, else the
        Failure (both requests dropped). `rest`: the body's fields but the bootstrap and stream
        ones, as JSON (`_rest_json`)."""
        boot = {
            "bootstrap_host": prefill.host,
            "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.getrandbits(63),
        }
        streamed = {k: body[k] for k in STREAM_FIELDS if k in body}
        to_decode = _json_body({**boot, **streamed}, rest)
        to_prefill = _json_body({**boot, "stream": False}, rest)  # answered whole
        self.metrics.sent(prefill)
        self.metrics.sent(decode)
        decode.in_flight += 1
        prefill.in_flight += 1
        prefill_task = asyncio.ensure_future(self._prefill(prefill, endpoint, to_prefill))
        prefill_task.add_done_callback(lambda _: _leave(prefill))
        decode_task = asyncio.ensure_future(self._open(decode, endpoint, to_decode))
        try:
            opened = await self._settle(prefill_task, decode_task)
            if isinstance(opened, Failure):
                self._blame(opened)
                return opened
            try:
                return await self._relay(request, endpoint, opened, decode, start)
            finally:
                opened.upstream.close()  # a client gone mid-stream: this aborts the decode's request
        finally:
            decode.in_flight -= 1
            for task in (prefill_task, decode_task):
                task.cancel()
            await _closed(decode_task)

    async def _settle(self, prefill_task, decode_task) -> Opened | Failure:
        """The decode's opened answer, unless either side failed first. A decode that answers
        with an error first may have failed for its prefill (which it reaches for the KV): the
        prefill has a moment to say so, and takes the blame if it failed too."""
        await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
        if prefill_task.done() and prefill_task.result() is not None:
            return prefill_task.result()
        opened = await decode_task
        if isinstance(opened, Failure) and not opened.lost:
            await asyncio.wait({prefill_task}, timeout=BLAME_GRACE_S)
            if prefill_task.done() and prefill_task.result() is not None:
                return prefill_task.result()
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
            async with self.session.post(backend.url + endpoint, data=body, headers=JSON) as r:
                if r.status == 200:
                    backend.breaker.success()
                    return None
                return _answer_failure(backend, r.status, await r.read())
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return self._lost(backend, e)

    async def _open(self, backend: Backend, endpoint: str, body: bytes) -> Opened | Failure:
        """POST to the decode and read until its answer is sure: a whole body, or a stream's
        first event (an error event instead of tokens is a Failure)."""
        try:
            upstream = await self.session.post(backend.url + endpoint, data=body, headers=JSON)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return self._lost(backend, e)
        try:
            streamed = upstream.content_type.startswith("text/event-stream")
            if upstream.status != 200 or not streamed:
                head = await upstream.read()
                if upstream.status >= 500:
                    upstream.close()
                    return _answer_failure(backend, upstream.status, head)
                return Opened(upstream, head, False)
            head = await _first_event(upstream)
            error = _event_error(head)
            if error is not None:
                upstream.close()
                return Failure(500, f"decode {backend.url}: {error}", True, backend)
            return Opened(upstream, head, True)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            upstream.close()
            return self._lost(backend, e)
        except asyncio.CancelledError:
            upstream.close()  # the prefill failed first: dropping the connection aborts the decode
            raise

    def _lost(self, backend: Backend, error: Exception) -> Failure:
        """The connection failed: the instance leaves rotation until a probe finds it back."""
        if backend.healthy:
            log.warning("%s is out of rotation (%s)", backend.url, type(error).__name__)
        backend.healthy = False
        message = f"{backend.role} {backend.url} failed: {type(error).__name__}: {error}"
        return Failure(502, message, True, backend, lost=True)

    async def _relay(
        self, request, endpoint: str, opened: Opened, decode: Backend, start: float
    ) -> web.StreamResponse:
        upstream = opened.upstream
        outcome = "ok" if upstream.status == 200 else "bad_request"
        if upstream.status == 200:
            decode.breaker.success()
        if not opened.streamed:
            self.metrics.answered(ROUTES[endpoint], outcome, start, first=time.perf_counter())
            return web.Response(
                body=opened.head, status=upstream.status, content_type=upstream.content_type
            )
        resp = EventStream(status=upstream.status, headers=EventStream.HEADERS)
        await resp.prepare(request)
        await resp.write(opened.head)
        first = time.perf_counter()
        answered = False  # the stream's last event went out: the client may leave now
        try:
            async for data in upstream.content.iter_any():
                await resp.write(data)
                if not answered and STREAM_END in data:
                    answered = True
                    self.metrics.answered(ROUTES[endpoint], outcome, start, first)
        except (ConnectionResetError, asyncio.CancelledError):
            if not answered:
                self.metrics.requests.labels(ROUTES[endpoint], "client_gone").inc()
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # tokens went out: no retry
            if answered:
                return resp  # the upstream failed after its last event: the answer is whole
            outcome = "error"
            message = f"decode {decode.url} failed mid-stream: {type(e).__name__}"
            await resp.write(b"data: " + json.dumps(error_body(message, 502)).encode() + b"\n\n")
            await resp.write(STREAM_END)
        if not answered:
            self.metrics.answered(ROUTES[endpoint], outcome, start, first)
        return resp

    def _error(self, endpoint: str, message: str, status: int, start: float) -> web.Response:
        outcome = "bad_request" if status < 500 else "error"
        self.metrics.answered(ROUTES[endpoint], outcome, start)
        return web.json_response(error_body(message, status), status=status)


def _rest_json(body: dict) -> str:
    """The body's fields but those each try sets (bootstrap, stream), as a JSON object: the
    prompt (some 100 KB of token ids at 16k tokens) is serialized once for both instances and
    every try, by orjson (the body is read by it too: with Python's json, reading and writing a
    16k-token body took 4.5 ms on a 2-core host)."""
    own = {*BOOTSTRAP_FIELDS, *STREAM_FIELDS}
    return orjson.dumps({k: v for k, v in body.items() if k not in own}).decode()


def _json_body(fields: dict, rest: str) -> bytes:
    """One JSON object of `fields` and the fields of `rest` (`_rest_json`: none of the same
    name)."""
    head, inner = json.dumps(fields), rest[1:-1]
    return (head[:-1] + ", " + inner + "}" if inner else head).encode()


def _leave(backend: Backend) -> None:
    backend.in_flight -= 1


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


async def _first_event(upstream: aiohttp.ClientResponse) -> bytes:
    """The bytes of a stream up to the end of its first event (maybe a few more)."""
    head = b""
    while b"\n\n" not in head:
        chunk = await upstream.content.readany()
        if not chunk:
            raise aiohttp.ServerDisconnectedError("the stream ended before its first event")
        head += chunk
    return head


def _event_error(head: bytes) -> str | None:
    for line in head.splitlines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            with contextlib.suppress(ValueError):
                event = json.loads(line[6:])
                if isinstance(event, dict) and "error" in event:
                    return event["error"].get("message", "error")
    return None


def run_router(prefill_urls: list[str], decode_urls: list[str], config: RouterConfig) -> None:
    from dserve.runtime.startup import run_apps

    router = Router(prefill_urls, decode_urls, config)
    asyncio.run(run_apps([(router.app, config.host, config.port)]))
