"""Sparse attention decode (DSA: GLM-5, DeepSeek-V3.2) against dense MLA decode, one layer on a
GPU, at GLM-5's shapes per rank (64 heads, latent 512 + 64, indexer 32 heads x 128, top-k 2048):

    python -m bench.sparse_decode [--contexts 32768,131072] [--batches 1,32,128]
        [--topk-chunk N] [--topk-block N] [--topk-warps N]

Per (batch, context) one decode token per request over a paged bf16 cache (pages of 64,
scattered; `--fp8-keys`: the indexer keys in FP8, the production layout): the dense step is
`mla_decode` over every position; the sparse step is what the triton backend runs, the
indexer's scores over every position's key (`triton_backend.indexer_kernel`: with FP8
keys on Hopper, the Gluon kernel with FP8 queries; else `triton_dsa`'s), the top-k
(`triton_topk.select_top_triton`, bounded by the contexts, its row histograms kept as the
backend keeps them; `--topk-*`: its launch, default `default_chunk`, blocks of 2048, 4
warps), and `mla_decode` over the selected positions. Each is timed as a CUDA graph replay
(median), the sparse step's parts too, with torch's top-k beside ours (unsorted,
`select_top`, and sorted), and the sparse step against its roofline: the bytes it must
read (every token's indexer key, the selected latents) over the copy bandwidth measured in
the same run. Both MLA decodes are the triton backend's (Gluon's kernel on Hopper;
`--triton-mla`: the Triton kernel's). Beside the backend's scores: the Triton kernel's and,
with FP8 keys on Hopper, the Gluon kernel's with 16-bit and with FP8 queries. `same` says
whether our top-k chose torch's set in every row (random scores: no ties). The issue's goal at 32k: the sparse step <= 0.25x the dense
one, within 2x of its roofline. `--flashmla`: FlashMLA's sparse kernels beside our sparse MLA,
over the same selections (`bench.flashmla`: `fm16` its bf16 kernel on the same cache, `fm8` its
FP8 decode over DeepSeek-V3.2's 656-byte layout), with the rooflines of the selected rows'
bytes (`mla roof` bf16, `fp8 roof`). Beside the copy, each part's read-only floor in the same
run (`bench.read_floor`): the indexer's keys read (`keys rd`), the scores read once (`top rd`),
the selected rows gathered through the page table (`gather`), their sum (`floors`) and that
over the dense step (`f/d`): the step if every part only read its bytes, as fast as the best
of a few simple read-only kernels does at that size. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.cuda_timing import copy_bandwidth, graph_seconds
from bench.flashmla import FP8_TOKEN_BYTES

HEADS, RANK, ROPE, PAGE = 64, 512, 64, 64
INDEX_HEADS, INDEX_DIM, TOPK = 32, 128, 2048


def make_case(batch: int, context: int, fp8_keys: bool = False) -> dict:
    pages = context // PAGE
    num = batch * pages
    dev, bf16 = "cuda", torch.bfloat16
    table = torch.randperm(num, device=dev).to(torch.int32).view(batch, pages)
    return {
        "cache": torch.randn(num, PAGE, RANK + ROPE, device=dev, dtype=bf16),
        **index_keys(num, fp8_keys),
        "table": table,
        "lens": torch.full((batch,), context, dtype=torch.int32, device=dev),
        "rows": torch.arange(batch, dtype=torch.int32, device=dev),
        "q_latent": torch.randn(batch, HEADS, RANK, device=dev, dtype=bf16),
        "q_rope": torch.randn(batch, HEADS, ROPE, device=dev, dtype=bf16),
        "q_index": torch.randn(batch, INDEX_HEADS, INDEX_DIM, device=dev, dtype=bf16),
        "weights": torch.randn(batch, INDEX_HEADS, device=dev),
    }


def index_keys(pages: int, fp8: bool) -> dict:
    """Random indexer pages as the pool holds them: "keys" (bf16, or FP8 bytes with the
    float32 "key_scales" after each page's keys)."""
    from dserve.attention.index_cache import key_scales, write_keys
    from dserve.memory.kv_pool import KVLayout, KVPool

    dtype = torch.uint8 if fp8 else torch.bfloat16
    pool = KVPool(KVLayout("index", 1, PAGE, dtype, latent_dim=INDEX_DIM), pages, "cuda")
    keys = torch.randn(pages * PAGE, INDEX_DIM, device="cuda", dtype=torch.bfloat16)
    write_keys(pool, 0, torch.arange(pages * PAGE, device="cuda"), keys)
    buffers = pool.buffers[0]
    scales = key_scales(buffers[1]) if fp8 else None
    # "key_pages": the pool's pages, whole (the keys and scales are views of them)
    return {"keys": buffers[0], "key_scales": scales, "key_pages": pool.pages}


def decode_kernel(c: dict, sparse: bool):
    """The MLA decode the triton backend runs here (Gluon's on Hopper),
    or the Triton kernel where `--mla-launch` tunes it."""
    from dserve.attention.triton_backend import mla_decode_kernel

    return mla_decode_kernel(c["q_latent"], c["cache"], sparse, gluon=not TRITON_MLA)


def dense_step(c: dict, context: int) -> torch.Tensor:
    return decode_kernel(c, False)(
        c["q_latent"], c["q_rope"], c["cache"], c["table"], c["lens"], 0.07, max_len=context
    )


def scores_part(c: dict, context: int, kernel: str = "backend") -> torch.Tensor:
    """The indexer's scores by the backend's kernel (`indexer_kernel`), or
    by one named: "triton" (`triton_dsa`), "gluon16" (`gluon_indexer` with
    16-bit queries), "gluon8" (with FP8 queries)."""
    from dserve.attention import gluon_indexer
    from dserve.attention.triton_backend import indexer_kernel
    from dserve.attention.triton_dsa import indexer_scores

    extra = {}
    if kernel == "backend":
        scores = indexer_kernel(c["q_index"], c["keys"], c["key_scales"])
    elif kernel == "triton":
        scores, extra = indexer_scores, SCORES_LAUNCH
    else:
        scores = gluon_indexer.indexer_scores
        extra = {"q_fp8": kernel == "gluon8"}
    return scores(
        c["q_index"],
        c["weights"],
        c["keys"],
        c["table"],
        c["rows"],
        c["lens"],
        0.09,
        context,
        key_scales=c["key_scales"],
        **extra,
    )


NAN = float("nan")  # a column this case has not (Gluon's scores: FP8 keys, Hopper)
TOP_LAUNCH = {"chunk": None, "block": 2048, "num_warps": 4}  # `--topk-*`
MLA_LAUNCH: dict = {}  # `--mla-launch`: mla_decode's keyword arguments (else its defaults)
FLASHMLA = False  # `--flashmla`: FlashMLA's sparse kernels beside our sparse MLA
TRITON_MLA = False  # `--triton-mla` (or `--mla-launch`): the Triton MLA kernels, not Gluon's
SCORES_LAUNCH: dict = {}  # `--scores-launch`: indexer_scores' block_n, num_warps


def top_part(c: dict, scores: torch.Tensor) -> torch.Tensor:
    """The backend's top-k (`--topk-*`: its launch)."""
    from dserve.attention.triton_topk import select_top_triton

    return select_top_triton(scores, TOPK, c["lens"], c["hist"], **TOP_LAUNCH)


def torch_top(scores: torch.Tensor) -> torch.Tensor:
    """Torch's unsorted top-k (`select_top`, the CPU path): ours beside it."""
    from dserve.attention.index_cache import select_top

    return select_top(scores, TOPK)


def sorted_top(scores: torch.Tensor) -> torch.Tensor:
    """The top-k sorted best first, as `select_top` once did: its cost beside ours."""
    return scores.topk(TOPK, dim=-1).indices


def sparse_mla_part(c: dict, chosen: torch.Tensor) -> torch.Tensor:
    return decode_kernel(c, True)(
        c["q_latent"],
        c["q_rope"],
        c["cache"],
        c["table"],
        None,
        0.07,
        max_len=TOPK,
        row_seqs=c["rows"],
        selected=chosen,
        **MLA_LAUNCH,
    )


def sparse_step(c: dict, context: int) -> torch.Tensor:
    """What the triton backend runs for one DSA layer's decode."""
    return sparse_mla_part(c, top_part(c, scores_part(c, context)))


def flashmla_parts(c: dict, chosen: torch.Tensor) -> dict:
    """FlashMLA's two sparse kernels over `chosen`, callables by name."""
    from bench import flashmla

    slots = flashmla.pool_slots(c["table"], c["rows"], chosen, PAGE)
    q = torch.cat([c["q_latent"], c["q_rope"]], -1)
    kv_fp8 = flashmla.fp8_cache(c["cache"])
    fp8 = flashmla.sparse_fp8_decode(q, kv_fp8, slots, 0.07)
    return {
        "fm16_ms": lambda: flashmla.sparse_bf16(q, c["cache"], slots, 0.07),
        "fm8_ms": fp8,
    }


def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two selections hold the same positions in every row."""
    return torch.equal(a.sort(-1).values, b.sort(-1).values)


def row(batch: int, context: int, repeats: int, copy: float, fp8_keys: bool) -> dict:
    from dserve.attention import gluon_indexer
    from dserve.attention.triton_topk import top_hist

    c = make_case(batch, context, fp8_keys)
    c["hist"] = top_hist(batch, "cuda")
    key_bytes = c["keys"][0, 0].numel() * c["keys"].element_size()
    key_bytes += 4 if c["key_scales"] is not None else 0  # a float32 scale per key
    scores = scores_part(c, context)
    chosen = top_part(c, scores)
    times = {
        "dense_ms": lambda: dense_step(c, context),
        "sparse_ms": lambda: sparse_step(c, context),
        "scores_ms": lambda: scores_part(c, context),
        "triton_scores_ms": lambda: scores_part(c, context, "triton"),
        "top_ms": lambda: top_part(c, scores),
        "torch_top_ms": lambda: torch_top(scores),
        "sorted_top_ms": lambda: sorted_top(scores),
        "mla_ms": lambda: sparse_mla_part(c, chosen),
    }
    torch_chosen = torch_top(scores)
    r = {"batch": batch, "context": context, "same": same_sets(chosen, torch_chosen)}
    if gluon_indexer.supported(c["q_index"], c["keys"], c["key_scales"]):
        times["gluon_scores_ms"] = lambda: scores_part(c, context, "gluon16")
        times["gluon8_scores_ms"] = lambda: scores_part(c, context, "gluon8")
    if FLASHMLA:
        peers = flashmla_parts(c, chosen)
        ours = sparse_mla_part(c, chosen).float()
        for name, fn in peers.items():  # how far each is from our output
            diff = (fn().float() - ours).abs().max() / ours.abs().max()
            r[name.replace("_ms", "_diff")] = diff.item()
        times.update(peers)
    for name, fn in times.items():
        r[name] = graph_seconds(fn, repeats) * 1e3
    r.update(part_floors(c, scores, chosen, repeats))
    picked = batch * min(TOPK, context)
    latent_bytes = picked * (RANK + ROPE) * 2
    nbytes = batch * context * key_bytes + latent_bytes
    r["mla_roof_ms"] = latent_bytes / copy * 1e3
    r["fp8_roof_ms"] = picked * FP8_TOKEN_BYTES / copy * 1e3
    c.clear()  # the pools go before the next case's
    torch.cuda.empty_cache()
    r["sparse_over_dense"] = r["sparse_ms"] / r["dense_ms"]
    r["roofline_ms"] = nbytes / copy * 1e3
    r["sparse_over_roofline"] = r["sparse_ms"] / r["roofline_ms"]
    r["floors_over_dense"] = r["floors_ms"] / r["dense_ms"]
    return r


def part_floors(c: dict, scores: torch.Tensor, chosen: torch.Tensor, repeats: int) -> dict:
    """ms of each part's read-only floor (`bench.read_floor`) and their sum."""
    from bench.read_floor import gather_floor_seconds, read_floor_seconds

    floors = {
        "keys_floor_ms": read_floor_seconds([c["key_pages"]], repeats),
        "top_floor_ms": read_floor_seconds([scores], repeats),
        "gather_floor_ms": gather_floor_seconds(c["cache"], c["table"], chosen, repeats),
    }
    floors = {name: s * 1e3 for name, s in floors.items()}
    return {**floors, "floors_ms": sum(floors.values())}


COLUMNS = [
    ("batch", "batch", "{:>5}"),
    ("context", "context", "{:>8}"),
    ("dense_ms", "dense", "{:>8.3f}"),
    ("sparse_ms", "sparse", "{:>8.3f}"),
    ("sparse_over_dense", "s/d", "{:>6.2f}"),
    ("roofline_ms", "roof", "{:>8.3f}"),
    ("sparse_over_roofline", "s/roof", "{:>7.2f}"),
    ("scores_ms", "scores", "{:>8.3f}"),
    ("triton_scores_ms", "triton", "{:>8.3f}"),
    ("gluon_scores_ms", "gluon16", "{:>8.3f}"),
    ("gluon8_scores_ms", "gluon8", "{:>8.3f}"),
    ("top_ms", "top-k", "{:>8.3f}"),
    ("torch_top_ms", "torch", "{:>8.3f}"),
    ("sorted_top_ms", "sorted", "{:>8.3f}"),
    ("mla_ms", "mla", "{:>8.3f}"),
    ("mla_roof_ms", "mla roof", "{:>8.3f}"),
    ("fm16_ms", "fm16", "{:>8.3f}"),
    ("fm8_ms", "fm8", "{:>8.3f}"),
    ("fp8_roof_ms", "fp8 roof", "{:>8.3f}"),
    ("keys_floor_ms", "keys rd", "{:>8.3f}"),
    ("top_floor_ms", "top rd", "{:>8.3f}"),
    ("gather_floor_ms", "gather", "{:>8.3f}"),
    ("floors_ms", "floors", "{:>8.3f}"),
    ("floors_over_dense", "f/d", "{:>6.2f}"),
    ("same", "same", "{!s:>5}"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--contexts", type=ints, default=[32768, 131072])
    parser.add_argument("--batches", type=ints, default=[1, 32, 128])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--fp8-keys", action="store_true", help="indexer keys in FP8 (132 bytes a token)"
    )
    parser.add_argument("--topk-chunk", type=int, help="positions per top-k program")
    parser.add_argument("--topk-block", type=int, default=2048)
    parser.add_argument("--topk-warps", type=int, default=4)
    parser.add_argument(
        "--mla-launch", type=json.loads, default={}, help="the sparse MLA's launch, as JSON"
    )
    parser.add_argument(
        "--triton-mla",
        action="store_true",
        help="dense and sparse MLA by the Triton kernel (default: the backend's choice, "
        "Gluon's on Hopper; `--mla-launch` implies it)",
    )
    parser.add_argument(
        "--scores-launch", type=json.loads, default={}, help="the indexer scores', as JSON"
    )
    parser.add_argument(
        "--flashmla",
        action="store_true",
        help="FlashMLA's sparse kernels (the sgl-flash-mla wheel) beside our sparse MLA",
    )
    parser.add_argument("--out", default="bench/results/sparse_decode.json")
    args = parser.parse_args()
    TOP_LAUNCH.update(chunk=args.topk_chunk, block=args.topk_block, num_warps=args.topk_warps)
    MLA_LAUNCH.update(args.mla_launch)
    global TRITON_MLA, FLASHMLA
    TRITON_MLA = args.triton_mla or bool(MLA_LAUNCH)
    FLASHMLA = args.flashmla
    SCORES_LAUNCH.update(args.scores_launch)
    copy = copy_bandwidth()
    rows = []
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s; ms per layer; the sparse step's parts after it")
    print(" ".join(f"{title:>{len(fmt.format(0))}}" for _, title, fmt in COLUMNS))
    for context in args.contexts:
        for batch in args.batches:
            r = row(batch, context, args.repeats, copy, args.fp8_keys)
            rows.append(r)
            print(" ".join(fmt.format(r.get(key, NAN)) for key, _, fmt in COLUMNS), flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        meta = {"device": torch.cuda.get_device_name(), "copy_gb_s": copy / 1e9}
        meta.update(fp8_keys=args.fp8_keys, topk_launch=TOP_LAUNCH, mla_launch=MLA_LAUNCH)
        meta.update(scores_launch=SCORES_LAUNCH, triton_mla=TRITON_MLA, flashmla=FLASHMLA)
        json.dump({**meta, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
