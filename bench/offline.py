"""Offline throughput: N random prompts of a given input length, each generating a fixed number of
tokens (ignore_eos), all submitted at once. Prints a table and writes JSON.

    python -m bench.offline --num-prompts 64 --input-len 128 --output-len 64 [--model PATH] [engine flags]

Without --model it uses the embedded tiny model (CPU numbers are smoke figures only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time


def run(args: argparse.Namespace) -> dict:
    from dserve.runtime import Engine, SamplingParams
    from dserve.runtime.cli import engine_kwargs
    from dserve.runtime.demo import ensure_default_model

    path = args.model_path or ensure_default_model()
    with Engine(path, **engine_kwargs(args)) as engine:
        vocab = engine.model_config.vocab_size
        rng = random.Random(args.seed)
        prompts = [
            [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)
        ]
        params = SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True)
        # warm-up
        engine.generate(input_ids=prompts[0][:8], sampling_params=SamplingParams(max_new_tokens=2))
        start = time.perf_counter()
        results = engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - start
        out_tokens = sum(r.meta["completion_tokens"] for r in results)
        in_tokens = args.num_prompts * args.input_len
        ttfts = [r.meta["ttft"] for r in results]
        return {
            "model": path,
            "device": engine.config.device,
            "dtype": engine.config.dtype,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "elapsed_s": elapsed,
            "requests_per_s": args.num_prompts / elapsed,
            "input_tokens_per_s": in_tokens / elapsed,
            "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
            "ttft_median_s": statistics.median(ttfts),
            "preemptions": engine.preempted_total,
            "host": platform.node(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }


def print_table(row: dict) -> None:
    keys = [
        "device",
        "dtype",
        "num_prompts",
        "input_len",
        "output_len",
        "elapsed_s",
        "requests_per_s",
        "input_tokens_per_s",
        "output_tokens_per_s",
        "total_tokens_per_s",
        "ttft_median_s",
        "preemptions",
    ]
    width = max(map(len, keys))
    for key in keys:
        value = row[key]
        print(
            f"{key:<{width}}  {value:.3f}"
            if isinstance(value, float)
            else f"{key:<{width}}  {value}"
        )


def main(argv: list[str] | None = None) -> None:
    from dserve.runtime.cli import add_engine_flags

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join("bench", "results", "offline.json"))
    add_engine_flags(parser)
    for action in parser._actions:  # the embedded model is the default here
        if action.dest == "model_path":
            action.required = False
    args = parser.parse_args(argv)
    args.load_progress = False
    row = run(args)
    print_table(row)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(row, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
