"""MLA decode kernel bandwidth: bytes of latent cache read per second by the Triton kernel
(`dserve.attention.triton_mla.mla_decode`) at DeepSeek-V3's attention shapes (128 heads,
kv_lora_rank 512, rope 64, page size 64, bf16), by batch and context, next to the copy bandwidth
measured in the same run (a 1 GiB device-to-device copy, read + write bytes per second):

    python -m bench.mla_decode [--batches 1,32,128] [--contexts 1024,8192,32768] [--tune JSON]

prints a table and writes JSON. Pages are scattered over the pool, as in serving. Each call is timed
as a CUDA graph replay (the kernels' GPU time, as in a captured decode step). `--tune` takes kernel
parameters, or a list of them to compare; the table then shows each setting's registers and spills.
`--backend gluon` times the warp-specialized Hopper kernel (`dserve.attention.gluon_mla`;
`--tune '{"num_splits": 2}'`). `--backend flashinfer` times FlashInfer's MLA decode (`BatchMLAPagedAttentionWrapper`) on the same
cases instead, for the same table; `--backend flashmla` FlashMLA's (DeepSeek's Hopper kernel, its dense
bf16 decode as SGLang's wheel `sgl-flash-mla` keeps it, `use_legacy=True`; the wheel serves torch
2.10+ by its README though its metadata asks for 2.14: install it with `--no-deps`).

`--roofs` adds both limits a case is held against, each measured in the run: the copy's time for
the case's bytes ("copy ms") and the tensor cores' for its products at a large bf16 matmul's
rate ("mma ms": batch x context x heads x (576 + 512) x 2 operations; at 128 heads they are
about equal), and with `--backend gluon` the kernel's own floor ("floor ms": the same launch
with every block's copy left out, `gluon_mla.mla_decode(read_blocks=False)`), so that what
the reads cost beyond the kernel's compute shows.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.cuda_timing import copy_bandwidth, graph_seconds, matmul_flops, median_seconds


def flashinfer_seconds(q_latent, q_rope, cache, table, lens, page_size: int, repeats: int) -> float:
    """One FlashInfer MLA decode (`BatchMLAPagedAttentionWrapper`, planned once) over the same cache,
    timed as a graph replay where it captures, else with CUDA events around eager calls."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    batch, rank = q_latent.shape[0], q_latent.shape[-1]
    wrapper = BatchMLAPagedAttentionWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    )
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")
    kv_indptr = ints([0] + [table.shape[1] * (i + 1) for i in range(batch)])
    wrapper.plan(
        metadata=MLAPlanMetadata.csr(
            ints(list(range(batch + 1))), kv_indptr, table.reshape(-1), lens
        ),
        num_heads=q_latent.shape[1],
        head_dim_ckv=rank,
        head_dim_kpe=q_rope.shape[-1],
        page_size=page_size,
        causal=True,
        sm_scale=0.07,
        q_data_type=q_latent.dtype,
        kv_data_type=cache.dtype,
        query_layout="split",
        kv_cache_layout="split",
    )
    run = lambda: wrapper.run(
        query=(q_latent, q_rope), kv_cache=(cache[..., :rank], cache[..., rank:])
    )
    try:
        return graph_seconds(run, repeats)
    except Exception:  # noqa: BLE001 - a plan that cannot be captured is timed eagerly
        return median_seconds(run, repeats)


def run_case(
    batch: int,
    context: int,
    repeats: int,
    heads=128,
    rank=512,
    rope=64,
    page_size=64,
    backend="triton",
    with_floor=False,
    **tune,
) -> dict:
    from dserve.attention.triton_mla import mla_decode

    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq
    cache = torch.randn(num_pages, page_size, rank + rope, device="cuda", dtype=torch.bfloat16)
    table = (
        torch.randperm(num_pages, device="cuda", dtype=torch.int64)
        .to(torch.int32)
        .view(batch, pages_per_seq)
    )
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q_latent = torch.randn(batch, heads, rank, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(batch, heads, rope, device="cuda", dtype=torch.bfloat16)
    if backend == "flashinfer":
        seconds = flashinfer_seconds(q_latent, q_rope, cache, table, lens, page_size, repeats)
    elif backend == "flashmla":
        from bench.flashmla import dense_seconds

        seconds = dense_seconds(q_latent, q_rope, cache, table, lens, repeats)
    else:
        from dserve.attention import gluon_mla

        decode = gluon_mla.mla_decode if backend == "gluon" else mla_decode
        call = (q_latent, q_rope, cache, table, lens, 0.07)
        # each row's page-table row, as the engine passes its batch's
        # (else the wrapper launches an arange inside the timed graph)
        tune = {"row_seqs": torch.arange(batch, device="cuda"), **tune}
        seconds = graph_seconds(lambda: decode(*call, max_len=context, **tune), repeats)
        if with_floor:  # the same launch, no block read
            unread = lambda: decode(*call, max_len=context, read_blocks=False, **tune)
            floor = graph_seconds(unread, repeats)
    nbytes = batch * context * (rank + rope) * 2
    row = {
        "batch": batch,
        "context": context,
        "ms": seconds * 1e3,
        "bytes": nbytes,
        "flops": batch * context * heads * (rank + rope + rank) * 2,
        "gb_s": nbytes / seconds / 1e9,
    }
    return {**row, "floor_ms": floor * 1e3} if with_floor else row


def kernel_stats(jit_fn) -> dict:
    """Registers per thread and spilled registers of the last compiled variant of `jit_fn`, and
    whether it uses Hopper's warpgroup MMA (read off Triton's cache; empty where that has moved)."""
    for cache in getattr(jit_fn, "device_caches", {}).values():
        for part in cache if isinstance(cache, tuple) else (cache,):
            kernels = (
                [k for k in part.values() if hasattr(k, "n_regs")] if isinstance(part, dict) else []
            )
            if kernels:
                k = kernels[-1]
                return {
                    "regs": k.n_regs,
                    "spills": k.n_spills,
                    "wgmma": "wgmma" in k.asm.get("ptx", ""),
                }
    return {}


def _roofs(row: dict) -> str:
    """The row's limits (`--roofs`): copy ms, mma ms, the kernel's floor ms (- without)."""
    floor = row.get("floor_ms")
    floor = f"{floor:>8.3f}" if floor else f"{'-':>8}"
    return f" {row['copy_ms']:>8.3f} {row['mma_ms']:>8.3f} {floor}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 128]
    )
    parser.add_argument(
        "--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 8192, 32768]
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--heads",
        type=int,
        default=128,
        help="query heads per rank: 128 for DeepSeek-V3 on one rank, 16 at attention TP 8",
    )
    parser.add_argument(
        "--tune",
        type=json.loads,
        default={},
        help='kernel parameters as JSON, e.g. \'{"block_h": 32, "block_n": 32, "num_warps": 8}\', '
        "or a list of such settings",
    )
    parser.add_argument(
        "--backend",
        choices=["triton", "gluon", "flashinfer", "flashmla"],
        default="triton",
        help="whose MLA decode kernel: ours (triton; gluon: the warp-specialized Hopper kernel, "
        "attention/gluon_mla.py), FlashInfer's BatchMLAPagedAttentionWrapper or FlashMLA's "
        "dense decode (sgl-flash-mla)",
    )
    parser.add_argument(
        "--roofs",
        action="store_true",
        help="add the copy's and the tensor cores' time for each case (and the Gluon kernel's "
        "floor: no block read)",
    )
    parser.add_argument("--out", default="bench/results/mla_decode.json")
    args = parser.parse_args()
    from dserve.attention import triton_mla

    tunes = args.tune if isinstance(args.tune, list) else [args.tune]
    copy = copy_bandwidth()
    print(f"copy bandwidth (device to device, read + write): {copy / 1e9:.0f} GB/s")
    mma = matmul_flops() if args.roofs else None
    if mma:
        print(f"bf16 matmul (8192^3): {mma / 1e12:.0f} TFLOPS")
    roofs = f" {'copy ms':>8} {'mma ms':>8} {'floor ms':>8}" if mma else ""
    print(
        f"{'batch':>5} {'context':>8} {'ms':>8} {'GB/s':>8} {'of copy':>8}{roofs}"
        f" {'regs':>5} {'spills':>6}  tune"
    )
    rows = []
    for tune in tunes:
        for b in args.batches:
            for c in args.contexts:
                try:
                    row = run_case(
                        b,
                        c,
                        args.repeats,
                        heads=args.heads,
                        backend=args.backend,
                        with_floor=args.roofs and args.backend == "gluon",
                        **tune,
                    )
                except (
                    Exception
                ) as e:  # a setting that does not compile (shared memory) is reported, not fatal
                    print(
                        f"{b:>5} {c:>8} failed: {str(e).splitlines()[0][:100]}  {json.dumps(tune)}"
                    )
                    continue
                row.update(
                    of_copy=row["gb_s"] * 1e9 / copy,
                    tune=tune,
                    backend=args.backend,
                    **(kernel_stats(triton_mla._split_kernel) if args.backend == "triton" else {}),
                )
                if mma:
                    row.update(copy_ms=row["bytes"] / copy * 1e3, mma_ms=row["flops"] / mma * 1e3)
                rows.append(row)
                print(
                    f"{b:>5} {c:>8} {row['ms']:>8.3f} {row['gb_s']:>8.0f} {row['of_copy']:>8.1%}"
                    f"{_roofs(row) if mma else ''}"
                    f" {row.get('regs', '?'):>5} {row.get('spills', '?'):>6}  {json.dumps(tune)}"
                )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "copy_gb_s": copy / 1e9,
                "matmul_tflops": mma / 1e12 if mma else None,
                "heads": args.heads,
                "backend": args.backend,
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
