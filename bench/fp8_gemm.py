"""FP8 against BF16 GEMMs at DeepSeek-V3's linear shapes, with the launch-parameter sweep that
fills the FP8 kernel's table.

For each N x K of DeepSeek-V3's quantized linears (one GPU holding whole matrices, as DP attention
and the dense layers do) and M = 1 .. 4096 tokens, it times the BF16 product (torch, cuBLAS) and
the FP8 one (`kernels/fp8_gemm.py`: activation quantization included), each on its own
dequantized-equal weights, CUDA-graph replays so the host's launch cost is left out, each call
reading its own copy of the weight from memory (copies past the L2 cache's size, back to back in
one graph, as the GEMMs of a captured step run). The
linears that read a norm's output (`NORM_FED`) get their input quantized by the norm in a step
(`models.quant.quantize_in_norms`): for them the table also times the GEMM alone from FP8
input ("in step"), the speedup a step sees. With
`--sweep` it tries cuBLAS's scaled GEMM (where it takes the shape) against Triton launch
configurations per shape and M bucket (up to 256 tokens a grid of tiles with split-K; beyond,
the table's, or with `--sweep-grid` a grid of tiles), keeps the fastest and updates the table
(`kernels/fp8_gemm_configs.json`) the GEMM reads; without it, the table's choice.
The weight scales are held column-major, as a loaded model holds them.

    python -m bench.fp8_gemm [--sweep [--sweep-grid]] [--ms 1,16,64,256,4096] [--block 128]
                             [--shapes 'q_b,o_proj']

Prints a table (times in microseconds, speedup = BF16 / FP8) and writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from bench.cuda_timing import graph_seconds_each

SHAPES = {  # name: (N, K)
    "q_a + kv_a (fused)": (2112, 7168),
    "q_b": (24576, 1536),
    "o_proj": (7168, 16384),
    "dense gate_up": (36864, 7168),
    "dense down": (7168, 18432),
    "shared gate_up": (4096, 7168),
    "shared down": (7168, 2048),
}
NORM_FED = ("q_a + kv_a (fused)", "q_b", "dense gate_up", "shared gate_up")
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
GRID = [
    dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=w, num_stages=s)
    for bm, bn, w, s in itertools.product((16, 32, 64, 128), (64, 128), (4, 8), (3, 4))
]
SMALL_M = 256  # up to here the sweep tries split-K tiles
SPLIT_GRID = [
    dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=1, num_warps=4, num_stages=s, SPLIT_K=sk)
    for bm, bn, s, sk in itertools.product((16, 32, 64), (64, 128), (3, 4), (1, 2, 4, 8))
]


def weights(n: int, k: int, block: int):
    """(FP8 weight, its scale per row and block, the same weight dequantized in BF16)."""
    from dserve.models.quant import Fp8Scheme, dequantize, per_row, quantize

    w = torch.randn(n, k, device="cuda") / k**0.5
    scheme = Fp8Scheme("block", (block, block))
    q, scale = quantize(w.cpu(), scheme)
    rows = per_row(scale, scheme, n).contiguous()
    q, rows = q.cuda(), rows.t().contiguous().t().cuda()  # column-major, as `finish_fp8`
    return q, rows, dequantize(q, rows, block, torch.bfloat16)


COLD_BYTES = 256 << 20  # BF16 weight copies per shape: 5x the L2 of an H100 or H200


def weight_copies(n: int, k: int, block: int) -> list[tuple]:
    """Enough copies of `weights(n, k, block)` that their BF16 bytes exceed COLD_BYTES: timed
    in turn, each GEMM reads its weight from memory, as in a model's step."""
    first = weights(n, k, block)
    count = max(1, -(-COLD_BYTES // (n * k * 2)))
    return [first] + [tuple(t.clone() for t in first) for _ in range(count - 1)]


def fits(cfg: dict, m: int) -> bool:
    """Leave out tiles far taller than M (they only waste the sweep's time)."""
    return cfg["BLOCK_M"] <= max(16, 2 * m)


def time_case(x, copies, block: int, configs: list[dict]) -> tuple[float, float, dict]:
    """(BF16 seconds, best FP8 seconds, its configuration) per GEMM, each call on its own copy
    of the weight (`weight_copies`); no `configs`: the table's."""
    from dserve.kernels.fp8_gemm import cublas_takes, fp8_matmul, launch_config

    linear = torch.nn.functional.linear
    bf16 = graph_seconds_each([lambda d=d: linear(x, d) for _, _, d in copies], 10)
    if not configs:
        (m, k), n = x.shape, copies[0][0].shape[0]
        configs = [launch_config(m, n, k, cublas_takes(n, k, block, False, x.device))]
    best, best_cfg = float("inf"), None
    for cfg in configs:
        calls = [lambda q=q, s=s, cfg=cfg: fp8_matmul(x, q, s, block, cfg) for q, s, _ in copies]
        try:
            t = graph_seconds_each(calls, 10)
        except Exception:  # noqa: BLE001 - a configuration the GPU cannot run (shared memory)
            continue
        if t < best:
            best, best_cfg = t, cfg
    return bf16, best, best_cfg


def prequantized_seconds(x, copies, block: int, cfg: dict) -> float:
    """Seconds per FP8 GEMM from x already quantized (as a norm hands it over)."""
    from dserve.kernels.fp8_gemm import quantize_for, quantized_matmul

    pre, m = quantize_for(x, copies[0][1], block), x.shape[0]
    calls = [
        lambda q=q, s=s: quantized_matmul(pre, m, x.dtype, q, s, block, cfg) for q, s, _ in copies
    ]
    return graph_seconds_each(calls, 10)


def candidates(m: int, n: int, k: int, block: int, grid: bool) -> list[dict]:
    """cuBLAS where it takes the shape, and Triton: up to SMALL_M tokens the split-K tiles that
    suit M, beyond it the table's launch configuration (`grid`: the Triton grid's tiles)."""
    from dserve.kernels.fp8_gemm import CUBLAS, cublas_takes, launch_config

    if m <= SMALL_M:
        triton = [c for c in SPLIT_GRID if fits(c, m)]
    elif grid:
        triton = [c for c in GRID if fits(c, m)]
    else:
        triton = [launch_config(m, n, k, False)]
    return ([CUBLAS] if cublas_takes(n, k, block, False, "cuda") else []) + triton


def main() -> None:
    from dserve.kernels.fp8_gemm import CONFIGS, m_bucket

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ms", type=lambda s: [int(x) for x in s.split(",")], default=MS)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--sweep", action="store_true", help="cuBLAS against the table's Triton")
    parser.add_argument(
        "--sweep-grid", action="store_true", help="sweep Triton's grid beyond SMALL_M too"
    )
    parser.add_argument("--shapes", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--table", default=CONFIGS, help="where --sweep writes the table")
    parser.add_argument("--out", default="bench/results/fp8_gemm.json")
    args = parser.parse_args()
    rows, table = [], {}
    if args.sweep and os.path.isfile(args.table):  # entries not swept now are kept
        with open(args.table) as f:
            table = json.load(f)
    print(
        f"{'shape':<20} {'N x K':>12} {'M':>5} {'bf16 us':>8} {'fp8 us':>8} {'speedup':>7} "
        f"{'in step':>7} {'gemm':>7}"
    )
    chosen = args.shapes.split(",") if args.shapes else list(SHAPES)
    for name in chosen:
        n, k = SHAPES[name]
        copies = weight_copies(n, k, args.block)
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            grid = candidates(m, n, k, args.block, args.sweep_grid) if args.sweep else []
            bf16, fp8, cfg = time_case(x, copies, args.block, grid)
            table.setdefault(f"{n}x{k}", {})[str(m_bucket(m))] = cfg
            in_step = fp8
            if name in NORM_FED:
                in_step = prequantized_seconds(x, copies, args.block, cfg)
            row = dict(shape=name, n=n, k=k, m=m, bf16_us=bf16 * 1e6, fp8_us=fp8 * 1e6)
            row.update(speedup=bf16 / fp8, fp8_in_step_us=in_step * 1e6)
            row.update(speedup_in_step=bf16 / in_step, config=cfg)
            rows.append(row)
            print(
                f"{name:<20} {f'{n}x{k}':>12} {m:>5} {row['bf16_us']:>8.1f} "
                f"{row['fp8_us']:>8.1f} {row['speedup']:>7.2f} "
                f"{row['speedup_in_step']:>7.2f} {cfg.get('backend', 'triton'):>7}",
                flush=True,
            )
        del copies
    if args.sweep:
        with open(args.table, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        print(f"wrote the launch table {args.table}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "block": args.block, "rows": rows}, f)
    small = [r["speedup_in_step"] for r in rows if r["m"] <= 256]
    print(
        f"wrote {args.out}; at M <= 256 the FP8 GEMM (as a step runs it) is "
        f"{min(small):.2f}x-{max(small):.2f}x BF16"
    )


if __name__ == "__main__":
    main()
