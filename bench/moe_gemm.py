"""The fused MoE's grouped GEMMs (`kernels/triton_moe.fused_experts`) at DeepSeek-V3's expert
shapes, FP8 (W8A8) and BF16, against the copy bandwidth, with a sweep of launch parameters.

Each call routes M tokens to `top_k` of `experts` experts (random, a fresh routing per call, so
each call reads its experts' weights from memory, as a decode step does) and runs both grouped
GEMMs, the activation quantization and the slot sum. Bytes = the distinct experts a call touches
times an expert's weights (and scales). Times are CUDA-graph replays of calls back to back.

    python -m bench.moe_gemm [--ms 1,4,16,32,64,128,256] [--experts 256] [--sweep]
                             [--dtypes fp8,bf16]

With `--sweep` each (dtype, M) tries the launch grid and reports the best beside the default;
`--write` stores the best per M bucket in `kernels/moe_gemm_configs.json`, which
`fused_experts` reads. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from bench.cuda_timing import copy_bandwidth, graph_seconds_each

HIDDEN, INTER, BLOCK = 7168, 2048, 128
MS = [1, 4, 16, 32, 64, 128, 256]
GRID = [
    dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
    for bm, bn, w, s in itertools.product((16, 32, 64, 128), (64, 128), (4, 8), (3, 4))
] + [dict(block_m=bm, block_n=256, num_warps=8, num_stages=5) for bm in (16, 32)]
CALLS = 16  # routings per timed graph


def experts(count: int, dtype: str):
    """(w13 [E, 2I, H], w2 [E, H, I], scales or None) with random values."""
    w13 = torch.randn(count, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(count, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16)
    if dtype == "bf16":
        return w13.mul_(HIDDEN**-0.5), w2.mul_(INTER**-0.5), None
    q13, q2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
    del w13, w2
    s13 = torch.rand(count, 2 * INTER, HIDDEN // BLOCK, device="cuda") * 1e-3
    s2 = torch.rand(count, HIDDEN, INTER // BLOCK, device="cuda") * 1e-3
    return q13, q2, (s13, s2)


def routings(m: int, count: int, top_k: int) -> list[tuple]:
    """CALLS (weights, ids) pairs, each token's top_k distinct experts."""
    out = []
    for _ in range(CALLS):
        ids = torch.rand(m, count, device="cuda").topk(top_k, dim=-1).indices
        weights = torch.rand(m, top_k, device="cuda")
        out.append((weights, ids.to(torch.int32)))
    return out


def expert_bytes(w13, w2, scales) -> int:
    total = w13[0].numel() * w13.element_size() + w2[0].numel() * w2.element_size()
    if scales is not None:
        total += (scales[0][0].numel() + scales[1][0].numel()) * 4
    return total


def time_config(x, weights, routes, cfg: dict | None) -> float:
    """Seconds per fused_experts call; `cfg` None: the table's choice (or the defaults)."""
    from dserve.kernels.triton_moe import fused_experts

    w13, w2, scales = weights
    options = dict(cfg or {})
    fp8 = dict(scales=scales, fp8_block=BLOCK) if scales is not None else {}
    calls = [lambda w=w, i=i: fused_experts(x, w13, w2, w, i, **fp8, **options) for w, i in routes]
    return graph_seconds_each(calls, 10)


def measure(m: int, dtype: str, weights, args, bandwidth: float) -> dict:
    count = weights[0].shape[0]
    x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
    routes = routings(m, count, args.top_k)
    touched = sum(len(torch.unique(i)) for _, i in routes) / len(routes)
    nbytes = touched * expert_bytes(*weights)
    default = time_config(x, weights, routes, None)
    best, best_cfg = default, None
    tall = max(16, 4 * m * args.top_k // count)  # row blocks far taller waste the sweep
    for cfg in [c for c in GRID if c["block_m"] <= tall] if args.sweep else []:
        try:
            t = time_config(x, weights, routes, cfg)
        except Exception:  # noqa: BLE001 - a configuration the GPU cannot run (shared memory)
            continue
        if t < best:
            best, best_cfg = t, cfg
    roof = nbytes / bandwidth  # reading at the copy's rate of bytes moved
    return dict(
        dtype=dtype,
        m=m,
        experts=count,
        top_k=args.top_k,
        experts_touched=touched,
        mbytes=nbytes / 1e6,
        default_us=default * 1e6,
        best_us=best * 1e6,
        best_config=best_cfg,
        roofline_us=roof * 1e6,
        default_vs_roof=default / roof,
        best_vs_roof=best / roof,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ms", type=lambda s: [int(v) for v in s.split(",")], default=MS)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dtypes", default="fp8,bf16")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--write", action="store_true", help="store the sweep's best per M")
    parser.add_argument("--out", default="bench/results/moe_gemm.json")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    head = f"{'dtype':>5} {'M':>4} {'experts':>7} {'MB':>7} {'default us':>10} {'best us':>8}"
    print(head + f" {'roof us':>8} {'def/roof':>8} {'best/roof':>9}  best config")
    rows = []
    for dtype in args.dtypes.split(","):
        weights = experts(args.experts, dtype)
        for m in args.ms:
            row = measure(m, dtype, weights, args, bandwidth)
            rows.append(row)
            print(
                f"{dtype:>5} {m:>4} {row['experts_touched']:>7.1f} {row['mbytes']:>7.0f} "
                f"{row['default_us']:>10.1f} {row['best_us']:>8.1f} {row['roofline_us']:>8.1f} "
                f"{row['default_vs_roof']:>8.2f} {row['best_vs_roof']:>9.2f}  {row['best_config']}",
                flush=True,
            )
        del weights
        torch.cuda.empty_cache()
    if args.write:
        write_table(rows)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


def write_table(rows: list[dict]) -> None:
    from dserve.kernels.triton_moe import CONFIGS, table_key

    table = {}
    if os.path.isfile(CONFIGS):
        with open(CONFIGS) as f:
            table = json.load(f)
    for row in rows:
        if row["best_config"] is not None:
            key = table_key(row["dtype"], HIDDEN, INTER, row["experts"])
            table.setdefault(key, {})[str(row["m"])] = row["best_config"]
    with open(CONFIGS, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    print(f"wrote the launch table {CONFIGS}")


if __name__ == "__main__":
    main()
