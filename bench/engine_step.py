"""Whole engine decode steps, as the host sees them, next to the forward pass alone and the step's
roofline, on a DeepSeek-V3-shaped model with random weights (GPU):

    python -m bench.engine_step [--batches 1,8,32,128,256] [--layers 4 --experts 32]
                                [--context 1024] [--output-len 64] [--quantization fp8]
                                [--attention-backend flashinfer] [--disable-cuda-graph]
                                [--tp-size 2 [--dp-size 2 | --ep-size 2]]   # several GPUs

For each batch size three runs, each in its own process (so each has the GPU's memory to itself):
- forward: `ModelRunner.forward` over one decode token per request (`bench.decode_step`: CUDA
  graphs, CUDA events, median), and the step's roofline: the bytes it must read (weights
  touched, routed experts actually selected, KV) over the device copy bandwidth of the same run;
- engine: `Engine.step` once every request decodes, wall time per step from the host (planning,
  launching, sampling on the device, processing the tokens, all of it), greedy, overlapped
  scheduling on;
- engine without overlap (`disable_overlap_schedule`): the front's work between the steps.

With `--tp-size` the engine runs that many ranks (one GPU each, NCCL; `--dp-size` groups for DP
attention, `--ep-size` for expert parallelism) and the roofline is one rank's: its own parameter
bytes (as the rank reports them) less its share of the routed experts and the embedding table,
plus its share of the experts selected in the step (measured on one GPU), the embedding rows and
the KV its DP group reads (MLA's latent is whole on every rank of an attention group). The
forward-alone column is the one-GPU forward then, for scale, and the ratios are against the
roofline only.

Prints a table, writes JSON and, with matplotlib, a PNG of the three against the roofline.
`--attention-backend flashinfer` (with FlashInfer installed) times its steps, under CUDA graphs
unless `--disable-cuda-graph`. The issue's goal: the engine step within 1.10x of the forward
alone and within 1.5x of the roofline at batch 1, 32 and 128 on an H100.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import asdict

import torch

from bench.cuda_timing import copy_bandwidth, median_seconds
from bench.decode_step import StepBytes, step_bytes_parts
from bench.decode_timing import in_process, time_decode
from bench.spec_verify import deepseek_v3_config_dir, dummy_runner, model_args, step_batch


def forward_row(path: str, batch: int, args) -> dict:
    """The forward alone (one GPU) and what a decode step of `batch` requests reads."""
    copy = copy_bandwidth()
    graph_tokens = 0 if args.disable_cuda_graph else batch
    runner, kv = dummy_runner(
        path,
        batch,
        args.context,
        args.attention_backend,
        graph_tokens=graph_tokens,
        quantization=args.quantization,
    )
    decode = step_batch(kv, batch, args.context, 1)
    parts = step_bytes_parts(runner, decode)
    seconds = median_seconds(lambda: runner.forward(decode), args.repeats)
    return {"forward_ms": 1e3 * seconds, "copy": copy, "parts": asdict(parts)}


def rank_bytes(parts: dict, ranks: dict, args) -> int:
    """What the busiest rank of a parallel engine reads in the step (see the module's text)."""
    split = args.tp_size  # routed experts: TP or EP, over every rank
    own = ranks["parameter_bytes"] - parts["experts_total"] // split - ranks["embedding_bytes"]
    experts = parts["experts_touched"] // split
    return own + experts + parts["embedding_rows"] + parts["kv"] // args.dp_size


def engine_ms(path: str, batch: int, args, overlap: bool) -> dict:
    """Host wall time of one `Engine.step` once all `batch` requests decode, and (several ranks)
    the largest rank's parameter and embedding-table bytes."""
    from dserve.runtime import Engine, SamplingParams

    kwargs = dict(
        device="cuda",
        load_format="dummy",
        load_progress=False,
        attention_backend=args.attention_backend,
        disable_cuda_graph=args.disable_cuda_graph,
        cuda_graph_max_bs=batch,
        max_running_requests=batch,
        max_total_tokens=batch * (args.context + args.output_len + 64),
        disable_overlap_schedule=not overlap,
        quantization=args.quantization,
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        ep_size=args.ep_size,
    )
    rng = random.Random(0)
    with Engine(path, **kwargs) as engine:
        vocab = engine.model_config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(args.context)] for _ in range(batch)]
        warm = SamplingParams(max_new_tokens=8, ignore_eos=True)
        engine.generate(input_ids=prompts, sampling_params=warm)  # compile, settle
        timing = time_decode(engine, prompts, args.output_len, steps=args.output_len // 2)
        ranks = getattr(engine.executor, "rank_info", [])
    return {"ms": 1e3 * timing.seconds / timing.steps, **largest_rank(ranks)}


def largest_rank(ranks: list) -> dict:
    """The parameter bytes of the rank holding most, and its embedding table's bytes (bf16)."""
    if not ranks:
        return {}
    info = max(ranks, key=lambda i: i.parameter_bytes)
    embedding = [s for n, s in info.parameter_shapes.items() if "embed_tokens" in n]
    rows, width = embedding[0]
    return {"parameter_bytes": info.parameter_bytes, "embedding_bytes": 2 * rows * width}


def plot(rows: list[dict], out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    batches = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in [
        ("engine_ms", "engine step (overlap)"),
        ("engine_sync_ms", "engine step (no overlap)"),
        ("forward_ms", "forward alone"),
        ("roofline_ms", "roofline"),
    ]:
        ax.plot(batches, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (requests decoding)")
    ax.set_ylabel("ms per step")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.replace(".json", ".png"), dpi=120)


def measure(path: str, batch: int, args) -> dict:
    """One row: the forward alone, the engine with and without overlap, the roofline."""
    row = {"batch": batch, **in_process(forward_row, path, batch, args)}
    overlapped = in_process(engine_ms, path, batch, args, True)
    row["engine_ms"] = overlapped["ms"]
    row["engine_sync_ms"] = in_process(engine_ms, path, batch, args, False)["ms"]
    parts = row["parts"]
    nbytes = rank_bytes(parts, overlapped, args) if args.tp_size > 1 else StepBytes(**parts).total
    row["bytes"] = nbytes
    row["roofline_ms"] = 1e3 * nbytes / row.pop("copy")
    row["over_forward"] = row["engine_ms"] / row["forward_ms"]
    row["over_roofline"] = row["engine_ms"] / row["roofline_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(parser)
    parser.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128, 256]
    )
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--quantization", choices=["fp8"], help="random block-FP8 weights (blocks of 128)"
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--attention-backend", choices=["triton", "flashinfer"], default="triton")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="every step eagerly")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--ep-size", type=int, default=1)
    parser.add_argument("--out", default="bench/results/engine_step.json")
    args = parser.parse_args()
    path = deepseek_v3_config_dir(args.layers, args.experts, args.dense_layers)
    rows = []
    header = ("batch", "forward", "engine", "no overlap", "roofline", "eng/fwd", "eng/roof")
    print("{:>5} {:>8} {:>8} {:>10} {:>8} {:>7} {:>8}   (ms per step)".format(*header))
    for batch in args.batches:
        rows.append(measure(path, batch, args))
        row = rows[-1]
        print(
            f"{batch:>5} {row['forward_ms']:>8.2f} {row['engine_ms']:>8.2f} "
            f"{row['engine_sync_ms']:>10.2f} {row['roofline_ms']:>8.2f} "
            f"{row['over_forward']:>7.2f} {row['over_roofline']:>8.2f}",
            flush=True,
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        meta = {
            "device": torch.cuda.get_device_name(),
            "layers": args.layers,
            "experts": args.experts,
            "dense_layers": args.dense_layers,
            "context": args.context,
            "quantization": args.quantization,
            "tp_size": args.tp_size,
            "dp_size": args.dp_size,
            "ep_size": args.ep_size,
        }
        json.dump({**meta, "rows": rows}, f, indent=2)
    plot(rows, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
