"""Serving benchmark against any dserve (or SGLang-compatible) URL: a router, a colocated instance.

    python -m bench.serving --url http://127.0.0.1:30000 --dataset random --num-prompts 200 \\
        --input-len 512 --output-len 128 --request-rate 8
    python -m bench.serving --url ... --dataset fixed --max-concurrency 16 \\
        --endpoint /v1/chat/completions

Requests are streamed to `/generate` (input_ids), `/v1/completions` (a prompt of token ids) or
`/v1/chat/completions` (a user message of words, as the chat route takes text), each with
`ignore_eos` so it runs to its output length. Tokens are counted as the server counts them:
`/generate` events carry meta_info's completion_tokens (whether they stream the whole output
so far, SGLang's default, or only what is new); the OpenAI routes are asked for usage
(`stream_options.include_usage`) and their last chunk's usage is the count (an event may carry
several tokens, e.g. with speculative decoding). `random`: lengths uniform in [ratio*len, len];
`fixed`: exactly len. Arrivals are Poisson at `--request-rate` (inf: all at once), optionally
capped at `--max-concurrency` in flight. Prints SGLang bench_serving's figures (request, input,
output and total token throughput, concurrency; E2E, TTFT, TPOT and ITL mean / median / p95 /
p99), writes JSON and a PNG (latency CDFs and TTFT over the run; matplotlib comes with
`make install`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

import aiohttp

ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions")
WORDS = ("the", "a", "serving", "engine", "splits", "prefill", "and", "decode", "into", "pages")


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


def request_body(args, ids: list[int], n_out: int) -> dict:
    if args.endpoint == "/generate":
        params = {"max_new_tokens": n_out, "temperature": 0, "ignore_eos": True}
        return {"input_ids": ids, "stream": True, "sampling_params": params}
    body = {
        "max_tokens": n_out,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "model": args.model,
    }
    if args.endpoint == "/v1/completions":
        return {**body, "prompt": ids}
    text = " ".join(WORDS[t % len(WORDS)] for t in ids)  # about one token a word
    return {**body, "messages": [{"role": "user", "content": text}]}


class Counts:
    """A stream's token counts: what its events showed, and what the server reported (the
    OpenAI routes' usage; `/generate`'s meta_info, on every event as SGLang sends it)."""

    def __init__(self):
        self.seen, self.usage, self.meta = 0, None, None

    def event(self, event: dict) -> bool:
        """Take one event; whether it brought output (a token or text)."""
        if event.get("usage"):
            self.usage = event["usage"]
        if "output_ids" in event:
            return self._generate(event)
        choice = (event.get("choices") or [{}])[0]
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        self.seen += bool(text)
        return bool(text)

    def _generate(self, event: dict) -> bool:
        """`/generate` streams the whole output so far (SGLang's default) or only what is new:
        meta_info's completion_tokens counts either way."""
        before = self.seen
        self.meta = event.get("meta_info") or self.meta
        if self.meta and "completion_tokens" in self.meta:
            self.seen = self.meta["completion_tokens"]
            self.usage = {k: self.meta[k] for k in ("prompt_tokens", "completion_tokens")}
        else:
            self.seen += len(event["output_ids"])
        return self.seen > before

    @property
    def output(self) -> int:
        return self.usage["completion_tokens"] if self.usage else self.seen


async def one(session, args, ids: list[int], n_out: int) -> dict:
    body = request_body(args, ids, n_out)
    start = time.perf_counter()
    stamps, counts, error = [], Counts(), None
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
                    if counts.event(event):
                        stamps.append(time.perf_counter())
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    ttft = (stamps[0] - start) if stamps else None
    output = counts.output
    tpot = None
    if ttft is not None and output > 1:
        tpot = (end - start - ttft) / (output - 1)
    return {
        "start": start,
        "ttft": ttft,
        "itl": itl,
        "tpot": tpot,
        "e2e": end - start,
        "input_len": counts.usage["prompt_tokens"] if counts.usage else len(ids),
        "output_tokens": output,
        "error": error,
        "meta": counts.meta,
    }


async def run(args) -> list[dict]:
    requests = make_requests(args)
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    rng = random.Random(args.seed + 1)
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        if args.endpoint != "/generate" and args.model is None:
            async with session.get(args.url + "/v1/models") as r:
                args.model = (await r.json())["data"][0]["id"]

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
    mean = sum(values) / len(values)
    return {
        "mean": mean,
        "median": pick(0.5),
        "p50": pick(0.5),
        "p90": pick(0.9),
        "p95": pick(0.95),
        "p99": pick(0.99),
        "std": (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5,
    }


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["error"] is None]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["input_len"] for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "duration_s": wall,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / wall,
        "input_token_throughput": in_tokens / wall,
        "output_token_throughput": out_tokens / wall,
        "total_token_throughput": (in_tokens + out_tokens) / wall,
        "concurrency": sum(r["e2e"] for r in ok) / wall,
        "ttft_s": percentiles([r["ttft"] for r in ok if r["ttft"] is not None]),
        "tpot_s": percentiles([r["tpot"] for r in ok if r["tpot"] is not None]),
        "itl_s": percentiles([x for r in ok for x in r["itl"]]),
        "e2e_s": percentiles([r["e2e"] for r in ok]),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
    }


def print_table(summary: dict) -> None:
    s = summary
    rows = [
        ("Successful requests", f"{s['requests'] - s['failed']} of {s['requests']}"),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", s["total_input_tokens"]),
        ("Total generated tokens", s["total_output_tokens"]),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{s['input_token_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_token_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
        ("Concurrency", f"{s['concurrency']:.2f}"),
    ]
    for name, value in rows:
        print(f"{name:<34} {value:>12}")
    print(f"{'latency (ms)':<12} {'mean':>9} {'median':>9} {'p95':>9} {'p99':>9}")
    for name in ("e2e_s", "ttft_s", "tpot_s", "itl_s"):
        p = s[name]
        if p:
            figures = " ".join(f"{p[k] * 1e3:>9.2f}" for k in ("mean", "median", "p95", "p99"))
            print(f"{name[:-2].upper():<12} {figures}")
    for e in s["errors"]:
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
    parser.add_argument("--endpoint", default="/generate", choices=ENDPOINTS)
    parser.add_argument(
        "--model",
        default=None,
        help="model name for the OpenAI routes (default: the server's first in /v1/models)",
    )
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
