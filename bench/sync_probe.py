"""Host syncs inside one decode step: what stands between the step and a CUDA graph.

    python -m bench.sync_probe [--layers 2 --experts 32 --batch 8 --attention-backend triton]

Runs one warm decode step of the DeepSeek-V3-shaped model (`load_format=dummy`) under
`torch.cuda.set_sync_debug_mode("warn")` and prints the Python line of every synchronizing CUDA
operation it sees (torch's detector is a prototype: it may miss some).
"""

from __future__ import annotations

import argparse
import warnings

import torch

from bench.spec_verify import deepseek_v3_config_dir, dummy_runner, model_args, step_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(parser, layers=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--attention-backend", default="triton", choices=["torch", "triton", "flashinfer"]
    )
    args = parser.parse_args()

    runner, kv = dummy_runner(
        deepseek_v3_config_dir(args.layers, args.experts, args.dense_layers),
        args.batch,
        args.context,
        args.attention_backend,
    )
    batch = step_batch(kv, args.batch, args.context, 1).to(torch.device("cuda"))
    runner.forward(batch)  # compile and warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.forward(batch)
    torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    for w in syncs:
        print(f"sync: {w.filename}:{w.lineno}")
    print(
        f"{len(syncs)} synchronizing operation(s) in one decode step ({args.attention_backend} backend)"
    )


if __name__ == "__main__":
    main()
