"""Train a tiny target and its MTP (NextN) draft on a synthetic corpus, so acceptance means something.

The corpus is made of a few fixed "phrases" (token sequences) strung together at random: inside a
phrase the next token is certain, at a phrase's end it is not. The training itself is
`dserve.models.tiny_train` (the target learns next-token prediction, the draft token i+2, as
DeepSeek trains its MTP module). The result is a checkpoint in the published layout, then
speculative decoding is measured on it:

    python -m bench.train_mtp --out /tmp/mtp-trained [--arch deepseek_v3] [--steps 300]

prints the training losses, then decode tokens/s and the mean acceptance length (tokens per verify)
with speculation off, with MTP at 1, 2 and 3 draft steps, a draft tree (3 steps, topk 4) and the
naive fused step, and writes JSON. bench/train_eagle3.py
trains an EAGLE-3 draft for the same target and measures it the same way.
"""

from __future__ import annotations

import argparse
import json
import os

from tests.drafts import measure, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument(
        "--arch", default="deepseek_v3", choices=["deepseek_v3", "glm4_moe", "glm_moe_dsa"]
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", default="bench/results/train_mtp.json")
    args = parser.parse_args()
    info = train(args.arch, args.out, args.steps)
    rows = (
        measure(args.out, info["prompts"])
        + measure(args.out, info["prompts"], (3,), topk=4)[1:]
        + measure(args.out, info["prompts"], (1,), naive=True)[1:]
    )
    report("mtp", rows, info, args.json)


def report(algorithm: str, rows: list[dict], info: dict, json_path: str) -> None:
    """Print the table of `measure` rows and write them with `info` as JSON."""
    print(f"{'speculation':>16} {'accept length':>14} {'tokens/s (CPU)':>15}")
    for r in rows:
        name = f"{algorithm} x{r['steps']}" if r["steps"] else "off"
        name += f" topk {r['topk']}" if r["topk"] > 1 else ""
        name += " naive" if r["naive"] else ""
        print(f"{name:>16} {r['accept_length']:>14.2f} {r['tokens_per_s']:>15.1f}")
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    with open(json_path, "w") as f:
        json.dump({**info, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
