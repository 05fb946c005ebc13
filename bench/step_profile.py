"""Where one step's GPU time goes: kernel time by kernel name, against the step's replayed time.

    python -m bench.step_profile [--layers 4 --experts 32] [--batch 1] [--q-len 1] [--context 1024]
                                 [--quantization fp8]

Profiles one step of the DeepSeek-V3-shaped model (`load_format=dummy`, triton backend) with
`torch.profiler`, sums the device time of each kernel name, and prints the top kernels with their
share of the summed kernel time. The step's time replayed from a CUDA graph is printed next to the
sum: the difference is time the GPU spends between kernels and waiting for the host, whose time
to pack the inputs and launch the replay is printed too.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from bench.cuda_timing import median_seconds
from bench.spec_verify import deepseek_v3_config_dir, dummy_runner, model_args, step_batch


def kernel_times(runner, batch) -> dict[str, tuple[int, float]]:
    """Per kernel name: (calls, device microseconds) in one eager step."""
    from torch.profiler import ProfilerActivity, profile

    device_batch = batch.to(runner.device)
    runner.run_model(device_batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.run_model(device_batch)
        torch.cuda.synchronize()
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name][0] += 1
            totals[event.name][1] += event.device_time
    return {name: (calls, us) for name, (calls, us) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(parser)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument(
        "--host-profile", action="store_true", help="also cProfile the host side of 50 steps"
    )
    args = parser.parse_args()

    tokens = args.batch * args.q_len
    runner, kv = dummy_runner(
        deepseek_v3_config_dir(args.layers, args.experts, args.dense_layers),
        args.batch,
        args.context,
        "triton",
        tokens,
        args.quantization,
    )
    batch = step_batch(kv, args.batch, args.context, args.q_len)
    times = kernel_times(runner, batch)
    total = sum(us for _, us in times.values())
    step = median_seconds(lambda: runner.forward(batch), 20) * 1e6
    host = []
    for _ in range(20):  # the host's share: packing the inputs and launching the replay, GPU idle
        torch.cuda.synchronize()
        started = time.perf_counter()
        runner.forward(batch)
        host.append((time.perf_counter() - started) * 1e6)
    if args.host_profile:
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            for _ in range(50):
                runner.forward(batch)
                torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    print(f"{'kernel':<60} {'calls':>5} {'us':>8} {'share':>6}")
    for name, (calls, us) in sorted(times.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"{name[:60]:<60} {calls:>5} {us:>8.1f} {us / total:>6.1%}")
    print(
        f"batch {args.batch} x {args.q_len} tokens: kernels {total:.0f} us in {sum(c for c, _ in times.values())} "
        f"launches; replayed step {step:.0f} us, of which host {statistics.median(host):.0f} us"
    )


if __name__ == "__main__":
    main()
