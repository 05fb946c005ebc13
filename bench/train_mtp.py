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
import random
import time

from dserve.models.tiny_train import VOCAB, RMSNorm, train_with_mtp

__all__ = ["RMSNorm", "corpus", "measure", "report", "train"]


def corpus(num_phrases: int, seed: int):
    """A sampler of token sequences made of `num_phrases` fixed phrases strung together at random."""
    rng = random.Random(seed)
    phrases = [
        [rng.randrange(10, VOCAB) for _ in range(rng.randrange(4, 9))] for _ in range(num_phrases)
    ]

    def sample(n: int) -> list[int]:
        out = []
        while len(out) < n:
            out += rng.choice(phrases)
        return out[:n]

    return sample


def train(
    arch: str, out: str, steps: int, seed: int = 0, log=print, shapes: dict | None = None
) -> dict:
    """Train on the phrase corpus and write the checkpoint (`models/tiny_train.py`); `shapes`
    overrides fields of the tiny config. Returns the losses and held-out prompts."""
    sample = corpus(24, seed)
    losses = train_with_mtp(arch, out, steps, sample, seed, log, shapes)
    return {
        "arch": arch,
        "steps": steps,
        "final_target_loss": losses[-1][0],
        "final_draft_loss": losses[-1][1],
        "prompts": [sample(12) for _ in range(8)],
    }


def measure(
    path: str,
    prompts: list[list[int]],
    steps_list=(1, 2, 3),
    max_new_tokens: int = 48,
    speculative: dict | None = None,
    topk: int = 1,
    naive: bool = False,
) -> list[dict]:
    """Mean acceptance length (tokens per verify) and tokens/s per draft-step count (draft trees of
    `topk` branches per pass; `naive`: the fused one-call step); output checked equal to the plain
    engine's. `speculative`: the Engine's draft arguments (default: MTP)."""
    from dserve.runtime import Engine

    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    plain = Engine(path, device="cpu", load_progress=False)
    start = time.perf_counter()
    expected = [r.output_ids for r in plain.generate(input_ids=prompts, sampling_params=params)]
    seconds = time.perf_counter() - start
    plain.shutdown()
    tokens = sum(map(len, expected))
    rows = [
        {
            "steps": 0,
            "topk": 0,
            "naive": False,
            "accept_length": 1.0,  # speculation off
            "tokens_per_s": tokens / seconds,
        }
    ]
    for steps in steps_list:
        engine = Engine(
            path,
            device="cpu",
            load_progress=False,
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_naive=naive,
            **(speculative or {"speculative_algorithm": "mtp"}),
        )
        start = time.perf_counter()
        got = engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        engine.shutdown()
        if [r.output_ids for r in got] != expected:
            raise AssertionError(f"speculation with {steps} steps changed the output")
        tokens = sum(len(r.output_ids) for r in got)
        verifies = sum(r.meta["spec_verify_ct"] for r in got)
        rows.append(
            {
                "steps": steps,
                "topk": topk,
                "naive": naive,
                "accept_length": tokens / verifies,
                "tokens_per_s": tokens / seconds,
            }
        )
    return rows


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
