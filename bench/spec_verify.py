"""Cost of one speculative verify step against a plain decode step, at real DeepSeek-V3 shapes.

A verify step runs the target over each request's last token and its k draft tokens (k + 1 query
tokens per request, logits at every one of them); a decode step runs one token per request. Both
read the same context. The model is DeepSeek-V3-shaped (hidden 7168, real MLA and MoE expert sizes)
with fewer layers and experts so it fits one GPU, random weights made on the device
(`load_format="dummy"`, no checkpoint needed):

    python -m bench.spec_verify [--layers 4 --experts 32] [--batches 1,8,32] [--drafts 1,2,3]

(`--experts 0`: every layer dense, to see the verify's own cost without the experts it adds.)

prints decode ms, verify ms and their ratio per batch and k, and writes JSON. The issue's goal is a
ratio of at most 1.15 for k = 2 at batch <= 32. "bytes ratio" is the ratio of the two steps'
rooflines (`decode_step.step_bytes`): a verify's tokens (distinct ids, as real drafts are) select
more routed experts than the decode's, and at batch 1 those experts' weights alone cost more. With
the triton backend both steps replay CUDA graphs (`--eager`: eager passes); CUDA events around
`ModelRunner.forward`, median of the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from bench.cuda_timing import median_seconds
from tests.kernel_cases import step_batch

__all__ = ["step_batch"]  # bench's step scripts take it from here


def deepseek_v3_config_dir(layers: int, experts: int, dense_layers: int = 1) -> str:
    """A config.json of DeepSeek-V3's shapes with `layers` layers (the first `dense_layers`
    dense: 3 in the model) and `experts` routed experts (8 per token, groups scaled down to
    fit); `experts` 0: every layer dense (MLP of 18432), the model's shape without MoE. A
    decode step of one request reads what DeepSeek-V3's does layer for layer with 8 experts
    or more: 8 routed experts and the shared one, however many the layer holds."""
    import transformers as tf

    groups = max(1, min(8, experts // 4))
    cfg = tf.DeepseekV3Config(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_shared_experts=1,
        n_routed_experts=experts,
        num_experts_per_tok=8,
        n_group=groups,
        topk_group=min(4, groups),
        first_k_dense_replace=dense_layers,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=163840,
        architectures=["DeepseekV3ForCausalLM"],
        rope_scaling={
            "type": "yarn",
            "rope_type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    out = tempfile.mkdtemp(prefix="dsv3-shape-")
    cfg.to_json_file(os.path.join(out, "config.json"))
    return out


def glm5_config_dir(layers: int, experts: int, **overrides) -> str:
    """A config.json of GLM-5's shapes (sparse attention: 64 heads, latent 512 + 64, indexer
    32 x 128, top-k 2048; every layer with an indexer) with `layers` layers, the first dense,
    and `experts` routed experts (8 per token); `overrides` replace any of its fields."""
    import transformers as tf

    fields = dict(
        vocab_size=154880,
        hidden_size=6144,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=64,
        n_shared_experts=1,
        n_routed_experts=experts,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=2048,
        qk_rope_head_dim=64,
        qk_nope_head_dim=192,
        v_head_dim=256,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
        indexer_types=["full"] * layers,
        max_position_embeddings=202752,
        architectures=["GlmMoeDsaForCausalLM"],
    )
    cfg = tf.GlmMoeDsaConfig(**{**fields, **overrides})
    out = tempfile.mkdtemp(prefix="glm5-shape-")
    cfg.to_json_file(os.path.join(out, "config.json"))
    return out


def dummy_runner(
    path: str,
    max_requests: int,
    context: int,
    attention_backend: str = "torch",
    graph_tokens: int = 0,
    quantization: str | None = None,
):
    """(ModelRunner, KVCacheManager): the model of config dir `path` with random bf16 weights on the
    GPU, its pool sized for `max_requests` requests of `context` tokens (and a few drafts each); with
    the triton backend, steps of up to `graph_tokens` tokens replay CUDA graphs (0: all eager)."""
    from dserve.runtime.config import EngineConfig
    from dserve.runtime.model_runner import ModelRunner
    from dserve.scheduler.kv_manager import KVCacheManager

    config = EngineConfig(
        path,
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        max_total_tokens=max_requests * (context + 72),
        load_progress=False,
        attention_backend=attention_backend,
        cuda_graph_max_bs=max(graph_tokens, 1),
        disable_cuda_graph=not graph_tokens,
        quantization=quantization,
    )
    runner = ModelRunner(config)
    return runner, KVCacheManager(runner.num_pages, runner.pool.layout.page_size, False)


def model_args(parser: argparse.ArgumentParser, layers: int = 4) -> None:
    """--layers, --experts, --dense-layers, --context: the DeepSeek-V3-shaped model and each
    request's context."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument(
        "--dense-layers", type=int, default=1, help="dense layers first (DeepSeek-V3: 3)"
    )
    parser.add_argument("--context", type=int, default=1024)


def timing_args(parser: argparse.ArgumentParser) -> None:
    """--repeats, --attention-backend, --eager: how the timed steps run."""
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--attention-backend", default="triton", choices=["torch", "triton", "flashinfer"]
    )
    parser.add_argument(
        "--eager", action="store_true", help="no CUDA graphs (the triton backend replays them)"
    )


def uses_graphs(args) -> bool:
    return args.attention_backend == "triton" and not args.eager


def forward_ms(runner, batch, repeats: int) -> float:
    """Median ms of `runner.forward(batch)` (the batch built once, outside the timing)."""
    return 1e3 * median_seconds(lambda: runner.forward(batch), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(parser)
    timing_args(parser)
    parser.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32]
    )
    parser.add_argument(
        "--drafts", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3]
    )
    parser.add_argument("--out", default="bench/results/spec_verify.json")
    args = parser.parse_args()

    path = deepseek_v3_config_dir(args.layers, args.experts, args.dense_layers)
    graphs = uses_graphs(args)
    runner, kv = dummy_runner(
        path,
        max(args.batches),
        args.context,
        args.attention_backend,
        max(args.batches) * (max(args.drafts) + 1) if graphs else 0,
    )
    from bench.decode_step import step_bytes

    rows = []
    print(
        f"{'batch':>5} {'k':>3} {'decode ms':>10} {'verify ms':>10} {'ratio':>6} {'bytes ratio':>11}"
    )
    for b in args.batches:
        plain = step_batch(kv, b, args.context, 1)
        decode, decode_bytes = forward_ms(runner, plain, args.repeats), step_bytes(runner, plain)
        for k in args.drafts:
            batch = step_batch(kv, b, args.context, k + 1)
            verify, verify_bytes = (
                forward_ms(runner, batch, args.repeats),
                step_bytes(runner, batch),
            )
            rows.append(
                {
                    "batch": b,
                    "k": k,
                    "decode_ms": decode,
                    "verify_ms": verify,
                    "ratio": verify / decode,
                    "bytes_ratio": verify_bytes / decode_bytes,
                }
            )
            print(
                f"{b:>5} {k:>3} {decode:>10.2f} {verify:>10.2f} {verify / decode:>6.2f} "
                f"{verify_bytes / decode_bytes:>11.2f}"
            )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "layers": args.layers,
                "experts": args.experts,
                "context": args.context,
                "parameter_bytes": runner.parameter_bytes,
                "attention_backend": args.attention_backend,
                "cuda_graphs": graphs,
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
