"""`dserve router`: one HTTP endpoint in front of prefill and decode instances.

The router picks a prefill and a decode instance (`router_policy.py`), adds
`bootstrap_host/port/room` (the bootstrap port learned from the prefill's `/server_info`), sends
the request to both at once and relays the decode's answer, streamed or whole. The body is
checked (JSON, field shapes and types, as an instance parses it) once the first try's requests
have left, while the instances read it too (a cache-aware policy reads the prompt: there, before
the pick); bad input is a 400 from the router whether or not any instance is up (on the H100
host the check took 0.17 ms of the router's ~0.8 ms before the prefill had a 1k-token request).
A stream is shared by the pair (`SharedStream`): the prefill sends the client each request's
first token's events as soon as it has computed it, the decode the rest, so the first token
waits neither for the KV transfer nor for the decode. Clients are served by the router's own
HTTP/1.1 server (`downstream.py`), the instances asked through its own client (`upstream.py`):
aiohttp only probes the instances and asks them on the admin routes.

Retries: until the client has received a token, nothing is lost by starting again. A try whose
prefill or decode fails before that (connection refused or lost, a 5xx answer, a KV transfer that
failed, a stream whose first event is an error) is dropped (closing its connections aborts both
requests and frees their pages) and the request goes to another pair, up to `retry_max_retries`
times, instances not tried yet first. After it (a shared stream whose KV transfer fails after
the prefill sent the first token, an instance lost mid-stream) the stream ends with an error
event. A 4xx answer is relayed as it is. An instance whose connection fails leaves rotation at
once; the circuit breaker takes out one that keeps failing. The tries: `router_tries.py`.

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
import logging
import time

import aiohttp
import orjson

from dserve.runtime.downstream import Reply, Request, Server, json_reply, serve
from dserve.runtime.metrics import CONTENT_TYPE, RouterMetrics
from dserve.runtime.openai_protocol import PARSERS
from dserve.runtime.protocol import ROUTER_FIELDS, ROUTES, GenerateInput, error_body, stream_flag
from dserve.runtime.router_policy import Backend, Breaker, Picker
from dserve.runtime.router_tries import Ask, Failure, PairTries
from dserve.runtime.server_config import RouterConfig
from dserve.runtime.sglang_compat import drop_no_op_fields
from dserve.runtime.upstream import Upstreams
from dserve.scheduler.request import SamplingParams

log = logging.getLogger("dserve.router")
SLOW_PROBES_TO_REMOVE = 3
ANY_VOCABULARY = 2**62  # the router does not know the model: token ids are the instance's to check


def check_body(endpoint: str, body: dict) -> GenerateInput:
    """What can be checked without the model: the body as an instance parses it, and the sampling
    values (types and ranges); raises ValueError (the protocol's BadRequest) naming the field.
    Returns the parsed input."""
    clean = {k: v for k, v in drop_no_op_fields(body).items() if k not in ROUTER_FIELDS}
    inp = PARSERS[ROUTES[endpoint]](clean)
    for part in inp.parts():
        SamplingParams.from_dict(dict(part.sampling)).validate(ANY_VOCABULARY)
    return inp


class Router(PairTries):
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
        self.upstreams = Upstreams(c.request_timeout_s)  # the tries' requests
        self.metrics = RouterMetrics(self.prefills + self.decodes)
        routes = {("POST", path): self.forward for path in ROUTES}
        routes[("GET", "/health")] = self.health
        for path in ("/v1/models", "/get_model_info"):
            routes[("GET", path)] = self.models
        routes[("GET", "/metrics")] = self.metrics_text
        for path in ("/health_generate", "/flush_cache"):  # SGLang's admin routes: every instance
            routes[("GET", path)] = self.fan_out
        for path in ("/flush_cache", "/abort_request"):
            routes[("POST", path)] = self.fan_out
        self.server = Server(routes, c.max_request_bytes)
        """Its HTTP server for clients (`downstream.py`)."""

    def _backend(self, url: str, role: str) -> Backend:
        breaker = Breaker(self.config.cb_failure_threshold, self.config.cb_timeout_s)
        return Backend(url.rstrip("/"), role, breaker)

    # ---- lifecycle and health -------------------------------------------------------------------
    async def open(self, sock) -> asyncio.AbstractServer:
        """Probe the instances once, then serve clients on `sock` (bound)."""
        # no cap on open connections (aiohttp's default is 100: with streams holding one to
        # the decode each, the 101st would wait for one to end; test_router_streams)
        connector = aiohttp.TCPConnector(limit=0)
        self.session = aiohttp.ClientSession(timeout=self.timeout, connector=connector)
        await self.check_all()
        self.prober = asyncio.ensure_future(self._probe_forever())
        return await serve(self.server, sock)

    async def close(self, server: asyncio.AbstractServer) -> None:
        server.close()
        self.prober.cancel()
        self.upstreams.close()
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

    async def health(self, _: Request) -> Reply:
        ok = any(b.healthy for b in self.prefills) and any(b.healthy for b in self.decodes)
        body = {
            "status": "ok" if ok else "degraded",
            "prefill": {b.url: b.healthy for b in self.prefills},
            "decode": {b.url: b.healthy for b in self.decodes},
        }
        return json_reply(body, 200 if ok else 503)

    async def models(self, request: Request) -> Reply:
        """/v1/models and /get_model_info: a decode instance's."""
        backend = self.pick("decode")
        if backend is None:
            return json_reply(error_body("no healthy decode instance", 503), 503)
        try:
            async with self.session.get(backend.url + request.path) as r:
                return json_reply(await r.json(), r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            failure = self._lost(backend, e)
            return json_reply(error_body(failure.message, 502), 502)

    async def fan_out(self, request: Request) -> Reply:
        """The same request to every instance: 200 when all answered 200, else the first other
        status; the body has each instance's answer."""
        if request.too_large:
            return json_reply(error_body("the body is too large", 400), 400)
        body = await request.read()
        backends = self.prefills + self.decodes
        answers = await asyncio.gather(*(self._ask(b, request, body) for b in backends))
        status = next((code for code, _ in answers if code != 200), 200)
        text = {b.url: answer for b, (_, answer) in zip(backends, answers)}
        return json_reply(text, status)

    async def _ask(self, backend: Backend, request: Request, body: bytes) -> tuple[int, str]:
        url = backend.url + request.path
        try:
            async with self.session.request(request.method, url, data=body or None) as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return 502, f"{type(e).__name__}: {e}"

    async def metrics_text(self, _: Request) -> Reply:
        return Reply(200, self.metrics.render(), CONTENT_TYPE)

    # ---- forwarding --------------------------------------------------------------------------------
    async def forward(self, request: Request):
        endpoint, start = request.path, time.perf_counter()
        if request.too_large:
            return self._error(endpoint, "the body is too large", 400, start)
        try:
            raw = await request.read()
            body = orjson.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            return self._error(endpoint, f"the body is not a JSON object: {e}", 400, start)
        try:
            shared = self.config.shared_streams and stream_flag(body)
        except ValueError as e:
            return self._error(endpoint, str(e), 400, start)
        ask = Ask(endpoint, body, raw, start, lambda: check_body(endpoint, body))
        if self.picker.reads_prompt:  # its blocks are made of a checked body
            bad = ask.check()
            if bad is not None:
                return self._error(endpoint, bad.message, 400, start)
        blocks = self.picker.blocks(body)
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
            try_pair = self._try_shared if shared else self._try
            result = await try_pair(request, ask, (prefill, decode))
            if not isinstance(result, Failure):
                return result
            failure = result
            if not failure.retry:
                break
        failure = ask.check() or failure  # bad input is a 400 with every instance down too
        return self._error(endpoint, failure.message, failure.status, start)

    def _error(self, endpoint: str, message: str, status: int, start: float) -> Reply:
        outcome = "bad_request" if status < 500 else "error"
        self.metrics.answered(ROUTES[endpoint], outcome, start)
        return json_reply(error_body(message, status), status)


def run_router(prefill_urls: list[str], decode_urls: list[str], config: RouterConfig) -> None:
    from dserve.runtime.startup import run_loop

    router = Router(prefill_urls, decode_urls, config)
    run_loop(_serve(router, config.host, config.port))


async def _serve(router: Router, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM."""
    from dserve.runtime.startup import listening_socket, stop_signals

    stop = stop_signals()
    server = await router.open(listening_socket(host, port, "the HTTP API"))
    log.info("listening on http://%s:%d", host, port)
    print("dserve: ready", flush=True)
    await stop.wait()
    await router.close(server)
