"""The HTTP API of an instance (`dserve serve|prefill|decode`), on aiohttp.

Routes: POST /generate, /v1/completions, /v1/chat/completions (JSON or SSE with `stream`), GET /health,
/v1/models, /metrics, /server_info, and SGLang's admin routes (`sglang_routes.py`). One HTTP request
may run several engine requests (a batch, `n` choices): their chunks are merged by index and
`answers.py` makes the JSON. Bad input is HTTP 400 with a message; a request that fails inside
(transfer failure, timeout, dead rank) is HTTP 500 or an SSE error event. A client that goes away
aborts its request, which frees its pages. The engine runs on its own thread (`EngineLoop`).
The port listens from the start (one in use stops the start before any weight is read); until
the instance has loaded and warmed up (`warm_up`: every kernel a step launches compiled), GET
/health answers 503 {"status": "starting"} and the other routes 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import orjson
from aiohttp import web

from dserve.runtime import sglang_routes
from dserve.runtime.answers import Answer, make_answer
from dserve.runtime.chat_template import (
    chat_text,
    grammar_after_reasoning,
    load_template,
    render_chat,
    tool_grammar,
)
from dserve.runtime.config import EngineConfig
from dserve.runtime.engine import Engine
from dserve.runtime.engine_loop import EngineLoop, merge
from dserve.runtime.metrics import CONTENT_TYPE, InstanceMetrics
from dserve.runtime.openai_protocol import PARSERS
from dserve.runtime.pd import mark
from dserve.runtime.protocol import (
    ROUTES,
    BadRequest,
    EventStream,
    GenerateInput,
    Part,
    error_body,
)
from dserve.runtime.server_config import ServerConfig
from dserve.runtime.sglang_compat import drop_no_op_fields, quiet_h2_probes
from dserve.runtime.startup import listening_socket, run_loop, start_site, stop_signals
from dserve.runtime.stats import Stats
from dserve.scheduler.request import SamplingParams
from dserve.transfer.descriptor import IncompatiblePeer

log = logging.getLogger("dserve.server")


def front_host(engine_kwargs: dict) -> str | None:
    """Where the other hosts of a multi-host instance reach the front (None: one host)."""
    if engine_kwargs.get("nnodes", 1) == 1:
        return None
    return engine_kwargs["dist_init_addr"].rsplit(":", 1)[0]


def role_connector(role: str):
    """The connector class of a disaggregated role."""
    if role == "prefill":
        from dserve.runtime.pd_prefill import PrefillConnector

        return PrefillConnector
    from dserve.runtime.pd_decode import DecodeConnector

    return DecodeConnector


def warm_up(engine: Engine) -> None:
    """Before the instance reports ready: a few prompts of different shapes (one token, a few
    pages, a long chunk) and their first decode steps, so every kernel a step launches is
    compiled (or loaded from Triton's cache) before the first request, not during it. On a
    GPU also one pass per power-of-two bucket of a step's tokens, up to its token budget
    (the prompts of a pass share no prefix, so the pass computes all their tokens). The
    kernels' compile-time choices follow that bucket (the GEMM tiles, the MoE's pair sort
    and row blocks), and every count they see at run time (tokens, contexts, splits, the
    strides that follow them) is left unspecialized, so one pass per bucket compiles every
    variant a request can meet (`tests/runtime/test_startup.py` checks it on a GPU with a
    fresh Triton cache)."""
    page = engine.config.page_size
    chunk = engine.config.chunked_prefill_size
    params = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    lengths = sorted({1, page + 3, min(chunk, 4 * page + 5)})
    prompts = [_warm_prompt(n, seed) for seed, n in enumerate(lengths)]
    engine.generate(input_ids=prompts, sampling_params=params)
    if engine.config.device == "cpu":  # no kernel compiles there
        return
    # a step holds several prompts' chunks, up to its token budget
    piece = min(chunk, engine.max_context - 8)
    if piece <= 0:
        return
    budget = engine.config.max_num_batched_tokens
    slack = (budget // piece + 2) * (page + 4)  # each prompt's last page, its decodes
    longest = min(budget, engine.pool_tokens - slack)
    seed = len(lengths)
    for n in pass_sizes(longest) if longest > 0 else []:
        parts = [min(piece, n - start) for start in range(0, n, piece)]
        prompts = [_warm_prompt(m, seed + i) for i, m in enumerate(parts)]  # n tokens
        seed += len(parts)
        engine.generate(input_ids=prompts, sampling_params=params)


def pass_sizes(longest: int) -> list[int]:
    """One token count in each power-of-two bucket up to `longest` (1, 2, 3, 5, 9, ...:
    just past each power of two), and `longest` itself."""
    past = [1, 2] + [2**k + 1 for k in range(1, longest.bit_length())]
    return sorted({n for n in past if n < longest} | {longest})


def _warm_prompt(n: int, seed: int) -> list[int]:
    """n tokens whose first one is the seed's: prompts of other seeds share no prefix."""
    return [1 + (seed * 31 + i * 7) % 97 for i in range(n)]


class Instance:
    """Engine + engine thread + the role's connector + transfer manager of one serving
    instance."""

    def __init__(
        self,
        model_path: str,
        config: ServerConfig,
        metrics: InstanceMetrics | None = None,
        **engine_kwargs,
    ):
        self.config, self.metrics = config, metrics or InstanceMetrics()
        self.manager = None
        transfer = None
        if config.role != "colocated":
            from dserve.transfer.agent import AgentConfig
            from dserve.transfer.manager import TransferManager

            # UCX stays on the loopback when every host is this one
            host = front_host(engine_kwargs)
            self.manager = TransferManager(host)
            host = host or config.host
            stream_tokens = 0  # prefill: pages leave in parts of a chunk's tokens
            if config.role == "prefill" and config.kv_streaming:
                default = EngineConfig.chunked_prefill_size
                stream_tokens = engine_kwargs.get("chunked_prefill_size", default)
            transfer = AgentConfig(
                self.manager.address,
                host,
                config.transfer_fail_rate,
                stream_tokens=stream_tokens,
                stall_rooms=config.transfer_stall_rooms,
                stall_s=2 * (config.transfer_timeout_s + config.transfer_report_margin_s),
                local_address=self.manager.local_address,
            )
        self.engine = Engine(model_path, transfer=transfer, **engine_kwargs)
        if self.manager is not None:
            self.manager.wait_for_agents(self.engine.config.world_size)
            connector_class = role_connector(config.role)
            connector = connector_class(self.engine, self.manager, config, self.metrics)
            self.engine.connector = connector
        self.connector = self.engine.connector
        stats = Stats(self.engine, self.metrics, config.batch_log_interval_s)
        self.loop = EngineLoop(self.engine, stats)
        try:  # on the thread that will run the steps
            self.loop.run_here(warm_up, self.engine)
        except BaseException:
            self.loop.stop()
            raise
        self.model_name = config.served_model_name or os.path.basename(os.path.normpath(model_path))
        self.chat_template = load_template(config.chat_template)
        self.metrics.watch(self.engine)

    def shutdown(self) -> None:
        self.loop.stop()
        self.engine.shutdown()
        if self.manager is not None:
            self.manager.close()

    # ---- turning input into started requests ---------------------------------------------------
    def check(self, inp: GenerateInput) -> None:
        """An OpenAI request naming another model is 404, as OpenAI answers it; tools need a
        tool-call parser."""
        if inp.model is not None and inp.model != self.model_name:
            raise BadRequest(
                f"the model {inp.model!r} does not exist (this server serves {self.model_name!r})",
                404,
            )
        chat = inp.openai.chat if inp.route == "chat" else None
        if chat and chat.tools and chat.tool_choice != "none" and not self.config.tool_call_parser:
            raise BadRequest("tools need a server started with --tool-call-parser")

    def _make_requests(self, inp: GenerateInput, parts: list[Part]) -> list:
        rendered, parser = None, self.config.tool_call_parser
        if inp.route == "chat":
            chat = inp.openai.chat
            rendered = render_chat(self.engine.tokenizer, chat, self.chat_template, parser)
            for part in parts:
                tool_grammar(chat, parser, part.sampling)
                grammar_after_reasoning(chat, self.config.reasoning_parser, part.sampling)
        reqs = []
        for part in parts:
            prompt = part.prompt
            ids = rendered if rendered is not None else prompt.input_ids
            reqs.append(self.engine.make_request(prompt.text, ids, part.sampling, part.rid))
        return reqs

    async def prepare(self, inp: GenerateInput) -> list[tuple]:
        """Each engine request of `inp` and how to start it on the engine thread; BadRequest /
        ConnectionError on failure (nothing started)."""
        self.connector.check_bootstrap(inp.bootstrap)
        parts = inp.parts()
        reqs = await self.loop.call(self._make_requests, inp, parts)
        rooms = [part.room for part in parts]
        return await self.connector.starts(inp.bootstrap, reqs, rooms, self.loop)

    def answer(self, inp: GenerateInput, reqs: list) -> Answer:
        c = self.config
        kw = {"incremental": c.incremental_streaming_output}
        if inp.route == "chat":
            chat = inp.openai.chat
            kw["make_text"] = lambda: chat_text(chat, c.reasoning_parser, c.tool_call_parser)
        return make_answer(inp, reqs, self.model_name, self.engine.tokenizer, **kw)


class Server:
    """The HTTP API, listening from the start: until `attach` gives it the instance (loaded and
    warmed up), `/health` answers 503 "starting" and every other route 503."""

    def __init__(self, config: ServerConfig, metrics: InstanceMetrics):
        self.instance, self.metrics = None, metrics
        self.app = web.Application(client_max_size=config.max_request_bytes)
        for path, route in ROUTES.items():
            self.app.router.add_post(path, self._when_ready(self._generation(route)))
        self.app.router.add_get("/health", self.health)
        for path, handler in (
            ("/v1/models", self.models),
            ("/metrics", self.metrics_text),
            ("/server_info", self.server_info),
            ("/debug/kv", self.kv_state),
        ):
            self.app.router.add_get(path, self._when_ready(handler))
        sglang_routes.add_routes(self.app, self._when_ready, lambda: self.instance)

    def attach(self, instance: Instance) -> None:
        self.instance = instance

    def _when_ready(self, handler):
        async def guarded(request: web.Request) -> web.StreamResponse:
            if self.instance is None:
                return _error("the instance is starting (loading the model, warming up)", 503)
            return await handler(request)

        return guarded

    async def health(self, _: web.Request) -> web.Response:
        if self.instance is None:
            return web.json_response({"status": "starting"}, status=503)
        failure = self.instance.loop.failure
        if failure:
            return web.json_response({"status": "failed", "error": failure}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, _: web.Request) -> web.Response:
        card = {
            "id": self.instance.model_name,
            "object": "model",
            "owned_by": "dserve",
            "created": 0,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def metrics_text(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def kv_state(self, _: web.Request) -> web.Response:
        """Page accounting, checked on the engine thread: used pages, pages held past their request
        (in flight or quarantined), requests known, preemptions so far, and whether the invariant
        checker passes."""

        def check() -> dict:
            engine = self.instance.engine
            try:
                engine.check_invariants()
                ok = "ok"
            except AssertionError as e:
                ok = f"violated: {e}"
            return {
                "used_pages": sum(g.kv.num_used_pages for g in engine.groups),
                "held": len(engine.held),
                "requests": len(engine.requests),
                "preempted": sum(g.scheduler.preempted_total for g in engine.groups),
                "invariants": ok,
            }

        return web.json_response(await self.instance.loop.call(check))

    async def server_info(self, _: web.Request) -> web.Response:
        c = self.instance.config
        info = {
            "role": c.role,
            "model": self.instance.model_name,
            "bootstrap_port": c.bootstrap_port if c.role == "prefill" else None,
            "tp_size": self.instance.engine.config.tp_size,
            "dp_size": self.instance.engine.config.dp_size,
        }
        return web.json_response(info)

    def _generation(self, route: str):
        async def handler(request: web.Request) -> web.StreamResponse:
            instance = self.instance
            try:
                inp = PARSERS[route](drop_no_op_fields(await _read_json(request)))
                instance.check(inp)
                started = await instance.prepare(inp)
            except BadRequest as e:
                self.metrics.request_done(route, "bad_request")
                return _error(str(e), e.status)
            except (IncompatiblePeer, ValueError) as e:
                self.metrics.request_done(route, "bad_request")
                return _error(str(e), 400)
            except ConnectionError as e:
                self.metrics.request_done(route, "error")
                return _error(str(e), 502)
            except RuntimeError as e:
                return _error(str(e), 503)
            answer = instance.answer(inp, [req for req, _ in started])
            apart = inp.shared is not None
            streams = [instance.loop.stream(req, start, apart) for req, start in started]
            chunks = merge(streams)
            if inp.stream:
                part = shown_part(instance.config.role, inp)
                return await self._sse(request, inp, answer, chunks, part)
            return await self._whole(inp, answer, chunks)

        return handler

    async def _whole(self, inp: GenerateInput, answer: Answer, chunks) -> web.Response:
        timer = _Timer(self.metrics)
        try:
            async for index, chunk in chunks:
                timer.tokens(len(chunk.token_ids))
                answer.take(index, chunk)
        except ValueError as e:  # rejected when it started (e.g. a room id in use)
            self.metrics.request_done(inp.route, "bad_request")
            return _error(str(e), 400)
        except asyncio.CancelledError:  # the client left: abort the requests, free their pages
            await chunks.aclose()
            self.metrics.request_done(inp.route, "client_gone")
            raise
        timer.done()
        failed = [c.result for c in answer.choices if c.finish_reason == "abort"]
        if failed:
            self.metrics.request_done(inp.route, "error")
            return _error(failed[0].meta.get("error") or "aborted", 500)
        self.metrics.request_done(inp.route, "ok")
        return web.json_response(answer.whole())

    async def _sse(
        self, request: web.Request, inp: GenerateInput, answer: Answer, chunks, part: str = "all"
    ) -> web.StreamResponse:
        """The answer as events; `part` (`shown_part`): which of them this instance sends."""
        resp = EventStream(headers=EventStream.HEADERS)
        timer, prepared, outcome = _Timer(self.metrics), False, "ok"
        started: set[int] = set()  # choices whose first token came
        try:
            async for index, chunk in chunks:
                if not prepared:
                    await resp.prepare(request)
                    prepared = True
                timer.tokens(len(chunk.token_ids))
                result = chunk.result
                if result is not None and result.finish_reason == "abort":
                    outcome = "error"
                    await _event(resp, error_body(result.meta.get("error") or "aborted", 500))
                    break
                payloads = answer.event(index, chunk)  # made either way: the answer's state
                first = bool(chunk.token_ids) and index not in started
                if first:
                    started.add(index)
                if part != "all" and (part == "first") != first:
                    continue  # the pair's other instance sends these
                if chunk.token_ids:  # as they go out: the write below is a send
                    mark(answer.choices[index].req, "sent")
                await _events(resp, payloads)
            if outcome == "ok" and part != "first":
                await _events(resp, answer.closing())
            await resp.write(b"data: [DONE]\n\n")
        except ValueError as e:
            self.metrics.request_done(inp.route, "bad_request")
            return _error(str(e), 400)
        except (ConnectionResetError, asyncio.CancelledError):
            outcome = "client_gone"
            await chunks.aclose()  # aborts the requests and frees their pages
            self.metrics.request_done(inp.route, outcome)
            raise
        timer.done()
        self.metrics.request_done(inp.route, outcome)
        return resp


class _Timer:
    def __init__(self, metrics: InstanceMetrics):
        self.metrics, self.start, self.last = metrics, time.perf_counter(), None

    def tokens(self, n: int) -> None:
        if n == 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            for _ in range(n):
                self.metrics.itl.observe((now - self.last) / n)
        self.last = now

    def done(self) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.start)


def shown_part(role: str, inp: GenerateInput) -> str:
    """Which events of a streamed answer this instance sends: "all"; with a stream the pair
    shares (`SharedStream`), "first" (the prefill: each choice's first token's events, then
    [DONE] once the KV has left, or an error event) or "rest" (the decode: those after
    them)."""
    if inp.shared is None:
        return "all"
    return "first" if role == "prefill" else "rest"


async def _event(resp: web.StreamResponse, payload: dict) -> None:
    await _events(resp, [payload])


async def _events(resp: web.StreamResponse, payloads: list[dict]) -> None:
    """The events of one chunk in one write (a chat's first token makes two)."""
    if payloads:
        data = b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads)
        await resp.write(data)


def _error(message: str, status: int) -> web.Response:
    return web.json_response(error_body(message, status), status=status)


async def _read_json(request: web.Request) -> dict:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise BadRequest(f"the body is larger than {request.app._client_max_size} bytes") from e
    try:
        body = orjson.loads(raw)  # 3-4x Python's json on a long prompt's token ids
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def serve(model_path: str, config: ServerConfig, **engine_kwargs) -> None:
    """Listen at once (a port in use fails before any weight is read), answer 503 while the
    instance loads and warms up, then serve until SIGINT/SIGTERM."""
    sockets = [listening_socket(config.host, config.port, "the HTTP API")]
    if config.role == "prefill":
        sockets.append(listening_socket(config.host, config.bootstrap_port, "the bootstrap server"))
    metrics = InstanceMetrics()
    server = Server(config, metrics)
    quiet_h2_probes()
    run_loop(_serve(server, sockets, model_path, config, metrics, engine_kwargs))


async def _serve(server: Server, sockets, model_path, config, metrics, engine_kwargs) -> None:
    stop = stop_signals()
    runners = [await start_site(server.app, sockets[0])]
    instance = None
    try:
        instance = await asyncio.to_thread(
            Instance, model_path, config, metrics=metrics, **engine_kwargs
        )
        server.attach(instance)
        if config.role == "prefill":
            from dserve.runtime.bootstrap import bootstrap_app

            app = bootstrap_app(instance.loop, instance.connector)
            runners.append(await start_site(app, sockets[1]))
        if not stop.is_set():
            print("dserve: ready", flush=True)
        await stop.wait()
    finally:
        for runner in runners:
            await runner.cleanup()
        if instance is not None:
            instance.shutdown()
