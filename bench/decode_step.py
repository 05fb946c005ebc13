"""Whole decode step on a DeepSeek-V3-shaped model with random weights: time per step against the
step's roofline, and against `transformers` running the same model on the same GPU.

    python -m bench.decode_step [--layers 4 --experts 32] [--batches 1,8,32,128] [--context 1024]
                                [--peer-batches 1,32] [--eager] [--arch glm5]

The model has DeepSeek-V3's real shapes (hidden 7168, MLA, 8 of the routed experts per token) with
fewer layers and experts so it fits one GPU, made on the device from its config (`load_format=dummy`).
Each request has `context` tokens in the KV cache and decodes one token.

Roofline: the bytes the step must read over the device copy bandwidth measured in the same run (read
+ write bytes per second of a 1 GiB device-to-device copy). Bytes: every weight the step touches
(all but the routed experts and the embedding table, plus the routed experts the router actually
selected in this step, counted per layer, and one embedding row per token) and the KV cache read.
With the triton backend the steps replay CUDA graphs (`--eager`: not); CUDA events around
`ModelRunner.forward` (packing the step's inputs included), median of the repeats. The peer runs
`transformers`' DeepseekV3ForCausalLM (random weights, bf16) one token per request over a prefilled
DynamicCache of the same context. `--arch glm5`: GLM-5's shapes instead (sparse attention: the
KV read is the selected tokens' latents and every token's indexer keys). Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from dataclasses import dataclass

import torch

from bench.cuda_timing import copy_bandwidth, median_seconds
from bench.spec_verify import (
    deepseek_v3_config_dir,
    dummy_runner,
    glm5_config_dir,
    model_args,
    step_batch,
    timing_args,
    uses_graphs,
)


@dataclass
class StepBytes:
    """What one decode step reads, by kind (bytes)."""

    dense: int
    """Every weight but the routed experts and the embedding table."""
    experts_touched: int
    """The routed experts the router selected in this step, per layer."""
    experts_total: int
    embedding_rows: int
    """One embedding row per token."""
    kv: int

    @property
    def total(self) -> int:
        return self.dense + self.experts_touched + self.embedding_rows + self.kv


def step_bytes_parts(runner, batch) -> StepBytes:
    """The bytes one forward of `batch` must read: weights touched (the routed experts selected in
    this very step) plus the KV read."""
    from dserve.models.layers.moe import Experts

    touched, hooks = [], []

    def count(module, args):
        ids = args[2]
        per_expert = sum(
            p[0].numel() * p.element_size()
            for n, p in module.named_parameters()
            if n.startswith(("w13", "w2"))
        )  # weights and, FP8, their scales
        touched.append(int(torch.unique(ids).numel()) * per_expert)

    for module in runner.model.modules():
        if isinstance(module, Experts):
            hooks.append(module.register_forward_pre_hook(count))
    runner.run_model(batch.to(runner.device))  # eager: the hooks see the routing
    for h in hooks:
        h.remove()
    dense = experts = rows = 0
    for name, p in runner.model.named_parameters():
        if ".experts.w" in name:
            experts += p.numel() * p.element_size()
        elif "embed_tokens" in name:
            rows += batch.num_tokens * p.shape[1] * p.element_size()
        else:
            dense += p.numel() * p.element_size()
    return StepBytes(dense, sum(touched), experts, rows, kv_bytes(runner, batch))


def kv_bytes(runner, batch) -> int:
    """The KV a step reads: every context token's latent, or with sparse attention the
    selected tokens' latents and every token's indexer keys."""
    latent = runner.pool.layout.bytes_per_token
    if runner.index_pool is None:
        return sum(batch.seq_lens) * latent
    topk = runner.model_config.index_topk
    selected = sum(min(n, topk) for n in batch.seq_lens)
    return selected * latent + sum(batch.seq_lens) * runner.index_pool.layout.bytes_per_token


def step_bytes(runner, batch) -> int:
    """`step_bytes_parts`' total."""
    return step_bytes_parts(runner, batch).total


def peer_step_seconds(path: str, batch: int, context: int, repeats: int) -> float:
    """Median seconds of one transformers decode step (batch requests, one token each)."""
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(path)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, context), device="cuda")
    with torch.inference_mode():
        cache = tf.DynamicCache()
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        token = ids[:, -1:]
        return median_seconds(
            lambda: model(input_ids=token, past_key_values=cache, use_cache=True), repeats
        )


def our_steps(path: str, args, copy: float) -> tuple[list[dict], int]:
    graphs = max(args.batches) if uses_graphs(args) else 0
    runner, kv = dummy_runner(path, max(args.batches), args.context, args.attention_backend, graphs)
    rows = []
    for b in args.batches:
        batch = step_batch(kv, b, args.context, 1)
        nbytes = step_bytes(runner, batch)
        seconds = median_seconds(lambda batch=batch: runner.forward(batch), args.repeats)
        rows.append(
            {
                "batch": b,
                "step_s": seconds,
                "bytes": nbytes,
                "roofline_s": nbytes / copy,
                "over_roofline": seconds * copy / nbytes,
                "tokens_per_s": b / seconds,
            }
        )
    return rows, runner.parameter_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(parser)
    timing_args(parser)
    parser.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128]
    )
    parser.add_argument(
        "--peer-batches", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 32]
    )
    parser.add_argument("--out", default="bench/results/decode_step.json")
    parser.add_argument(
        "--arch", default="deepseek_v3", choices=["deepseek_v3", "glm5"], help="the shapes"
    )
    args = parser.parse_args()

    copy = copy_bandwidth()
    if args.arch == "glm5":
        path = glm5_config_dir(args.layers, args.experts)
    else:
        path = deepseek_v3_config_dir(args.layers, args.experts, args.dense_layers)
    rows, parameter_bytes = our_steps(path, args, copy)
    gc.collect()  # our model's memory back before the peer's is made
    torch.cuda.empty_cache()
    for row in rows:
        if row["batch"] in args.peer_batches:
            row["peer_step_s"] = peer_step_seconds(
                path, row["batch"], args.context, max(5, args.repeats // 4)
            )
            row["speedup_over_peer"] = row["peer_step_s"] / row["step_s"]
    print(
        f"{'batch':>5} {'step ms':>8} {'roofline ms':>11} {'x roofline':>10} {'tok/s':>8} {'peer ms':>8} "
        f"{'vs peer':>7}"
    )
    for r in rows:
        peer = (
            f"{r['peer_step_s'] * 1e3:>8.1f} {r['speedup_over_peer']:>6.1f}x"
            if "peer_step_s" in r
            else ""
        )
        print(
            f"{r['batch']:>5} {r['step_s'] * 1e3:>8.2f} {r['roofline_s'] * 1e3:>11.3f} {r['over_roofline']:>10.1f} "
            f"{r['tokens_per_s']:>8.0f} {peer}"
        )
    print(
        f"device copy: {copy / 1e9:.0f} GB/s (read + write); model {parameter_bytes / 1e9:.2f} GB of weights, "
        f"context {args.context}, attention backend {args.attention_backend}, "
        f"{'CUDA graphs' if uses_graphs(args) else 'eager steps'}"
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "layers": args.layers,
                "experts": args.experts,
                "context": args.context,
                "copy_gb_per_s": copy / 1e9,
                "parameter_bytes": parameter_bytes,
                "attention_backend": args.attention_backend,
                "cuda_graphs": uses_graphs(args),
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
