"""Train an EAGLE-3 draft for the tiny target that bench/train_mtp.py trained, on the same phrase
corpus, so EAGLE-3 acceptance means something too.

The target stays frozen. The draft reads the target's hidden states after the configured layers at
position i (transformers' `output_hidden_states`) and the embedding of token i+1, and learns token
i+2 over a reduced vocabulary: the corpus's most frequent tokens (as SpecForge builds `d2t`). Only
the first draft step is trained (no training-time test unrolling), so later steps, which feed the
draft its own hidden state, are accepted less often. The result is written in the public EAGLE-3
layout, then measured with the engine:

    python -m bench.train_mtp --out /tmp/mtp-trained
    python -m bench.train_eagle3 --target /tmp/mtp-trained --out /tmp/eagle3-trained

prints the losses, then decode tokens/s and the mean acceptance length with speculation off and
with EAGLE-3 at 1, 2 and 3 draft steps, and writes JSON.
"""

from __future__ import annotations

import argparse

from bench.train_mtp import report
from tests.drafts import corpus, measure, train_eagle3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="a target trained by bench.train_mtp")
    parser.add_argument("--out", required=True, help="EAGLE-3 checkpoint directory to write")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", default="bench/results/train_eagle3.json")
    args = parser.parse_args()
    info = train_eagle3(args.target, args.out, args.steps)
    sample = corpus(24, 0)  # the phrases the target learned
    prompts = [sample(12) for _ in range(8)]
    draft = {"speculative_algorithm": "eagle3", "speculative_draft_model_path": args.out}
    rows = (
        measure(args.target, prompts, speculative=draft)
        + measure(args.target, prompts, (1, 3), speculative=draft, topk=4)[1:]
        + measure(args.target, prompts, (1,), speculative=draft, naive=True)[1:]
    )
    report("eagle3", rows, info, args.json)


if __name__ == "__main__":
    main()
