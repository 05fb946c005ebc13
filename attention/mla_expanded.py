"""MLA in its expanded (non-absorbed) form, as prefills run it (SGLang and vLLM do the same):
each context token's latent is decompressed through kv_b_proj into per-head keys (the no-RoPE
part, then the shared RoPE key) and values, and the span's queries attend over them causally
with PyTorch's fused attention (FlashAttention / memory-efficient kernels on a GPU).

For a long prompt chunk this costs far fewer FLOPs than the absorbed form: attention over
192-wide keys and 128-wide values per head instead of the 576-wide latent and 512-wide
output, plus the decompression (a GEMM of the context's latents). For a few new tokens over a
long context the decompression dominates, so decode and short extends stay absorbed
(`EngineConfig.mla_expand_min_tokens`). Backends call `expanded_mla` after storing the new
latents; every backend shares it.

Measured on an H100 (`bench.extend_attention`, 128 heads, bf16): PyTorch's attention with the
lower-right causal mask and 192/128-wide heads took its math path: 5.0 / 16.7 / 64.9 ms for
1k / 2k / 4k-token prompts against 1.7 / 5.1 / 17.5 ms absorbed, and a 16k prompt ran out of
memory (the whole score matrix). So it is off by default; what it needs is a fused kernel
(FlashAttention with 192/128 heads, values padded to 192, or our own).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from dserve.memory.kv_pool import KVPool

MAX_CONTEXT = 32768
"""Longest context expanded: its per-head keys and values are materialised for the span (at
128 heads, 32k tokens: 2.7 GB in bf16); longer contexts stay absorbed."""


def context_slots(batch, span: int, page_size: int) -> torch.Tensor:
    """The cache slots of span `span`'s whole context, in order."""
    pos = torch.arange(batch.seq_lens[span], device=batch.page_table.device)
    pages = batch.page_table[span, pos // page_size]
    return pages * page_size + pos % page_size


def expanded_mla(
    pool: KVPool,
    batch,
    layer: int,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_nope [T, H, N], q_rope [T, H, P], w_uk [H, N, R], w_uv [H, V, R] -> [T, H, V]: each
    span's tokens (its last q_len context positions) over its context, causally. The new
    tokens' latents must be in `pool` already."""
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    rank, row = w_uk.shape[-1], 0
    for span, q_len in enumerate(batch.q_lens):
        slots = context_slots(batch, span, pool.layout.page_size)
        ctx = pool.read(layer, 0, slots).to(q_nope.dtype)  # [S, R + P]
        c_kv, k_pe = ctx[:, :rank], ctx[:, rank:]
        keys = torch.einsum("sr,hnr->hsn", c_kv, w_uk)
        k_pe = k_pe.unsqueeze(0).expand(keys.shape[0], -1, -1)
        keys = torch.cat([keys, k_pe], dim=-1)  # [H, S, N + P]
        values = torch.einsum("sr,hvr->hsv", c_kv, w_uv)  # [H, S, V]
        rows = slice(row, row + q_len)
        q = torch.cat([q_nope[rows], q_rope[rows]], dim=-1).transpose(0, 1)
        mask = causal_lower_right(q_len, len(slots))
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        out[rows] = o.transpose(0, 1)
        row += q_len
    return out
