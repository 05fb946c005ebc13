"""The floor under a KV room: one bare `ucxx` tagged send of N bytes between two processes (cuda:0 ->
cuda:1 on GPU, host buffers on CPU), with the same UCX settings the transfer agent uses, and nothing of
dserve around it (no commands, no events, no page runs). `bench.kv_transfer` prints it beside each room
size, so a room's time splits into what UCX itself needs and what dserve's control path adds.

Timing: the receiver posts its receive and says so over a pipe; the sender notes the time and sends;
the receiver notes when its receive completed. Both clocks are `time.perf_counter` (CLOCK_MONOTONIC),
one clock across processes of a host.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import time

import torch

from dserve.transfer.agent import ucx_settings


def agent_ucx_env(device: str) -> dict:
    """The UCX settings `TransferAgent` runs with on a 127.0.0.1 instance."""
    return ucx_settings(device.startswith("cuda"), "127.0.0.1")


def _buffer(device: str, nbytes: int):
    t = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return t if t.is_cuda else t.numpy()


def _receiver(conn, device: str, sizes: list[int], repeats: int, env: dict) -> None:
    for k, v in {**agent_ucx_env(device), **env}.items():
        os.environ.setdefault(k, v)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    import ucxx

    async def main():
        conn.send(ucxx.get_worker_address().tobytes())
        for n in sizes:
            dst = _buffer(device, n)
            for i in range(repeats + 1):
                conn.recv()  # go
                received = asyncio.ensure_future(ucxx.recv(dst, tag=i))
                await asyncio.sleep(0)  # the receive is posted
                conn.send("posted")
                await received
                conn.send(time.perf_counter())

    asyncio.run(main())


def _sender(conn, device: str, sizes: list[int], repeats: int, env: dict, results) -> None:
    for k, v in {**agent_ucx_env(device), **env}.items():
        os.environ.setdefault(k, v)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    import ucxx

    async def main():
        ucxx.get_worker_address()
        peer = ucxx.get_ucx_address_from_buffer(conn.recv())
        ep = await ucxx.create_endpoint_from_worker_address(peer)
        out = {}
        for n in sizes:
            src = _buffer(device, n)
            times = []
            for i in range(repeats + 1):  # the first one warms this size's registration up
                conn.send("go")
                conn.recv()
                start = time.perf_counter()
                await ep.send(src, tag=i, force_tag=True)
                arrived = conn.recv()
                if i:
                    times.append(arrived - start)
            out[n] = times
        results.put(out)
        ep.abort()

    asyncio.run(main())


def bare_ucx_seconds(
    device: str,
    sizes: list[int],
    repeats: int,
    env: dict | None = None,
    same_gpu: bool = False,
) -> dict[int, list[float]]:
    """Seconds of each bare send of each size in `sizes` (bytes), `repeats` per size;
    `same_gpu`: both processes on cuda:0 (a prefill and a decode sharing one GPU)."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    results = ctx.Queue()
    devices = ("cuda:0", "cuda:1") if device == "cuda" else ("cpu", "cpu")
    if device == "cuda" and same_gpu:
        devices = ("cuda:0", "cuda:0")
    procs = [
        ctx.Process(
            target=_sender, args=(a, devices[0], sizes, repeats, env or {}, results), daemon=True
        ),
        ctx.Process(target=_receiver, args=(b, devices[1], sizes, repeats, env or {}), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=300)
    finally:  # done (or failed): ucxx's teardown at a child's exit can hang, so none is awaited
        for p in procs:
            p.kill()
            p.join()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.device_count() >= 2 else "cpu",
    )
    parser.add_argument(
        "--sizes-mib", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 1024]
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--same-gpu", action="store_true", help="both processes on cuda:0")
    parser.add_argument("--ucx-env", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    env = dict(kv.split("=", 1) for kv in args.ucx_env)
    sizes = [m << 20 for m in args.sizes_mib]
    for n, times in bare_ucx_seconds(args.device, sizes, args.repeats, env, args.same_gpu).items():
        print(
            f"{n / 2**20:>8.0f} MiB  best {min(times) * 1e3:7.3f} ms  "
            f"median {statistics.median(times) * 1e3:7.3f} ms  {n / min(times) / 1e9:7.1f} GB/s best"
        )
