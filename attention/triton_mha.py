"""Triton MHA/GQA decode over the paged K/V cache, split-KV for long contexts.

One query row per decode token (a chain verify's tokens are rows of their own, each with its own
context length and its sequence's page-table row, as in `triton_mla.py`). A program takes the query
heads that share one KV head (padded to 16 rows for the tensor cores) and one split of the row's
context: it walks the split's tokens through the page table, keeps an online softmax per head and
accumulates the weighted values. The splits are merged by their log-sum-exp with the MLA kernel's
combine. Head sizes need not be powers of two (masked). Checked against the torch reference
backend (`tests/attention`), under `TRITON_INTERPRET=1` on the CPU at small shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dserve.attention.triton_mla import (
    _context_block,
    _dot,
    _online_softmax_step,
    _store_split,
    combine_splits,
    default_splits,
)


@triton.jit(do_not_specialize=["s_pt_b", "s_ml_b", "s_ml_h", "min_split", "num_splits"])
def _split_kernel(
    Q,
    K,
    V,
    PageTable,
    RowSeqs,
    SeqLens,
    MidO,
    MidLse,
    s_q_b,
    s_q_h,
    s_k_page,
    s_k_tok,
    s_k_head,
    s_v_page,
    s_v_tok,
    s_v_head,
    s_pt_b,
    s_mo_b,
    s_mo_h,
    s_mo_s,
    s_ml_b,
    s_ml_h,
    group,
    scale,
    page_size,
    min_split,
    head_dim,
    v_head_dim,
    num_splits,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    per_split = tl.maximum(tl.cdiv(seq_len, num_splits), min_split)
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    g = tl.arange(0, BLOCK_G)
    heads = kv_head * group + g
    gmask = g < tl.where(start < end, group, 0)  # an empty split reads nothing
    d, dv = tl.arange(0, D), tl.arange(0, DV)
    q = tl.load(
        Q + b * s_q_b + heads[:, None] * s_q_h + d[None, :],
        mask=gmask[:, None] & (d[None, :] < head_dim),
        other=0.0,
    )
    table = PageTable + tl.load(RowSeqs + b).to(tl.int64) * s_pt_b
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        toks, tmask, page, off = _context_block(table, n0, end, page_size, BLOCK_N)
        k = tl.load(
            K + page[:, None] * s_k_page + off[:, None] * s_k_tok + kv_head * s_k_head + d[None, :],
            mask=tmask[:, None] & (d[None, :] < head_dim),
            other=0.0,
        )
        v = tl.load(
            V
            + page[:, None] * s_v_page
            + off[:, None] * s_v_tok
            + kv_head * s_v_head
            + dv[None, :],
            mask=tmask[:, None] & (dv[None, :] < v_head_dim),
            other=0.0,
        )
        s = _dot(q, tl.trans(k), IEEE)
        m, l, acc = _online_softmax_step(s * scale, tmask[None, :], v, m, l, acc, IEEE)
    _store_split(
        MidO + b * s_mo_b + split * s_mo_s,
        MidLse + b * s_ml_b + split,
        heads,
        dv,
        g < group,
        s_mo_h,
        s_ml_h,
        m,
        l,
        acc,
    )


def mha_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    row_seqs: torch.Tensor | None = None,
    max_len: int | None = None,
    num_splits: int | None = None,
    block_n: int = 32,
    min_split: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """q [B, Hq, D] (one query row per decode token); `k_cache` [num_pages, page_size, Hkv, D] and
    `v_cache` [.., Hkv, Dv] one layer's pages (any page stride); `seq_lens` [B] tokens in KV each row
    sees (its own K/V already stored); `page_table` [S, max_pages], row `row_seqs[b]` for query row b
    (by default row b). Returns [B, Hq, Dv]. Splits as in `triton_mla.mla_decode`."""
    batch, heads, head_dim = q.shape
    kv_heads, v_head_dim = k_cache.shape[2], v_cache.shape[-1]
    group = heads // kv_heads
    if num_splits is None:
        num_splits = default_splits(
            batch, kv_heads, max_len or 1 << 16, block_n, q.device, block_h=1
        )
    if row_seqs is None:
        row_seqs = torch.arange(batch, device=q.device)
    assert (
        q.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
        and page_table.stride(-1) == 1
    )
    dv = triton.next_power_of_2(v_head_dim)
    mid_out = torch.empty(batch, heads, num_splits, dv, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    _split_kernel[(batch, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        row_seqs,
        seq_lens,
        mid_out,
        mid_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        group,
        scale,
        k_cache.shape[1],
        2 * block_n if min_split is None else min_split,
        head_dim,
        v_head_dim,
        D=triton.next_power_of_2(head_dim),
        DV=dv,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        num_splits=num_splits,
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
    )
    out = torch.empty(batch, heads, dv, dtype=q.dtype, device=q.device)
    return combine_splits(mid_out, mid_lse, out)[..., :v_head_dim]
