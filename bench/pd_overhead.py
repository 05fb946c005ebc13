"""What disaggregation costs a user: time to first token and inter-token latency of one request
at a time, served colocated (`dserve serve`) and disaggregated (`dserve prefill` + `dserve
decode` + `dserve router`) on the same device(s), per prompt length, and their ratio.

    python -m bench.pd_overhead [--lengths 1024,4096,16384] [--requests 8] [--output-len 32]
                                [--model-path DIR | --layers 4 --experts 32] [--device cuda]
                                [--prefill-env CUDA_VISIBLE_DEVICES=0 --decode-env ...=1]
                                [--server-args='...' --router-args='...']
                                [--pd-modes shared,whole] [--colocated-runs 2] [--starts 3]

`--server-args` and `--router-args` take one string of flags; write it after `=` when it starts
with `--` (`--server-args=--no-kv-streaming`), or argparse reads it as a flag of its own.
`--interleave` starts them all at once and sends each prompt to each in turn (the GPU's drift
then weighs on every mode alike; all instances must fit their devices together).
`--direct-prefill` also sends each pair's prefill a request of its own (a new prompt, the fields
its router adds, no decode to meet) and times its first token: the pair's TTFT without the router
and the decode, printed beside the pair's.
`--pd-modes`: the pair with the router's shared streams (`shared`, the default: the first
token's events come from the prefill) and/or without them (`whole`, `--no-shared-streams`: the
whole stream from the decode, as SGLang's and vLLM's routers serve it). `--colocated-runs 2`
runs the colocated instance before and after the pairs; each length's colocated p50 is then the
lower of the two (a GPU's clocks drift between runs; the lower makes the ratio conservative).
`--starts 3` does all of it three times with fresh processes and reports the start of the median
TTFT ratio (two starts of one instance differ in their own compute by up to ~4% at 1k tokens).

Without `--model-path` the model is DeepSeek-V3-shaped with random weights (`--load-format
dummy`, `bench.spec_verify.deepseek_v3_config_dir`). The colocated instance runs first, alone,
then the pair; every instance gets a KV pool of `--max-total-tokens` 4 x the longest prompt +
8192 unless `--server-args` says otherwise (so instances sharing a GPU all fit); each serves
two warm-up requests per length before the timed ones (streamed
`/generate`, `ignore_eos`, random tokens, greedy, `--max-concurrency 1` as `bench.serving` would
run them). Prints a table (p50 / p99 of TTFT and ITL, ms), writes JSON and, with matplotlib, a
PNG of the TTFT ratio by length. The issue's goal: disaggregated TTFT <= 1.05x colocated at 1k,
4k and 16k prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import aiohttp

from bench.pd_marks import summary, timeline_table
from bench.serving import one


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `dserve` process (and its ranks), its output in a log file."""

    def __init__(self, args: list[str], log_dir: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(log_dir, f"{args[0]}-{self.port}.log"), "w")  # noqa: SIM115
        cmd = [sys.executable, "-m", "dserve.runtime.cli", *args, "--port", str(self.port)]
        self.popen = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                self.log.flush()
                with open(self.log.name) as f:
                    tail = f.read()[-3000:]
                what = self.popen.args[3]
                raise RuntimeError(f"{what} exited; {self.log.name} ends:\n{tail}")
            health = self.url + "/health"
            with contextlib.suppress(OSError), urllib.request.urlopen(health, timeout=2) as r:
                if r.status == 200:
                    return
            time.sleep(0.3)
        raise TimeoutError(f"not ready in {timeout} s; see {self.log.name}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        self.log.close()


def start(mode: str, model: list[str], args, log_dir: str) -> tuple[str, list[Server]]:
    """The URL clients use and every process started, ready."""
    if mode == "colocated":
        servers = [Server(["serve", *model], log_dir, env_of(args.prefill_env))]
    else:
        boot = ["--bootstrap-port", str(free_port())]
        prefill = Server(["prefill", *model, *boot], log_dir, env_of(args.prefill_env))
        decode = Server(["decode", *model], log_dir, env_of(args.decode_env))
        servers = [prefill, decode]
    try:
        for s in servers:
            s.wait_ready()
        if mode != "colocated":
            ends = ["--prefill", servers[0].url, "--decode", servers[1].url]
            ends += ["--shared-streams" if mode == "shared" else "--no-shared-streams"]
            router = Server(["router", *ends, *args.router_args.split()], log_dir)
            servers.append(router)
            router.wait_ready()
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers[-1].url, servers


def run_round(modes: list[str], model: list[str], args, logs: str) -> dict[str, dict]:
    """Start the modes' instances (together), measure them, stop them."""
    urls, started = {}, []
    try:
        for mode in modes:
            urls[mode], servers = start(mode, model, args, logs)
            started += servers
            if args.direct_prefill and mode != "colocated":
                urls[mode + DIRECT] = servers[0].url
        return asyncio.run(measure(urls, args))
    finally:
        for s in reversed(started):
            s.stop()


def env_of(pairs: list[str]) -> dict:
    return dict(p.split("=", 1) for p in pairs)


async def measure(urls: dict[str, str], args) -> dict[str, dict]:
    """Per served mode (its URL) and length: the TTFT and ITL percentiles of `--requests`
    requests, one at a time. Several modes take turns, request by request, with the same
    prompt (`--interleave`: a GPU's drift then weighs on all of them alike)."""
    rng = random.Random(args.seed)
    clients = {
        mode: argparse.Namespace(url=url, endpoint="/generate", model=None)
        for mode, url in urls.items()
    }
    out: dict[str, dict] = {mode: {} for mode in urls}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for mode, client in clients.items():
            if mode.endswith(DIRECT):  # the prefill's bootstrap port, read once
                async with session.get(client.url + "/server_info") as r:
                    client.bootstrap_port = (await r.json())["bootstrap_port"]
        for length in args.lengths:
            results: dict[str, list] = {mode: [] for mode in urls}
            for i in range(args.warmup + args.requests):
                ids = [rng.randrange(10, args.vocab) for _ in range(length)]
                for mode, client in clients.items():
                    if mode.endswith(DIRECT):  # a new prompt: not a hit in the pair's cache
                        fresh = [rng.randrange(10, args.vocab) for _ in range(length)]
                        result = await prefill_first_token(session, client, fresh, rng)
                    else:
                        result = await one(session, client, ids, args.output_len)
                    if result["error"]:
                        error = result["error"]
                        raise RuntimeError(f"{mode}, {length}-token request failed: {error}")
                    if i >= args.warmup:
                        results[mode].append(result)
            for mode, got in results.items():
                out[mode][length] = summary(got)
    return out


DIRECT = ":prefill"  # `--direct-prefill`: a pair's prefill asked without its router


async def prefill_first_token(session, client, ids: list[int], rng) -> dict:
    """A pair's prefill (`client.url`, its `bootstrap_port`) asked directly, with the fields
    its router adds (a room no decode registers): the time to its first token's event; the
    client then leaves, which ends the room. The TTFT of the pair without the router and the
    decode."""
    share = {"id": f"{rng.randrange(1 << 60):x}", "created": int(time.time())}
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": client.bootstrap_port,
        "bootstrap_room": rng.randrange(1 << 62),
        "shared_stream": share,
    }
    start, ttft, error = time.perf_counter(), None, None
    async with session.post(client.url + "/generate", json=body) as resp:
        if resp.status != 200:
            return {"ttft": None, "error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
        async for line in resp.content:
            if b'"error"' in line:
                error = line.decode()[:200]
                break
            if line.startswith(b"data: {"):
                ttft = time.perf_counter() - start
                break
        resp.close()
    if ttft is None and error is None:
        error = "the stream ended before a token"
    return {"start": start, "ttft": ttft, "itl": [], "meta": None, "error": error}


def model_flags(args) -> list[str]:
    if args.model_path:
        path, dummy = args.model_path, []
    else:
        from bench.spec_verify import deepseek_v3_config_dir

        path, dummy = deepseek_v3_config_dir(args.layers, args.experts), ["--load-format", "dummy"]
    flags = ["--model", path, *dummy, "--device", args.device, "--no-load-progress"]
    extra = args.server_args.split()
    if "--max-total-tokens" not in extra:  # a fixed pool: instances sharing a GPU all fit
        flags += ["--max-total-tokens", str(4 * max(args.lengths) + 8192)]
    return flags + extra


def table(rows: list[dict]) -> None:
    """TTFT, its p99, ITL, the time to the second token ("2nd": with shared streams the
    first token comes from the prefill, the second still waits for the KV transfer), the
    part of the TTFT outside the instance that computed the first token ("out", `pd_marks.outside_s`)
    and the first part of that, before the instance had the request ("in", `pd_marks.inbound_s`)."""
    head = ("pd", "len", "TTFT co", "TTFT pd", "ratio", "p99 co", "p99 pd", "ITL co", "ITL pd")
    head += ("2nd co", "2nd pd", "out co", "out pd", "in co", "in pd")
    widths = (6, 6, 8, 8, 6, 8, 8, 7, 7, 7, 7, 6, 6, 6, 6)
    line = " ".join(f"{{:>{w}}}" for w in widths)
    print(line.format(*head) + "   (ms, p50 unless p99; out: TTFT outside the instance)")
    for r in rows:
        print(
            f"{r['mode']:>6} {r['length']:>6} {r['ttft_co_p50']:>8.1f} {r['ttft_pd_p50']:>8.1f} "
            f"{r['ttft_ratio']:>6.2f} {r['ttft_co_p99']:>8.1f} {r['ttft_pd_p99']:>8.1f} "
            f"{r['itl_co_p50']:>7.2f} {r['itl_pd_p50']:>7.2f} "
            f"{r['second_co_p50']:>7.1f} {r['second_pd_p50']:>7.1f} "
            f"{r['outside_co_p50']:>6.2f} {r['outside_pd_p50']:>6.2f} "
            f"{r['in_co_p50']:>6.2f} {r['in_pd_p50']:>6.2f}",
            flush=True,
        )


def direct_table(rows: list[dict]) -> None:
    """`--direct-prefill`: the pair's TTFT against its prefill's asked directly (the router's
    and the decode's share of it) and the colocated one."""
    rows = [r for r in rows if "ttft_prefill_p50" in r]
    if not rows:
        return
    print("    pd    len  TTFT pd  prefill directly  pd - prefill  co - prefill   (ms, p50)")
    for r in rows:
        pre = r["ttft_prefill_p50"]
        print(
            f"{r['mode']:>6} {r['length']:>6} {r['ttft_pd_p50']:>8.1f} {pre:>17.1f} "
            f"{r['ttft_pd_p50'] - pre:>13.2f} {r['ttft_co_p50'] - pre:>13.2f}"
        )


def rows_of(results: dict, lengths: list[int], modes: list[str]) -> list[dict]:
    """A row per pair mode and length; the colocated side is the colocated run of the lower
    TTFT p50 at that length."""
    rows = []
    for mode in modes:
        for length in lengths:
            runs = [run[length] for run in results["colocated"]]
            co = min(runs, key=lambda got: got["ttft_s"]["p50"])
            pd = results[mode][length]
            row = {"mode": mode, "length": length}
            for name, got in (("co", co), ("pd", pd)):
                for q in ("p50", "p99"):
                    row[f"ttft_{name}_{q}"] = 1e3 * got["ttft_s"][q]
                    row[f"itl_{name}_{q}"] = 1e3 * got["itl_s"].get(q, 0.0)
                    row[f"second_{name}_{q}"] = 1e3 * got["second_s"].get(q, 0.0)
                    row[f"outside_{name}_{q}"] = 1e3 * got["outside_s"].get(q, float("nan"))
                    row[f"in_{name}_{q}"] = 1e3 * got["inbound_s"].get(q, float("nan"))
            row["ttft_co_runs_p50"] = [1e3 * got["ttft_s"]["p50"] for got in runs]
            row["ttft_ratio"] = row["ttft_pd_p50"] / row["ttft_co_p50"]
            row["itl_ratio"] = row["itl_pd_p50"] / max(row["itl_co_p50"], 1e-9)
            row["pd_timeline_ms"] = pd["timeline_ms"]
            direct = results.get(mode + DIRECT)
            if direct:
                row["ttft_prefill_p50"] = 1e3 * direct[length]["ttft_s"]["p50"]
            rows.append(row)
    return rows


def plot(rows: list[dict], out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        lengths = [r["length"] for r in mine]
        ttft = [r["ttft_ratio"] for r in mine]
        ax.plot(lengths, ttft, marker="o", label=f"TTFT p50, pd ({mode}) / co")
        itl = [r["itl_ratio"] for r in mine]
        ax.plot(lengths, itl, marker="o", linestyle=":", label=f"ITL p50, pd ({mode}) / co")
    ax.axhline(1.05, color="gray", linestyle="--", label="goal 1.05")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("disaggregated / colocated")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.replace(".json", ".png"), dpi=120)


def run_start(model: list[str], args, logs: str) -> dict:
    """One start of every instance (the rounds of `--interleave` or one after another): the
    results per mode (the colocated one a list of runs)."""
    again = 0 if args.interleave else args.colocated_runs - 1
    order = ["colocated", *args.pd_modes] + ["colocated"] * again
    rounds = [order] if args.interleave else [[mode] for mode in order]
    results = {"colocated": []}
    for modes in rounds:
        for mode, got in run_round(modes, model, args, logs).items():
            if mode == "colocated":
                results[mode].append(got)
            else:
                results[mode] = got
    return results


def median_start(starts: list[list[dict]]) -> list[dict]:
    """Per mode and length, the row of the start whose TTFT ratio is the median (the lower of
    the middle two), with every start's ratio (`ttft_ratio_starts`). Two starts of the same
    instances differ in their own compute time by up to ~0.7 ms at 1k tokens (~4% of the TTFT,
    H100 host): one start cannot tell a 5% goal."""
    out = []
    for i in range(len(starts[0])):
        runs = [got[i] for got in starts]
        row = dict(sorted(runs, key=lambda r: r["ttft_ratio"])[(len(runs) - 1) // 2])
        row["ttft_ratio_starts"] = [r["ttft_ratio"] for r in runs]
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    names = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--lengths", type=ints, default=[1024, 4096, 16384])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--model-path", help="a checkpoint (default: DeepSeek-V3 shapes, dummy)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000, help="token ids drawn below this")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--server-args", default="", help="more flags for every instance")
    parser.add_argument("--router-args", default="", help="more flags for the router")
    parser.add_argument("--prefill-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--decode-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--log-dir",
        help="keep the instances' logs here (default: a temporary folder, removed); with "
        "--server-args '--log-level debug' each push's agent timeline is in the prefill's",
    )
    parser.add_argument("--pd-modes", type=names, default=["shared"], help="shared,whole")
    parser.add_argument("--colocated-runs", type=int, choices=(1, 2), default=1)
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="start the colocated instance and the pairs together and send each prompt to "
        "each in turn (every instance on the device at once; --colocated-runs is then 1)",
    )
    parser.add_argument(
        "--direct-prefill",
        action="store_true",
        help="also time each pair's prefill asked directly with its router's fields (a new "
        "prompt each, its first token only): the pair's TTFT without the router and the decode",
    )
    parser.add_argument(
        "--starts",
        type=int,
        default=1,
        help="start every instance this many times (fresh processes) and report, per length, "
        "the start of the median TTFT ratio with every start's ratio",
    )
    parser.add_argument("--out", default="bench/results/pd_overhead.json")
    args = parser.parse_args(argv)
    if not args.pd_modes or set(args.pd_modes) - {"shared", "whole"}:
        parser.error("--pd-modes: shared and/or whole")
    model = model_flags(args)
    starts = []
    with contextlib.ExitStack() as stack:
        logs = args.log_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="pd-"))
        os.makedirs(logs, exist_ok=True)
        for start in range(args.starts):
            if args.starts > 1:
                print(f"start {start + 1} of {args.starts}:", flush=True)
            results = run_start(model, args, logs)
            rows = rows_of(results, args.lengths, args.pd_modes)
            table(rows)
            direct_table(rows)
            for mode in args.pd_modes:
                timeline_table(results, args.lengths, mode)
            starts.append(rows)
    rows = median_start(starts)
    if args.starts > 1:
        print(f"the start of the median TTFT ratio, per mode and length, of {args.starts}:")
        table(rows)
        for r in rows:
            ratios = ", ".join(f"{x:.3f}" for x in r["ttft_ratio_starts"])
            print(f"  {r['mode']} {r['length']}: TTFT ratios {ratios}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        meta = {k: v for k, v in vars(args).items() if k != "out"}
        json.dump({**meta, "rows": rows}, f, indent=2)
    plot(rows, args.out)
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
