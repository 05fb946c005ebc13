"""Whole speculative decode steps on a GPU at DeepSeek-V3 shapes: what one step of each mode costs.

`bench.spec_verify` times the target's verify pass alone; a speculative step also runs the draft:
with MTP or EAGLE-3 the catch-up pass over the kept tokens and one pass per further draft step,
in naive mode the draft inside the target's call. This bench runs the `Engine` (scheduler, sampler,
verification, draft passes, KV moves: the whole front) on a DeepSeek-V3-shaped model with random
weights (`load_format="dummy"`, see `bench.spec_verify`), `batch` requests of `--context` random
tokens each generating `--output-len` tokens, greedy, all submitted at once:

    python -m bench.spec_decode [--batches 1,8,32] [--modes off,mtp1,mtp2,naive,eagle3]
    python -m bench.spec_decode --model-path DIR [--draft-path DIR2] [--device cpu]  # a checkpoint
    python -m bench.spec_decode ... --pp-size 2 [--pp-micro-batches 1]  # pipeline stages

With `--model-path` it runs that checkpoint instead (`bench.train_mtp`'s trained one: real acceptance).
Random weights accept almost no draft, so a step's tokens say nothing here; what the bench gives is
the wall time of one engine step once every request decodes (from the host's side: the front's work
included), and "break-even", that time over the plain decode step's: the mean acceptance length
(tokens per verify) above which the mode beats plain decoding. With pipeline stages a step is one
micro-batch's (up to `--pp-micro-batches` in flight, each over its own requests): the table adds
the tokens per second and each request's time per token (its rounds are a pipeline's latency
apart), and break-even compares steps of the same pipeline.
The acceptance lengths that trained drafts reach are `bench.train_mtp`'s and `bench.train_eagle3`'s.
With every draft rejected the catch-up pass has one token per request, not up to k + 1: a lower
bound on its cost. The EAGLE-3 draft is a Llama layer of hidden 7168, 56 heads of 128 (8 KV heads)
and a 32000-token draft vocabulary. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

import torch

from bench.decode_timing import in_process, time_decode
from bench.spec_verify import deepseek_v3_config_dir, model_args

MODES = {
    "off": {},
    "mtp1": dict(speculative_algorithm="mtp", speculative_num_steps=1),
    "mtp2": dict(speculative_algorithm="mtp", speculative_num_steps=2),
    "mtp3": dict(speculative_algorithm="mtp", speculative_num_steps=3),
    "naive": dict(speculative_algorithm="mtp", speculative_naive=True),
    "eagle3": dict(speculative_algorithm="eagle3", speculative_num_steps=1),
    "eagle3x3": dict(speculative_algorithm="eagle3", speculative_num_steps=3),
}


def eagle3_dummy_dir(target_dir: str) -> str:
    """config.json of an EAGLE-3 draft for the DeepSeek-V3-shaped target in `target_dir`."""
    from dserve.models.tiny import eagle3_config

    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    cfg = eagle3_config(target, 32000)  # reads three of the target's layers
    cfg.update(
        num_attention_heads=56,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=18432,
        max_position_embeddings=target["max_position_embeddings"],
    )
    out = tempfile.mkdtemp(prefix="eagle3-shape-")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out


def step_ms(path: str, mode: str, batch: int, args, draft_dir: str | None) -> dict:
    """Wall time of one engine step of `mode` once all `batch` requests decode, and the tokens a
    request gains per step."""
    from dserve.runtime import Engine, SamplingParams

    spec = dict(MODES[mode])
    if spec.get("speculative_algorithm") == "eagle3":
        spec["speculative_draft_model_path"] = draft_dir
    has_weights = any(name.endswith(".safetensors") for name in os.listdir(path))
    kwargs = dict(
        device=args.device,
        load_format="auto" if has_weights else "dummy",
        load_progress=False,
        attention_backend=args.attention_backend,
        disable_cuda_graph=args.eager,
        cuda_graph_max_bs=batch,
        max_running_requests=batch,
        max_total_tokens=batch * (args.context + args.output_len + 64),
        pp_size=args.pp_size,
        pp_micro_batches=args.pp_micro_batches,
        **spec,
    )
    rng = random.Random(0)
    with Engine(path, **kwargs) as engine:
        vocab = engine.model_config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(args.context)] for _ in range(batch)]
        engine.generate(
            input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=8, ignore_eos=True)
        )
        timing = time_decode(engine, prompts, args.output_len)
    return {
        "mode": mode,
        "batch": batch,
        "steps": timing.steps,
        "step_ms": 1e3 * timing.seconds / timing.steps,
        "tokens_per_step": timing.tokens / (timing.steps * batch),
        "tokens_per_s": timing.tokens / timing.seconds,
        "ms_per_token": 1e3 * timing.seconds * batch / timing.tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(parser)
    parser.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32]
    )
    parser.add_argument(
        "--modes", type=lambda s: s.split(","), default=["off", "mtp1", "mtp2", "naive", "eagle3"]
    )
    parser.add_argument(
        "--model-path", help="a checkpoint (or config) directory instead of the DeepSeek-V3 shape"
    )
    parser.add_argument("--draft-path", help="the EAGLE-3 draft of --model-path")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--attention-backend", default="auto", choices=["auto", "torch", "triton", "flashinfer"]
    )
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--pp-size", type=int, default=1)
    parser.add_argument("--pp-micro-batches", type=int, default=None)
    parser.add_argument("--out", default="bench/results/spec_decode.json")
    args = parser.parse_args()
    unknown = set(args.modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")

    path = args.model_path or deepseek_v3_config_dir(args.layers, args.experts, args.dense_layers)
    draft_dir = args.draft_path or (None if args.model_path else eagle3_dummy_dir(path))
    rows, plain = [], {}
    print(
        f"{'mode':>9} {'batch':>5} {'step ms':>8} {'tokens/step':>11} {'tok/s':>8} "
        f"{'ms/token':>8} {'break-even':>10}"
    )
    for batch in args.batches:
        for mode in args.modes:
            row = in_process(step_ms, path, mode, batch, args, draft_dir)
            if mode == "off":
                plain[batch] = row["step_ms"]
            row["break_even"] = row["step_ms"] / plain[batch] if batch in plain else None
            rows.append(row)
            even = f"{row['break_even']:>10.2f}" if row["break_even"] else f"{'':>10}"
            print(
                f"{mode:>9} {batch:>5} {row['step_ms']:>8.2f} {row['tokens_per_step']:>11.2f} "
                f"{row['tokens_per_s']:>8.1f} {row['ms_per_token']:>8.2f} {even}",
                flush=True,
            )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        json.dump(
            {
                "device": device,
                "model": args.model_path or "deepseek-v3 shape",
                "layers": args.layers,
                "experts": args.experts,
                "context": args.context,
                "output_len": args.output_len,
                "eager": args.eager,
                "pp_size": args.pp_size,
                "pp_micro_batches": args.pp_micro_batches or args.pp_size,
                "attention_backend": args.attention_backend,
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
