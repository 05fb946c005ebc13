"""Training a tiny target and its MTP (NextN) draft together, on any sampler of token sequences,
into a checkpoint in the published layout (target layers, then `model.layers.{n}.*` NextN
tensors). The target (a tiny DeepSeek-V3 or GLM-4.5 from `models/tiny.py`) learns next-token
prediction; the draft learns token i+2 from the target's hidden state at i and token i+1, as
DeepSeek trains its MTP module, with the target's hidden states detached. Used by
`bench/train_mtp.py` (acceptance on a synthetic corpus) and `make demo` (a chat model whose
answers read as text).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch import nn

from dserve.models.tiny import (
    _hf_config,
    _model_class,
    append_mtp_layer,
    one_layer_more,
    train_tokenizer,
)

VOCAB = 512


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class NextN(nn.Module):
    """The MTP module around layer `n` of `donor` (a model with one layer more than the target)."""

    def __init__(self, donor, cfg):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer, self.rotary = donor.model.layers[-1], donor.model.rotary_emb
        self.enorm, self.hnorm, self.norm = RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.head = nn.Linear(h, cfg.vocab_size, bias=False)

    def forward(self, emb_next: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(hidden)], dim=-1))
        pos = torch.arange(x.shape[1])[None]
        mask = None  # sdpa: causal
        if getattr(self.layer.self_attn, "indexer", None) is not None:  # its scores need one
            n = x.shape[1]
            mask = torch.full((n, n), torch.finfo(x.dtype).min).triu(1)[None, None]
        kwargs = dict(position_ids=pos, attention_mask=mask)
        y = self.layer(x, position_embeddings=self.rotary(x, pos), **kwargs)
        return self.head(self.norm(y[0] if isinstance(y, tuple) else y))


def train_with_mtp(
    arch: str,
    out: str,
    steps: int,
    sample: Callable[[int], list[int]],
    seed: int = 0,
    log=print,
    shapes: dict | None = None,
    tokenizer=None,
    length: int = 64,
) -> list[tuple[float, float]]:
    """Train on batches of 16 sequences of `length` tokens drawn by `sample(length)` and write
    the checkpoint (with `tokenizer`, default the tiny one) to `out`; `shapes` overrides fields
    of the tiny config (e.g. attention dims a kernel library needs). Returns the losses (target,
    draft) of every step."""
    torch.manual_seed(seed)
    tokenizer = tokenizer or train_tokenizer(VOCAB)
    cfg = _hf_config(arch, VOCAB, tokenizer.bos_token_id, tokenizer.eos_token_id, 2)
    if shapes:
        cfg = type(cfg)(**{**cfg.to_dict(), **shapes})
    cfg._attn_implementation = "sdpa"  # causal without a mask, in training and in the draft's layer
    target = _model_class(arch)(cfg)
    donor = _model_class(arch)(one_layer_more(cfg))
    donor.config._attn_implementation = "sdpa"
    nextn = NextN(donor, cfg)
    params = list(target.parameters()) + list(nextn.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    ce = nn.CrossEntropyLoss()
    losses = []
    for step in range(steps):
        ids = torch.tensor([sample(length) for _ in range(16)])
        # after the final norm, as the engine hands over
        hidden = target.model(ids).last_hidden_state
        lm = ce(target.lm_head(hidden[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        draft = nextn(target.model.embed_tokens(ids[:, 1:]), hidden[:, :-1].detach())
        mtp = ce(draft[:, :-1].flatten(0, 1), ids[:, 2:].flatten())
        opt.zero_grad()
        (lm + mtp).backward()
        opt.step()
        losses.append((lm.item(), mtp.item()))
        if step % 50 == 0 or step == steps - 1:
            log(f"step {step:4d}  target loss {lm.item():.3f}  draft loss {mtp.item():.3f}")
    target.eval()
    os.makedirs(out, exist_ok=True)
    target.save_pretrained(out, max_shard_size="300KB")
    tokenizer.save_pretrained(out)
    append_mtp_layer(
        out,
        donor,
        {
            "enorm.weight": nextn.enorm.weight,
            "hnorm.weight": nextn.hnorm.weight,
            "eh_proj.weight": nextn.eh_proj.weight,
            "shared_head.norm.weight": nextn.norm.weight,
            "shared_head.head.weight": nextn.head.weight,
            "embed_tokens.weight": target.model.embed_tokens.weight,
        },
    )
    return losses
