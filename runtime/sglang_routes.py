"""SGLang's native admin endpoints on an instance: `GET /health_generate` (one token through the
engine and its ranks), `GET /get_model_info`, `GET|POST /flush_cache` (forget the prefix cache
when idle), `POST /abort_request` (`rid`, or `abort_all`)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from dserve.runtime.protocol import error_body, expect
from dserve.scheduler.request import SamplingParams

HEALTH_GENERATE_TIMEOUT_S = 20.0


def add_routes(app: web.Application, when_ready, instance) -> None:
    """`instance()` gives the serving `Instance` (the routes are guarded by `when_ready`)."""
    routes = SGLangRoutes(instance)
    app.router.add_get("/health_generate", when_ready(routes.health_generate))
    app.router.add_get("/get_model_info", when_ready(routes.model_info))
    app.router.add_get("/flush_cache", when_ready(routes.flush_cache))
    app.router.add_post("/flush_cache", when_ready(routes.flush_cache))
    app.router.add_post("/abort_request", when_ready(routes.abort_request))


class SGLangRoutes:
    def __init__(self, instance):
        self.instance = instance

    async def health_generate(self, _: web.Request) -> web.Response:
        """200 once a one-token request went through the engine (any role: it runs there
        alone, with no transfer), 503 when it failed or took longer than 20 s."""
        inst = self.instance()
        if inst.loop.failure:
            return _json({"status": "failed", "error": inst.loop.failure}, 503)
        engine = inst.engine
        params = SamplingParams(max_new_tokens=1, temperature=0)
        req = await inst.loop.call(engine.make_request, None, [1], params, None)
        try:
            result = await asyncio.wait_for(
                _result(inst.loop.stream(req, engine.submit)), HEALTH_GENERATE_TIMEOUT_S
            )
        except (asyncio.TimeoutError, RuntimeError) as e:
            return _json({"status": "failed", "error": str(e) or "timed out"}, 503)
        if result.finish_reason == "abort":
            return _json({"status": "failed", "error": result.meta.get("error")}, 503)
        return _json({"status": "ok"}, 200)

    async def model_info(self, _: web.Request) -> web.Response:
        inst = self.instance()
        path = inst.engine.config.model_path
        info = {
            "model_path": path,
            "tokenizer_path": path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "served_model_name": inst.model_name,
            "max_context_length": inst.engine.max_context,
        }
        return _json(info, 200)

    async def flush_cache(self, _: web.Request) -> web.Response:
        inst = self.instance()
        flushed = await inst.loop.call(inst.engine.flush_cache)
        if flushed is None:
            message = "Cache not flushed: requests are running or waiting (retry when idle)."
            return web.Response(text=message, status=400)
        return web.Response(text=f"Cache flushed ({flushed} cached pages forgotten).")

    async def abort_request(self, request: web.Request) -> web.Response:
        """Abort the request `rid` (and the requests of a batch or of `n` choices started
        under it: `rid-0`, `rid-1`, ...), or every request with `abort_all`."""
        try:
            body = await request.json()
            expect(isinstance(body, dict), "the body must be a JSON object")
            rid, every = body.get("rid"), body.get("abort_all", False)
            expect(isinstance(every, bool), "abort_all must be true or false")
            expect(every or isinstance(rid, str), "give rid (a string) or abort_all: true")
        except ValueError as e:
            return _json(error_body(str(e), 400), 400)
        inst = self.instance()
        aborted = await inst.loop.call(_abort, inst, rid, every)
        return _json({"aborted": aborted}, 200)


def _abort(inst, rid: str | None, every: bool) -> list[str]:
    """On the engine thread: end the matching requests (their streams get their last chunk)."""
    engine = inst.engine
    hits = [
        r
        for r, req in engine.requests.items()
        if not req.finished and (every or r == rid or r.startswith(f"{rid}-"))
    ]
    for r in hits:
        if not engine.connector.abort(r):
            engine.abort(r)
    return hits


async def _result(chunks):
    async for chunk in chunks:
        if chunk.finished:
            return chunk.result
    raise RuntimeError("the request ended without a result")


def _json(body: dict, status: int) -> web.Response:
    return web.json_response(body, status=status)
