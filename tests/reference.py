"""The reference: transformers' own implementation of each architecture, run on our tiny checkpoints."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_last_logits(path: str, ids: list[int]) -> torch.Tensor:
    return hf_model(path)(torch.tensor([ids])).logits[0, -1].float()


@torch.no_grad()
def hf_greedy(path: str, ids: list[int], max_new_tokens: int, processor=None) -> list[int]:
    """Greedy continuation with transformers' KV cache, never stopping early; `processor` is a
    transformers LogitsProcessor applied before the argmax (e.g. a repetition penalty)."""
    from transformers import DynamicCache

    model = hf_model(path)
    cache = DynamicCache(config=model.config)
    out, step_ids = [], torch.tensor([ids])
    for _ in range(max_new_tokens):
        logits = model(step_ids, past_key_values=cache, use_cache=True).logits[:, -1]
        if processor is not None:
            logits = processor(torch.tensor([ids + out]), logits)
        token = int(logits[0].argmax())
        out.append(token)
        step_ids = torch.tensor([[token]])
    return out


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude, on the host (ours may
    be on a GPU)."""
    ours, ref = ours.detach().float().cpu(), ref.detach().float().cpu()
    return float((ours - ref).abs().max() / ref.abs().max())
