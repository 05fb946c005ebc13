"""What the router's hop alone costs a request's first token, with no model behind it (any host):

    python -m bench.router_overhead [--lengths 1024,4096,16384] [--requests 200] [--prefill-ms 17]

One process serves two stub instances that answer at once (`--prefill-ms`: the first event after
that long, a busy wait, as an instance computing a prompt; the router sleeps meanwhile, as it
does in front of a real pair, and wakes for the event): a "prefill" that reads the body and
answers 200 (for a stream the pair shares, `shared_stream`: streams the first event and
`[DONE]`), a "decode" that reads it and streams one event (shared: the next one) and `[DONE]`.
Another runs the real
router (`dserve.runtime.router`) in front of them. The client, in this process, sends streamed
`/generate` requests of N token ids to the decode stub directly, then through the router, one at
a time, and times the first byte of the answer (median and p99, ms). The difference is what the
router adds to a disaggregated TTFT: reading and checking the body, picking a pair, sending it
to both instances and relaying the first event. `bench.pd_overhead` measures the whole pair.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import time

import aiohttp
from aiohttp import web

from bench.pd_overhead import free_port

FIRST_EVENT = b'data: {"text": "a"}\n\n'


NEXT_EVENT = b'data: {"text": "b"}\n\n'


COMPUTE_S = 0.0  # `--prefill-ms`: how long the first token takes (set in the stubs' process)


async def _prefill(request: web.Request) -> web.StreamResponse:
    shared = _shared(await request.read())
    _compute()
    if not shared:
        return web.json_response({"text": "a"})
    return await _events(request, FIRST_EVENT)


async def _decode(request: web.Request) -> web.StreamResponse:
    shared = _shared(await request.read())
    if not shared:  # the first token is the decode's to send: it waits for it too
        _compute()
    return await _events(request, NEXT_EVENT if shared else FIRST_EVENT)


def _compute() -> None:
    """The first token's computation: a busy wait (a sleep would add the timer's slack)."""
    end = time.perf_counter() + COMPUTE_S
    while time.perf_counter() < end:
        pass


def _shared(body: bytes) -> bool:
    """Whether the router shares the stream (the stubs do not parse bodies: that is the
    instances' cost, not the router's)."""
    return b'"shared_stream"' in body


async def _events(request: web.Request, event: bytes) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(event)
    await resp.write(b"data: [DONE]\n\n")
    return resp


def _stub(answer, bootstrap_port: int) -> web.Application:
    async def health(_):
        return web.json_response({"status": "ok"})

    async def info(_):
        return web.json_response({"bootstrap_port": bootstrap_port})

    app = web.Application(client_max_size=2**26)
    app.router.add_post("/generate", answer)
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", info)
    return app


def serve_stubs(prefill_port: int, decode_port: int, compute_s: float = 0.0) -> None:
    """The two stub instances, until killed (aiohttp alone: this process imports no model code)."""
    global COMPUTE_S
    COMPUTE_S = compute_s

    async def serve() -> None:
        for answer, port in ((_prefill, prefill_port), (_decode, decode_port)):
            runner = web.AppRunner(_stub(answer, 1))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(serve())


def serve_router(prefill_port: int, decode_port: int, port: int, shared: bool = True) -> None:
    from dserve.runtime.router import run_router
    from dserve.runtime.server_config import RouterConfig

    urls = (f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}")
    run_router([urls[0]], [urls[1]], RouterConfig(port=port, shared_streams=shared))


async def first_byte(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    """Seconds from sending the request to its answer's first bytes (then read to the end)."""
    start = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    async with session.post(url + "/generate", data=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.content.readany()
        seconds = time.perf_counter() - start
        await resp.read()
    return seconds


async def wait_ready(
    session: aiohttp.ClientSession, url: str, procs: list, timeout_s: float = 60
) -> None:
    """Until `url` answers /health, failing at once if one of `procs` has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        dead = [p.name for p in procs if p.exitcode is not None]
        if dead:
            raise RuntimeError(f"exited before {url} was ready: {dead}")
        try:
            async with session.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready in {timeout_s} s")
        await asyncio.sleep(0.1)


async def measure(
    direct: str, routed: str, lengths: list[int], requests: int, procs: list
) -> list[dict]:
    rows = []
    async with aiohttp.ClientSession() as session:
        for url in (direct, routed):
            await wait_ready(session, url, procs)
        for n in lengths:
            prompt = {"input_ids": list(range(100, 100 + n)), "stream": True}
            body = json.dumps({**prompt, "sampling_params": {"max_new_tokens": 4}}).encode()
            row = {"tokens": n, "body_bytes": len(body)}
            for name, url in (("direct", direct), ("router", routed)):
                for _ in range(max(requests // 10, 2)):  # warm-up
                    await first_byte(session, url, body)
                times = [await first_byte(session, url, body) for _ in range(requests)]
                row[f"{name}_p50_ms"] = 1e3 * statistics.median(times)
                row[f"{name}_p99_ms"] = 1e3 * sorted(times)[int(0.99 * (len(times) - 1))]
            row["router_adds_ms"] = row["router_p50_ms"] - row["direct_p50_ms"]
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--lengths", type=ints, default=[1024, 4096, 16384])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument(
        "--no-shared-streams",
        dest="shared",
        action="store_false",
        help="the router without shared streams (the whole stream from the decode)",
    )
    parser.add_argument(
        "--prefill-ms",
        type=float,
        default=0.0,
        help="the stubs' first event after this long (a busy wait), as a prompt's computation",
    )
    parser.add_argument("--out", default="bench/results/router_overhead.json")
    args = parser.parse_args(argv)
    prefill, decode, router = free_port(), free_port(), free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=serve_stubs, args=(prefill, decode, args.prefill_ms / 1e3), daemon=True),
        ctx.Process(target=serve_router, args=(prefill, decode, router, args.shared), daemon=True),
    ]
    for proc in procs:
        proc.start()
    try:
        direct, routed = f"http://127.0.0.1:{decode}", f"http://127.0.0.1:{router}"
        rows = asyncio.run(measure(direct, routed, args.lengths, args.requests, procs))
    finally:
        for proc in procs:
            proc.kill()
    print(
        f"{'tokens':>7} {'direct p50':>11} {'router p50':>11} {'adds':>7} {'router p99':>11}  (ms)"
    )
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['direct_p50_ms']:>11.3f} {r['router_p50_ms']:>11.3f} "
            f"{r['router_adds_ms']:>7.3f} {r['router_p99_ms']:>11.3f}"
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"cpus": os.cpu_count(), "prefill_ms": args.prefill_ms, "rows": rows}, f, indent=1
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
