"""Triton attention for spans of many query tokens over the paged cache: prompt chunks, extends whose
prefix is already in pages, and draft trees to verify (MLA in its absorbed form, and MHA/GQA).

A program takes BLOCK_M consecutive query tokens of one span and a block of query heads (MLA: heads
that all read the one latent; MHA/GQA: the query heads that share one KV head). The rows of its
matrix products are (token, head) pairs, so each block of context loaded from the pages serves all
of them. It walks the span's context through the page table up to the furthest position any of its
tokens sees, masking per row: a token sees its first `ctx_len` positions (causal), and a draft
tree's token also only those of the span's tail its tree mask marks. `ExtendPlan` holds that
per-token metadata; `plan_extend` builds it once per batch. Checked against the torch reference
backend (`tests/attention/test_triton_extend.py`), under `TRITON_INTERPRET=1` on the CPU at small
shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dserve.attention.triton_mla import _context_block, _dot, _online_softmax_step


@dataclass
class ExtendPlan:
    blocks: torch.Tensor  # int32 [num_blocks, 3]: span, first token row, end token row
    ctx_lens: torch.Tensor  # int32 [T]: context positions each token may see (causal bound)
    tail_starts: torch.Tensor  # int32 [T]: where its tree mask starts (= ctx_lens: no tree)
    tree: torch.Tensor  # int8 [T, max(1, longest tail)]: the tree mask row over the tail
    block_m: int
    has_tree: bool = False  # any span has a tree mask (else masks are causal only)


def plan_extend(
    q_lens: list[int], seq_lens: list[int], tree_masks, block_m: int, device, only=None
) -> ExtendPlan:
    """Per-token metadata and the work blocks (at most `block_m` tokens of one span each) of
    every span, or of the spans in `only`."""
    blocks, ctx, tails = [], [], []
    longest = max([m.shape[1] for m in tree_masks or [] if m is not None], default=1)
    # masks copied on the device
    tree = torch.zeros(sum(q_lens), longest, dtype=torch.int8, device=device)
    row = 0
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        if only is None or i in only:
            firsts = range(row, row + q_len, block_m)
            blocks += [(i, s, min(s + block_m, row + q_len)) for s in firsts]
        mask = None if tree_masks is None else tree_masks[i]
        if mask is None:
            ctx += [seq_len - q_len + j + 1 for j in range(q_len)]
            tails += ctx[-q_len:] if q_len else []
        else:
            ctx += [seq_len] * q_len
            tails += [seq_len - mask.shape[1]] * q_len
            tree[row : row + q_len, : mask.shape[1]] = mask.to(device, torch.int8)
        row += q_len
    ints = lambda v: torch.tensor(v, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
    has_tree = any(m is not None for m in tree_masks or [])
    blocks_t = ints(blocks).reshape(-1, 3)
    return ExtendPlan(blocks_t, ints(ctx), ints(tails), tree, block_m, has_tree)


@triton.jit
def _block_rows(Blocks, CtxLens, TailStarts, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """The program's rows: (token, head-in-block) pairs, with each token's mask bounds."""
    blk = tl.program_id(0)
    span, tok0, tok_end = (
        tl.load(Blocks + blk * 3),
        tl.load(Blocks + blk * 3 + 1),
        tl.load(Blocks + blk * 3 + 2),
    )
    rows = tl.arange(0, BLOCK_M * BLOCK_H)
    toks = tok0 + rows // BLOCK_H
    tmask = toks < tok_end
    ctx = tl.load(CtxLens + toks, mask=tmask, other=0)
    tail = tl.load(TailStarts + toks, mask=tmask, other=0)
    return span, toks, rows % BLOCK_H, tmask, ctx, tail


@triton.jit
def _seen_by_all(rmask, ctx, end, BLOCK_N: tl.constexpr, TREE: tl.constexpr):
    """Where the context blocks every row sees whole end (0 with a draft tree): those run
    with no mask, the rest masked per row."""
    seen = tl.min(tl.where(rmask, ctx, end), 0) // BLOCK_N * BLOCK_N
    if TREE:
        seen = seen * 0
    return seen


@triton.jit
def _visible(
    Tree, s_tree_t, toks, tmask, ctx, tail, kv, TREE: tl.constexpr, PHASE: tl.constexpr = 1
):
    """Which of the context positions `kv` each row sees (TREE: the batch has a draft tree,
    whose masks are read; else the bound is causal alone): [rows, BLOCK_N], or [1, BLOCK_N]
    all true in PHASE 0 (the blocks before `_seen_by_all`'s bound, which every row sees whole).
    One return for both phases: Triton wants every return of a function to have one type."""
    if PHASE == 0:
        vis = kv[None, :] >= 0
    else:
        vis = (kv[None, :] < ctx[:, None]) & tmask[:, None]
        if TREE:
            in_tail = kv[None, :] >= tail[:, None]
            bits = tl.load(
                Tree + toks[:, None].to(tl.int64) * s_tree_t + (kv[None, :] - tail[:, None]),
                mask=vis & in_tail,
                other=0,
            )
            vis = vis & (~in_tail | (bits != 0))
    return vis


@triton.jit(do_not_specialize=["s_pt_b", "s_tree_t"])
def _mla_kernel(
    QL,
    QR,
    Cache,
    Out,
    PageTable,
    Blocks,
    CtxLens,
    TailStarts,
    Tree,
    s_ql_t,
    s_ql_h,
    s_qr_t,
    s_qr_h,
    s_c_page,
    s_c_tok,
    s_pt_b,
    s_o_t,
    s_o_h,
    s_tree_t,
    num_heads,
    scale,
    page_size,
    R: tl.constexpr,
    P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    TREE: tl.constexpr,
):
    span, toks, hrow, tmask, ctx, tail = _block_rows(Blocks, CtxLens, TailStarts, BLOCK_M, BLOCK_H)
    heads = tl.program_id(1) * BLOCK_H + hrow
    rmask = tmask & (heads < num_heads)
    r, p = tl.arange(0, R), tl.arange(0, P)
    t64 = toks.to(tl.int64)
    ql = tl.load(
        QL + t64[:, None] * s_ql_t + heads[:, None] * s_ql_h + r[None, :],
        mask=rmask[:, None],
        other=0.0,
    )
    qr = tl.load(
        QR + t64[:, None] * s_qr_t + heads[:, None] * s_qr_h + p[None, :],
        mask=rmask[:, None],
        other=0.0,
    )
    table = PageTable + span.to(tl.int64) * s_pt_b
    m = tl.full([BLOCK_M * BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, R], tl.float32)
    end = tl.max(ctx, 0)  # the furthest position any row sees
    seen = _seen_by_all(rmask, ctx, end, BLOCK_N, TREE)
    for phase in tl.static_range(2):  # blocks [0, seen) unmasked, then [seen, end) masked
        lo, hi = seen * phase, seen + (end - seen) * phase
        for n0 in range(lo, hi, BLOCK_N):
            kv, kmask, page, off = _context_block(table, n0, end, page_size, BLOCK_N)
            base = page * s_c_page + off * s_c_tok
            ckv = tl.load(Cache + base[:, None] + r[None, :], mask=kmask[:, None], other=0.0)
            kr = tl.load(Cache + base[:, None] + R + p[None, :], mask=kmask[:, None], other=0.0)
            s = _dot(ql, tl.trans(ckv), IEEE) + _dot(qr, tl.trans(kr), IEEE)
            vis = _visible(Tree, s_tree_t, toks, rmask, ctx, tail, kv, TREE, phase)
            m, l, acc = _online_softmax_step(s * scale, vis, ckv, m, l, acc, IEEE)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(
        Out + t64[:, None] * s_o_t + heads[:, None] * s_o_h + r[None, :],
        out.to(Out.dtype.element_ty),
        mask=rmask[:, None],
    )


@triton.jit
def _kv_block(
    K,
    V,
    table,
    n0,
    end,
    s_k_page,
    s_k_tok,
    k_head,
    s_v_page,
    s_v_tok,
    v_head,
    page_size,
    head_dim,
    v_head_dim,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IN_PAGE: tl.constexpr,
):
    """One KV head's keys and values at context positions n0 .. n0 + BLOCK_N (zeros from
    `end` on), and the positions."""
    if IN_PAGE:  # the block lies in one page: one page id, rows at a fixed stride
        kv = n0 + tl.arange(0, BLOCK_N)
        kmask = kv < end
        page = tl.load(table + n0 // page_size).to(tl.int64) + tl.zeros_like(kv)
        off = kv % page_size
    else:
        kv, kmask, page, off = _context_block(table, n0, end, page_size, BLOCK_N)
    d, dv = tl.arange(0, D), tl.arange(0, DV)
    k = tl.load(
        K + page[:, None] * s_k_page + off[:, None] * s_k_tok + k_head + d[None, :],
        mask=kmask[:, None] & (d[None, :] < head_dim),
        other=0.0,
    )
    v = tl.load(
        V + page[:, None] * s_v_page + off[:, None] * s_v_tok + v_head + dv[None, :],
        mask=kmask[:, None] & (dv[None, :] < v_head_dim),
        other=0.0,
    )
    return k, v, kv


@triton.jit(do_not_specialize=["s_pt_b", "s_tree_t"])
def _mha_kernel(
    Q,
    K,
    V,
    Out,
    PageTable,
    Blocks,
    CtxLens,
    TailStarts,
    Tree,
    s_q_t,
    s_q_h,
    s_k_page,
    s_k_tok,
    s_k_head,
    s_v_page,
    s_v_tok,
    s_v_head,
    s_pt_b,
    s_o_t,
    s_o_h,
    s_tree_t,
    group,
    scale,
    page_size,
    head_dim,
    v_head_dim,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    G_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    IN_PAGE: tl.constexpr,
    TREE: tl.constexpr,
):
    span, toks, g, tmask, ctx, tail = _block_rows(Blocks, CtxLens, TailStarts, BLOCK_M, BLOCK_G)
    # BLOCK_G of the KV head's query heads: all of them (a few tokens a program), or fewer
    # for more tokens a program, each block of K/V then serving more of them
    kv_head = tl.program_id(1) // G_BLOCKS
    g = (tl.program_id(1) % G_BLOCKS) * BLOCK_G + g
    heads = kv_head * group + g
    rmask = tmask & (g < group)
    d, dv = tl.arange(0, D), tl.arange(0, DV)
    t64 = toks.to(tl.int64)
    q = tl.load(
        Q + t64[:, None] * s_q_t + heads[:, None] * s_q_h + d[None, :],
        mask=rmask[:, None] & (d[None, :] < head_dim),
        other=0.0,
    )
    table = PageTable + span.to(tl.int64) * s_pt_b
    m = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, DV], tl.float32)
    end = tl.max(ctx, 0)  # the furthest position any row sees
    seen = _seen_by_all(rmask, ctx, end, BLOCK_N, TREE)
    k_head, v_head = kv_head * s_k_head, kv_head * s_v_head
    for phase in tl.static_range(2):  # blocks [0, seen) unmasked, then [seen, end) masked
        lo, hi = seen * phase, seen + (end - seen) * phase
        for n0 in range(lo, hi, BLOCK_N):
            k, v, kv = _kv_block(
                K, V, table, n0, end, s_k_page, s_k_tok, k_head, s_v_page, s_v_tok, v_head,
                page_size, head_dim, v_head_dim, D, DV, BLOCK_N, IN_PAGE,
            )  # fmt: skip
            s = _dot(q, tl.trans(k), IEEE)
            vis = _visible(Tree, s_tree_t, toks, rmask, ctx, tail, kv, TREE, phase)
            m, l, acc = _online_softmax_step(s * scale, vis, v, m, l, acc, IEEE)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(
        Out + t64[:, None] * s_o_t + heads[:, None] * s_o_h + dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=rmask[:, None] & (dv[None, :] < v_head_dim),
    )


def mla_extend(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor,
    plan: ExtendPlan,
    scale: float,
    block_h: int = 16,
    block_n: int = 32,
    num_warps: int = 8,
    num_stages: int | None = None,
) -> torch.Tensor:
    """q_latent [T, H, R], q_rope [T, H, P] (the spans' tokens, span after span); `cache` one layer's
    latent pages [num_pages, page_size, R + P], the new tokens' latents already stored; `page_table`
    [S, max_pages], row i for span i. Returns the attention-weighted latents [T, H, R]."""
    tokens, heads, rank = q_latent.shape
    assert cache.stride(-1) == 1 and q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1
    out = torch.empty_like(q_latent)
    if not tokens:
        return out
    block_h = min(block_h, triton.next_power_of_2(heads))
    _mla_kernel[(plan.blocks.shape[0], triton.cdiv(heads, block_h))](
        q_latent,
        q_rope,
        cache,
        out,
        page_table,
        plan.blocks,
        plan.ctx_lens,
        plan.tail_starts,
        plan.tree,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        cache.stride(0),
        cache.stride(1),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        plan.tree.stride(0),
        heads,
        scale,
        cache.shape[1],
        R=rank,
        P=q_rope.shape[-1],
        BLOCK_M=plan.block_m,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        IEEE=q_latent.dtype == torch.float32,
        TREE=plan.has_tree,
        num_warps=num_warps,
        **stages(num_stages),
    )
    return out


def stages(num_stages: int | None) -> dict:
    """Triton's software-pipelining depth where one is asked for (its default otherwise)."""
    return {} if num_stages is None else {"num_stages": num_stages}


def mha_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    plan: ExtendPlan,
    scale: float,
    block_n: int = 32,
    num_warps: int = 4,
    num_stages: int | None = None,
    block_g: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D]; `k_cache` [num_pages, page_size, Hkv, D] and `v_cache` [.., Hkv, Dv] one layer's
    pages, the new tokens' K/V already stored. Returns [T, Hq, Dv]. The plan's `block_m` tokens times
    `block_g` query heads of one KV head (by default all of them, padded to a power of two) are a
    program's rows."""
    tokens, heads, head_dim = q.shape
    kv_heads, v_head_dim = k_cache.shape[2], v_cache.shape[-1]
    group = heads // kv_heads
    block_g = block_g or triton.next_power_of_2(group)
    g_blocks = triton.cdiv(group, block_g)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = q.new_empty(tokens, heads, v_head_dim)
    if not tokens:
        return out
    _mha_kernel[(plan.blocks.shape[0], kv_heads * g_blocks)](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        plan.blocks,
        plan.ctx_lens,
        plan.tail_starts,
        plan.tree,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        plan.tree.stride(0),
        group,
        scale,
        k_cache.shape[1],
        head_dim,
        v_head_dim,
        D=triton.next_power_of_2(head_dim),
        DV=triton.next_power_of_2(v_head_dim),
        BLOCK_M=plan.block_m,
        BLOCK_G=block_g,
        G_BLOCKS=g_blocks,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
        IN_PAGE=k_cache.shape[1] % block_n == 0,
        TREE=plan.has_tree,
        num_warps=num_warps,
        **stages(num_stages),
    )
    return out
