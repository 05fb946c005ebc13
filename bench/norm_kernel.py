"""Fused residual add + RMSNorm: the Triton kernel against the torch code it replaces, at DeepSeek-V3's
hidden size (7168, bfloat16), as bandwidth against the device copy measured in the same run.

    python -m bench.norm_kernel [--rows 1,32,128,1024,8192]

Bytes counted: what must move (x and the residual read, the sum and the output written, the
weight read once). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.cuda_timing import copy_bandwidth, median_seconds


def torch_add_norm(x, residual, norm):
    total = residual + x
    return norm(total), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 128, 1024, 8192]
    )
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default="bench/results/norm_kernel.json")
    args = parser.parse_args()

    from dserve.kernels.triton_norm import rms_norm
    from dserve.models.layers.norm import RMSNorm

    copy = copy_bandwidth()
    norm = RMSNorm(args.hidden).to(device="cuda", dtype=torch.bfloat16)
    rows = []
    print(
        f"{'rows':>6} {'triton us':>10} {'GB/s':>8} {'of copy':>8} {'torch us':>10} {'speedup':>8}"
    )
    for n in args.rows:
        x = torch.randn(n, args.hidden, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        nbytes = 4 * x.numel() * x.element_size() + norm.weight.numel() * norm.weight.element_size()
        ours = median_seconds(lambda x=x, r=r: rms_norm(x, norm.weight, norm.eps, r), args.repeats)
        theirs = median_seconds(lambda x=x, r=r: torch_add_norm(x, r, norm), args.repeats)
        rows.append(
            {
                "rows": n,
                "triton_s": ours,
                "torch_s": theirs,
                "gb_per_s": nbytes / ours / 1e9,
                "fraction_of_copy": nbytes / ours / copy,
            }
        )
        print(
            f"{n:>6} {ours * 1e6:>10.1f} {nbytes / ours / 1e9:>8.0f} {nbytes / ours / copy:>8.1%} "
            f"{theirs * 1e6:>10.1f} {theirs / ours:>7.1f}x"
        )
    print(f"device copy: {copy / 1e9:.0f} GB/s (read + write)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "hidden": args.hidden,
                "copy_gb_per_s": copy / 1e9,
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
