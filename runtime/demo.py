"""`make demo`: generate for a few prompts with the embedded default model (a tiny DeepSeek-V3
written on first run into .dserve/), printing each generation and the throughput."""

from __future__ import annotations

import logging
import os
import time

DEFAULT_MODEL_DIR = os.path.join(".dserve", "tiny-deepseek-v3")
PROMPTS = [
    "Tell me a story about a robot who learns to paint.",
    "Prefill computes the key value cache of the prompt;",
    "Mixture of experts layers route every token",
    "Hello world! How are you today?",
]


def ensure_default_model(path: str = DEFAULT_MODEL_DIR) -> str:
    if not os.path.isfile(os.path.join(path, "config.json")):
        from dserve.models.tiny import make_tiny

        print(f"creating the embedded default model (tiny random DeepSeek-V3 with MTP) in {path}")
        make_tiny("deepseek_v3", path, mtp=True)
    return path


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from dserve.runtime import Engine, SamplingParams

    path = ensure_default_model()
    with Engine(path, load_progress=False) as engine:
        params = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True)
        engine.generate(PROMPTS[0], sampling_params=SamplingParams(max_new_tokens=2))  # warm-up
        start = time.perf_counter()
        results = engine.generate(PROMPTS, sampling_params=params)
        elapsed = time.perf_counter() - start
        for prompt, result in zip(PROMPTS, results):
            print(
                f"\n> {prompt}\n  {result.text!r}\n  ({result.meta['completion_tokens']} tokens, "
                f"finish: {result.finish_reason})"
            )
        tokens = sum(r.meta["completion_tokens"] for r in results)
        print(
            f"\n{len(PROMPTS)} prompts, {tokens} new tokens in {elapsed:.2f}s: {tokens / elapsed:.1f} tokens/s "
            f"on {engine.config.device} ({engine.config.dtype}); the model is random, so the text is noise."
        )


if __name__ == "__main__":
    main()
