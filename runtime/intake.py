"""Turning what a caller gives into a request: the tokenizer, prompt checks, sampling parameters."""

from __future__ import annotations

from dserve.scheduler.request import SamplingParams


class NoTokenizer:
    """Stands in where a dummy-weight model directory has config.json only: prompts must come as
    input_ids, and outputs carry ids and no text."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        raise ValueError(
            "this model directory has no tokenizer (load_format=dummy): send input_ids"
        )

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


def load_tokenizer(model_path: str, load_format: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):
        if load_format != "dummy":
            raise
        return NoTokenizer()


def prompt_ids(tokenizer, prompt, input_ids, vocab: int, context: int, pool: int) -> list[int]:
    """The prompt's token ids, checked: given exactly once, not empty, known ids, with room left
    to generate in the model's `context` and the KV cache's `pool` tokens."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of a text prompt or input_ids")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string, got {type(prompt).__name__}")
        input_ids = tokenizer.encode(prompt)
    ids = list(input_ids)
    if not ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"unknown token ids {bad[:5]}: ids must be integers in [0, {vocab})")
    if len(ids) >= context:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; the model's context is {context} "
            f"tokens and at least one must be left to generate"
        )
    if len(ids) >= pool:
        raise ValueError(f"the prompt has {len(ids)} tokens but the KV cache holds only {pool}")
    return ids


def as_params(value) -> SamplingParams:
    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, dict):
        return SamplingParams.from_dict(value)
    kind = type(value).__name__
    raise ValueError(f"sampling_params must be a SamplingParams or a dict, got {kind}")


def batch_inputs(prompts, input_ids, sampling_params) -> tuple[list[tuple], bool]:
    """`Engine.generate`'s arguments as (prompt, ids, params) per request, and whether one
    request was given on its own (not in a list)."""
    single = isinstance(prompts, str) or bool(
        input_ids is not None and input_ids and isinstance(input_ids[0], int)
    )
    texts = [prompts] if isinstance(prompts, str) else prompts
    ids = [input_ids] if single and input_ids is not None else input_ids
    if texts is not None and ids is not None:
        raise ValueError("give prompts or input_ids, not both")
    n = len(texts) if texts is not None else len(ids or [])
    if n == 0:
        raise ValueError("no prompts given")
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling_params for {n} prompts")
    texts = texts or [None] * n
    ids = ids or [None] * n
    return list(zip(texts, ids, params)), single
