"""What micro-batches buy a pipeline: decode throughput of a `pp_size`-stage engine with 1 to P
steps in flight (each over its own requests), next to one stage (no pipeline).

    python -m bench.pipeline [--pp 2] [--batch 16] [--layers 8] [--hidden 512] [--device cpu]

The model is DeepSeek-V3-shaped but small (`--hidden`, `--layers`, 8 routed experts), random
weights from its config alone (`load_format=dummy`). `--batch` requests of `--context` random
tokens decode `--output-len` tokens, greedy; the table gives decode steps per second and tokens
per second once every request decodes. On a CPU (gloo, one thread per rank) this is a smoke
figure: it shows whether the stages run at once, not what a GPU does. Prints a table and writes
JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

from bench.decode_timing import in_process, time_decode


def config_dir(layers: int, hidden: int) -> str:
    import transformers as tf

    cfg = tf.DeepseekV3Config(
        vocab_size=4096, hidden_size=hidden, intermediate_size=4 * hidden,
        moe_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=8, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=256,
        qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=4096,
        architectures=["DeepseekV3ForCausalLM"],
    )  # fmt: skip
    out = tempfile.mkdtemp(prefix="pp-bench-")
    cfg.to_json_file(os.path.join(out, "config.json"))
    return out


def decode_rate(path: str, args, pp: int, micro: int) -> dict:
    """Steps and tokens per second once all requests decode."""
    from dserve.runtime import Engine

    kwargs = dict(
        device=args.device, load_format="dummy", load_progress=False, pp_size=pp,
        pp_micro_batches=micro, max_total_tokens=args.batch * (args.context + args.output_len + 64),
    )  # fmt: skip
    rng = random.Random(0)
    with Engine(path, **kwargs) as engine:
        prompts = [[rng.randrange(4096) for _ in range(args.context)] for _ in range(args.batch)]
        timing = time_decode(engine, prompts, args.output_len)
    return {"pp": pp, "micro_batches": micro, "steps_per_s": timing.steps / timing.seconds,
            "tokens_per_s": timing.tokens / timing.seconds}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="bench/results/pipeline.json")
    args = parser.parse_args()
    path = config_dir(args.layers, args.hidden)
    runs = [(1, 1)] + [(args.pp, m) for m in range(1, args.pp + 1)]
    rows = []
    print(f"{'stages':>6} {'in flight':>9} {'steps/s':>8} {'tokens/s':>9}")
    for pp, micro in runs:
        row = in_process(decode_rate, path, args, pp, micro)
        rows.append(row)
        print(f"{pp:>6} {micro:>9} {row['steps_per_s']:>8.1f} {row['tokens_per_s']:>9.1f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({**vars(args), "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
