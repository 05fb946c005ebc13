"""KV-transfer benchmark: GB/s of moving one room's pages between two ranks through the product's own
path (TransferManager -> TransferAgent -> UCX), by transfer size and page size, next to the plain
copy bandwidth measured in the same run (GPU: cuda:0 -> cuda:1 `copy_`; CPU: a host memcpy) and to one
bare `ucxx` send of the same bytes (`bench.ucx_floor`: what UCX needs with no dserve around it).

    python -m bench.kv_transfer --device cuda --sizes-mib 64,256,1024 --page-sizes 16,64
    python -m bench.kv_transfer --device cpu --sizes-mib 4,32,128
    python -m bench.kv_transfer --device cuda --same-gpu --layers 4 --sizes-mib 0,4,16

The layout defaults to DeepSeek-V3's MLA cache (61 layers, 576-wide latent, bf16). Each size is one
room of consecutive pages: one UCX message, since pools are page-major. Size 0 is a one-page room,
i.e. the fixed cost of a room. Each room gets two times: end to end (commands sent until both
agents' events are back, as the engine sees it) and agent to agent (the sending agent took the push
until every byte was in the receiving pages: the transfer itself). Prints a table, writes JSON and
(with matplotlib) a PNG of GB/s by size.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import statistics
import time

import torch
import zmq

from bench.ucx_floor import bare_ucx_seconds
from dserve.memory.kv_pool import KVLayout, KVPool
from dserve.runtime.config import _DTYPES
from dserve.transfer.commands import Transfer
from dserve.transfer.descriptor import PoolDescriptor
from dserve.transfer.manager import TransferManager


def rank_process(
    front_address: str, device: str, layout: KVLayout, num_pages: int, env: dict, message_mib: int
) -> None:
    os.environ.update(env)
    logging.basicConfig(
        level=int(os.environ.get("BENCH_LOG", "30")), format=f"[{device} agent] %(message)s"
    )
    from dserve.transfer.agent import Placement, TransferAgent, message_pages

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    pool = KVPool(layout, num_pages, device)
    for layer in pool.buffers:
        for b in layer:
            b.normal_()
    if device.startswith("cuda"):
        torch.cuda.synchronize()  # the agent sends pages as they are, without waiting for the device
    desc = PoolDescriptor.from_layout(
        "target", layout, message_pages=message_pages(layout, message_mib)
    )
    agent = TransferAgent(front_address, Placement(0, 0, 1), [(desc, pool)])
    agent.thread.join()


def copy_bandwidth(device: str, nbytes: int, repeats: int = 5, same_gpu: bool = False) -> float:
    """Bytes per second of one plain copy of `nbytes` (cuda:0 -> cuda:1 on GPU, or within
    cuda:0 for `same_gpu`; host memcpy on CPU)."""
    if device == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{0 if same_gpu else 1}")
    else:
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    gpus = 1 if same_gpu else 2
    sync = lambda: [torch.cuda.synchronize(i) for i in range(gpus)] if device == "cuda" else None
    dst.copy_(src)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def copy_path(args) -> str:
    if args.device != "cuda":
        return "host memcpy"
    return "within cuda:0" if args.same_gpu else "cuda:0 -> cuda:1"


def one_room(
    sender: TransferManager,
    receiver: TransferManager,
    peers,
    room: int,
    pages: list[int],
    expect_ahead_s: float,
    timeout: float = 300,
) -> tuple[float, float]:
    """(room, transfer) seconds. The room: from the push (or the expect, when it is not ahead) until
    both sides' events reached this process, the control path included. The transfer: from the
    sending agent taking the push until the receiving agent had every byte in its pages (the agents'
    own timestamps, one clock on a host), without the command and event hops."""
    send_desc, recv_desc = peers
    t = time.perf_counter()
    receiver.expect(room, 0, send_desc, pages, timeout)
    if expect_ahead_s:
        time.sleep(expect_ahead_s)
        t = time.perf_counter()
    sender.push(room, 0, recv_desc, 0, pages, pages, timeout, b"0")
    outcomes = {}
    # wake on either side's event; polling them in turn would add up to a ms each
    poller = zmq.Poller()
    poller.register(sender.sock, zmq.POLLIN)
    poller.register(receiver.sock, zmq.POLLIN)
    while len(outcomes) < 2:
        poller.poll(1000)
        for o in sender.poll() + receiver.poll():
            outcomes[o.transfer] = o
            if not o.ok:
                raise RuntimeError(f"room {room} failed: {o.error}")
    elapsed = time.perf_counter() - t
    logging.getLogger("bench").debug(
        "room %d: started %.6f, both reported +%.3f ms", room, t, elapsed * 1e3
    )
    return elapsed, outcomes[Transfer.RECEIVE].finished - outcomes[Transfer.PUSH].started


def run(args) -> dict:
    dtype = _DTYPES[args.dtype]
    env = dict(kv.split("=", 1) for kv in args.ucx_env)
    copy = copy_bandwidth(args.device, max(1, max(args.sizes_mib)) << 20, same_gpu=args.same_gpu)
    layouts = {
        ps: KVLayout(
            "mla", args.layers, ps, dtype, latent_dim=args.latent, kv_lora_rank=args.latent - 64
        )
        for ps in args.page_sizes
    }
    room_bytes = lambda layout, size: (
        max(1, (size << 20) // layout.bytes_per_page) * layout.bytes_per_page
    )
    bare = (
        bare_ucx_seconds(
            args.device,
            sorted({room_bytes(l, s) for l in layouts.values() for s in args.sizes_mib}),
            args.repeats,
            env,
            same_gpu=args.same_gpu,
        )
        if args.bare
        else {}
    )
    rows, room = [], 1
    for page_size in args.page_sizes:
        layout = layouts[page_size]
        max_pages = -(-(max(args.sizes_mib) << 20) // layout.bytes_per_page) + 1
        managers = [TransferManager(), TransferManager()]
        ctx = mp.get_context("spawn")
        devices = ["cuda:0", "cuda:1"] if args.device == "cuda" else ["cpu", "cpu"]
        if args.device == "cuda" and args.same_gpu:
            devices = ["cuda:0", "cuda:0"]
        procs = [
            ctx.Process(
                target=rank_process,
                args=(m.address, dev, layout, max_pages, env, args.message_mib),
                daemon=True,
            )
            for m, dev in zip(managers, devices)
        ]
        for p in procs:
            p.start()
        try:
            for m in managers:
                m.wait_for_agents(1)
            descs = [m.descriptor({}, 1, 1) for m in managers]
            peers = (descs[0], descs[1])
            one_room(managers[0], managers[1], peers, room, [0], 0)  # connect once
            room += 1
            for size in args.sizes_mib:
                pages = list(range(max(1, (size << 20) // layout.bytes_per_page)))
                nbytes = len(pages) * layout.bytes_per_page
                times, transfers = [], []
                for _ in range(args.repeats):
                    elapsed, transfer = one_room(
                        managers[0], managers[1], peers, room, pages, args.expect_ahead_ms / 1e3
                    )
                    times.append(elapsed)
                    transfers.append(transfer)
                    room += 1
                best, median = min(times), statistics.median(times)
                floor = bare.get(nbytes)
                rows.append(
                    {
                        "page_size": page_size,
                        "size_mib": nbytes / 2**20,
                        "pages": len(pages),
                        "seconds": best,
                        "median_seconds": median,
                        "gb_per_s": nbytes / best / 1e9,
                        "median_gb_per_s": nbytes / median / 1e9,
                        "fraction_of_copy": nbytes / best / copy,
                        "median_fraction_of_copy": nbytes / median / copy,
                        "room_seconds": times,
                        "transfer_seconds": transfers,
                        "bare_ucx_seconds": floor,
                        "transfer_fraction_of_copy": nbytes / min(transfers) / copy,
                        "transfer_median_fraction_of_copy": nbytes
                        / statistics.median(transfers)
                        / copy,
                    }
                )
                bare_cols = (
                    f" {min(floor) * 1e3:>10.2f} {nbytes / statistics.median(floor) / copy:>11.1%}"
                    if floor
                    else ""
                )
                print(
                    f"{page_size:>9} {nbytes / 2**20:>10.1f} {len(pages):>7} {best * 1e3:>10.2f} "
                    f"{nbytes / best / 1e9:>8.2f} {nbytes / best / copy:>8.1%} {nbytes / median / copy:>10.1%} "
                    f"{min(transfers) * 1e3:>10.2f} {rows[-1]['transfer_median_fraction_of_copy']:>11.1%}"
                    + bare_cols,
                    flush=True,
                )
        finally:
            for m in managers:
                m.close()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return {
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "copy_gb_per_s": copy / 1e9,
        "ucx_env": env,
        "message_mib": args.message_mib,
        "expect_ahead_ms": args.expect_ahead_ms,
        "layout": {"layers": args.layers, "latent": args.latent, "dtype": args.dtype},
        "rows": rows,
    }


def plot(result: dict, path: str) -> bool:
    """GB/s by room size, a line per page size, under the plain copy's bandwidth; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for page_size in sorted({r["page_size"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["page_size"] == page_size]
        ax.plot(
            [r["size_mib"] for r in rows],
            [r["gb_per_s"] for r in rows],
            "o-",
            label=f"page {page_size} (best)",
        )
        ax.plot(
            [r["size_mib"] for r in rows],
            [r["median_gb_per_s"] for r in rows],
            "x:",
            label=f"page {page_size} (median)",
        )
        if rows and "transfer_seconds" in rows[0]:
            ax.plot(
                [r["size_mib"] for r in rows],
                [
                    r["size_mib"] * 2**20 / statistics.median(r["transfer_seconds"]) / 1e9
                    for r in rows
                ],
                "^-.",
                label=f"page {page_size}, agent to agent (median)",
            )
    bare = sorted(
        {
            (r["size_mib"], r["size_mib"] * 2**20 / statistics.median(r["bare_ucx_seconds"]) / 1e9)
            for r in result["rows"]
            if r.get("bare_ucx_seconds")
        }
    )
    if bare:
        ax.plot(*zip(*bare), "s--", color="black", alpha=0.6, label="bare ucxx send (median)")
    ax.axhline(result["copy_gb_per_s"], color="gray", linestyle="--", label="plain copy")
    ax.axhline(0.8 * result["copy_gb_per_s"], color="gray", linestyle=":", label="80% of copy")
    ax.set_xscale("log")
    ax.set_xlabel("room size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"KV transfer, {result['gpu'] or result['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.device_count() >= 2 else "cpu",
    )
    parser.add_argument(
        "--sizes-mib", type=lambda s: [int(x) for x in s.split(",")], default=[4, 32, 128]
    )
    parser.add_argument(
        "--page-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64]
    )
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--latent", type=int, default=576)
    parser.add_argument("--dtype", default="bfloat16", choices=list(_DTYPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--ucx-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="UCX setting for both ranks, e.g. UCX_TLS=cuda_copy,cuda_ipc,tcp (repeatable)",
    )
    parser.add_argument(
        "--expect-ahead-ms",
        type=float,
        default=0,
        help="post the decode's receives this long before the push and time from the push, as in "
        "serving, where the decode registers its pages while the prefill computes (0: time "
        "both from the same start)",
    )
    parser.add_argument(
        "--message-mib",
        type=int,
        default=0,
        help="cap on one UCX message (the receiver's AgentConfig.message_mib; 0: a whole page run)",
    )
    parser.add_argument(
        "--bare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time bare ucxx sends of each size (bench.ucx_floor)",
    )
    parser.add_argument(
        "--same-gpu",
        action="store_true",
        help="both ranks on cuda:0 (a prefill and a decode sharing one GPU, as bench.pd_overhead)",
    )
    parser.add_argument("--out", default="bench/results/kv_transfer.json")
    args = parser.parse_args()
    logging.basicConfig(level=int(os.environ.get("BENCH_LOG", "30")), format="[bench] %(message)s")
    print(
        f"{'page_size':>9} {'MiB':>10} {'pages':>7} {'best ms':>10} {'GB/s':>8} {'of copy':>8} {'med/copy':>10}"
        f" {'xfer ms':>10} {'xfer med/copy':>11}"
        + (f" {'bare ms':>10} {'bare med/copy':>11}" if args.bare else "")
    )
    result = run(args)
    print(f"plain copy ({copy_path(args)}): {result['copy_gb_per_s']:.1f} GB/s")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    png = os.path.splitext(args.out)[0] + ".png"
    print(
        f"wrote {args.out}"
        + (f" and {png}" if plot(result, png) else " (no plot: matplotlib missing)")
    )


if __name__ == "__main__":
    main()
