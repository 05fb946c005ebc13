"""Serving benchmark against any dserve (or SGLang-compatible) URL: a router, a colocated instance.

    python -m bench.serving --url http://127.0.0.1:30000 --dataset random --num-prompts 200 \\
        --input-len 512 --output-len 128 --request-rate 8
    python -m bench.serving --url ... --dataset fixed --max-concurrency 16

Requests are streamed (`/generate` with input_ids, or `/v1/completions` with `--endpoint`), each with
`ignore_eos` so it runs to its output length. `random`: lengths uniform in [ratio*len, len]; `fixed`:
exactly len. Arrivals are Poisson at `--request-rate` (inf: all at once), optionally capped at
`--max-concurrency` in flight. Prints TTFT / ITL / E2E percentiles and throughput, writes JSON and a
PNG (latency CDFs and TTFT over the run) when matplotlib is installed (`pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

import aiohttp


def make_requests(args) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.num_prompts):
        if args.dataset == "fixed":
            n_in, n_out = args.input_len, args.output_len
        else:
            n_in = rng.randint(max(1, int(args.input_len * args.range_ratio)), args.input_len)
            n_out = rng.randint(max(1, int(args.output_len * args.range_ratio)), args.output_len)
        out.append(([rng.randrange(args.token_low, args.vocab_size) for _ in range(n_in)], n_out))
    return out


async def one(session, args, ids: list[int], n_out: int) -> dict:
    if args.endpoint == "/generate":
        body = {
            "input_ids": ids,
            "stream": True,
            "sampling_params": {"max_new_tokens": n_out, "temperature": 0, "ignore_eos": True},
        }
    else:
        body = {
            "prompt": ids,
            "max_tokens": n_out,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "model": args.model,
        }
    start = time.perf_counter()
    stamps, tokens, error, meta = [], 0, None, None
    try:
        async with session.post(args.url + args.endpoint, json=body) as r:
            if r.status != 200:
                error = f"HTTP {r.status}: {(await r.text())[:200]}"
            else:
                async for line in r.content:
                    line = line.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]["message"]
                        break
                    meta = event.get("meta_info") or meta
                    n = (  # /generate streams the whole output so far
                        len(event["output_ids"]) - tokens
                        if "output_ids" in event
                        else (1 if event["choices"][0].get("text") else 0)
                    )
                    if n:
                        stamps.append(time.perf_counter())
                        tokens += n
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return {
        "start": start,
        "ttft": (stamps[0] - start) if stamps else None,
        "itl": itl,
        "e2e": end - start,
        "input_len": len(ids),
        "output_tokens": tokens,
        "error": error,
        "meta": meta,
    }


async def run(args) -> list[dict]:
    requests = make_requests(args)
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    rng = random.Random(args.seed + 1)
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:

        async def gated(ids, n_out):
            async with limit:
                return await one(session, args, ids, n_out)

        tasks = []
        for ids, n_out in requests:
            tasks.append(asyncio.ensure_future(gated(ids, n_out)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        return await asyncio.gather(*tasks)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]
    return {
        "mean": sum(values) / len(values),
        "p50": pick(0.5),
        "p90": pick(0.9),
        "p99": pick(0.99),
    }


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["error"] is None]
    out_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "duration_s": wall,
        "request_throughput": len(ok) / wall,
        "output_token_throughput": out_tokens / wall,
        "input_token_throughput": sum(r["input_len"] for r in ok) / wall,
        "ttft_s": percentiles([r["ttft"] for r in ok if r["ttft"] is not None]),
        "itl_s": percentiles([x for r in ok for x in r["itl"]]),
        "e2e_s": percentiles([r["e2e"] for r in ok]),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
    }


def print_table(summary: dict) -> None:
    print(
        f"requests {summary['requests']} (failed {summary['failed']}) in {summary['duration_s']:.2f}s: "
        f"{summary['request_throughput']:.2f} req/s, {summary['output_token_throughput']:.1f} output tok/s"
    )
    print(f"{'metric (ms)':<12} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}")
    for name in ("ttft_s", "itl_s", "e2e_s"):
        p = summary[name]
        if p:
            print(
                f"{name[:-2]:<12} "
                + " ".join(f"{p[k] * 1e3:>9.2f}" for k in ("mean", "p50", "p90", "p99"))
            )
    for e in summary["errors"]:
        print("error:", e)


def plot(results: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in results if r["error"] is None and r["ttft"] is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in (
        ("TTFT", [r["ttft"] for r in ok]),
        ("ITL", [x for r in ok for x in r["itl"]]),
        ("E2E", [r["e2e"] for r in ok]),
    ):
        values = sorted(v * 1e3 for v in values)
        if values:
            axes[0].plot(values, [i / len(values) for i in range(1, len(values) + 1)], label=name)
    axes[0].set(
        xscale="log", xlabel="latency (ms)", ylabel="fraction of samples", title="latency CDF"
    )
    axes[0].legend()
    t0 = min((r["start"] for r in ok), default=0)
    axes[1].scatter([r["start"] - t0 for r in ok], [r["ttft"] * 1e3 for r in ok], s=6)
    axes[1].set(xlabel="arrival (s)", ylabel="TTFT (ms)", title="TTFT over the run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--endpoint", default="/generate", choices=["/generate", "/v1/completions"])
    parser.add_argument("--model", help="model name for /v1/completions (default: the served one)")
    parser.add_argument("--dataset", default="random", choices=["random", "fixed"])
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--range-ratio", type=float, default=0.5, help="random: lengths in [ratio*len, len]"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=500, help="prompt token ids are drawn below this"
    )
    parser.add_argument("--token-low", type=int, default=10)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s (Poisson); inf: all at once",
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/serving.json")
    args = parser.parse_args()
    start = time.perf_counter()
    results = asyncio.run(run(args))
    summary = summarize(results, time.perf_counter() - start)
    print_table(summary)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "args": {k: v for k, v in vars(args).items() if k != "request_rate"}
                | {"request_rate": str(args.request_rate)},
                "summary": summary,
                "requests": results,
            },
            f,
        )
    png = os.path.splitext(args.out)[0] + ".png"
    print(
        f"wrote {args.out}"
        + (f" and {png}" if plot(results, png) else " (no plot: matplotlib missing)")
    )


if __name__ == "__main__":
    main()
