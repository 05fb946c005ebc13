"""Triton kernels of sparse attention (DSA, `models/dsa.py`): the lightning indexer's scores over
the paged indexer keys. The sparse MLA itself is `triton_mla.mla_decode` with each token's
selected positions (`selected=`): one row per token, prompt chunks included, since a selection
already holds only what the token may see.

`indexer_scores`: per token t and context position j < its context length,
sum over heads h of w[t, h] x ReLU(scale x q[t, h] . k[j]), float32; -inf past the context. A
program takes one token and a block of positions: its heads' queries against the block's keys
(read through the page table) in one dot, then the weighted ReLU sum. FP8 keys (the production
layout, `indexer_cache_dtype="fp8"`: a page's keys, then their float32 scales) are widened to
the queries' dtype, exactly, and their per-token scale applied to the dot's column.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dserve.attention.triton_mla import _context_block, _dot


@triton.jit(do_not_specialize=["s_pt_b", "width"])
def _scores_kernel(
    Q,
    W,
    Keys,
    Scales,
    PageTable,
    RowSeqs,
    CtxLens,
    Out,
    s_q_t,
    s_q_h,
    s_w_t,
    s_k_page,
    s_k_tok,
    s_sc_page,
    s_pt_b,
    s_o_t,
    scale,
    page_size,
    width,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
):
    t, n0 = tl.program_id(0), tl.program_id(1) * BLOCK_N
    t64 = t.to(tl.int64)
    end = tl.load(CtxLens + t)
    table = PageTable + tl.load(RowSeqs + t).to(tl.int64) * s_pt_b
    pos, valid, page, off = _context_block(table, n0, end, page_size, BLOCK_N)
    d, h = tl.arange(0, D), tl.arange(0, H)
    q = tl.load(Q + t64 * s_q_t + h[:, None] * s_q_h + d[None, :])
    k, k_scale = _key_block(
        Keys, page, off, valid, s_k_page, s_k_tok, Scales, s_sc_page, q.dtype, D, FP8
    )
    s = _dot(q, tl.trans(k), IEEE).to(tl.float32) * (k_scale * scale)[None, :]
    s = tl.maximum(s, 0.0)  # [H, BLOCK_N]
    w = tl.load(W + t64 * s_w_t + h)
    scores = tl.sum(w[:, None] * s, 0)
    scores = tl.where(valid, scores, float("-inf"))
    tl.store(Out + t64 * s_o_t + pos, scores, mask=pos < width)


@triton.jit
def _key_block(
    Keys,
    page,
    off,
    valid,
    s_k_page,
    s_k_tok,
    Scales,
    s_sc_page,
    dtype,
    D: tl.constexpr,
    FP8: tl.constexpr,
):
    """A block of keys in `dtype` and their scales (1.0 unless FP8)."""
    d = tl.arange(0, D)
    base = page * s_k_page + off * s_k_tok
    k = tl.load(Keys + base[:, None] + d[None, :], mask=valid[:, None], other=0)
    if FP8:  # e4m3 bytes; the token's float32 scale from the page's scales
        k = k.to(tl.float8e4nv, bitcast=True).to(dtype)
        k_scale = tl.load(Scales + page * s_sc_page + off, mask=valid, other=0.0)
    else:
        k_scale = tl.full(valid.shape, 1.0, tl.float32)
    return k, k_scale


def scores_out(tokens: int, width: int, device) -> torch.Tensor:
    """The scores' tensor [tokens, width] float32: rows 16-aligned whatever the width, so
    that the stride stays one compiled case (and aligned)."""
    padded = triton.cdiv(max(width, 1), 16) * 16
    return torch.empty(tokens, padded, dtype=torch.float32, device=device)[:, :width]


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    page_table: torch.Tensor,
    row_seqs: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    width: int,
    key_scales: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """q [T, H, D], weights [T, H] float32, `keys` one layer's indexer pages [num_pages,
    page_size, D] (the model's dtype, or uint8: FP8 keys, whose float32 scales are then
    `key_scales` [num_pages, page_size], `index_cache.key_scales`), token t's page-table row
    `row_seqs[t]` and context length `ctx_lens[t]` -> scores [T, width] float32 (-inf past
    each context). H and D powers of two, at least 16."""
    tokens, heads, dim = q.shape
    out = scores_out(tokens, width, q.device)
    if not tokens or not width:
        return out
    assert keys.stride(-1) == 1 and q.stride(-1) == 1 and weights.stride(-1) == 1
    fp8 = keys.dtype == torch.uint8
    assert fp8 == (key_scales is not None), "FP8 keys come with their scales"
    scales = key_scales if fp8 else weights  # (not read without FP8)
    grid = (tokens, triton.cdiv(width, block_n))
    _scores_kernel[grid](
        q,
        weights,
        keys,
        scales,
        page_table,
        row_seqs,
        ctx_lens,
        out,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        keys.stride(0),
        keys.stride(1),
        scales.stride(0),
        page_table.stride(0),
        out.stride(0),
        scale,
        keys.shape[1],
        width,
        H=heads,
        D=dim,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
        FP8=fp8,
        num_warps=num_warps,
    )
    return out
