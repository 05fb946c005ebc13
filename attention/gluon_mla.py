"""MLA decode for Hopper in Gluon: warp-specialized, FlashMLA's split of the work.

The Triton kernel (`triton_mla`) runs every step of a block in every warp:
scores, softmax and the weighted sum one after another, so the tensor
cores wait while the softmax runs and the loads wait for both. With 128
heads a rank (DeepSeek-V3 with DP attention) that kept it at about a third
of the copy bandwidth. Here a program takes 64 heads of one sequence and
one split of its context, in three partitions:

- a loader warp brings each block of 64 tokens (latents and rope keys)
  into shared memory by TMA, two blocks in flight;
- warpgroup 0 computes the scores of a block (64 heads x 64 tokens over
  the 576 columns), their online softmax, writes the weights to shared
  memory, and accumulates the left half of the value columns (256);
- warpgroup 1 takes the weights and accumulates the right half.

Sparse attention (GLM-5's 64 heads over 2048 selected positions) takes
the same partitions with a gathering loader: four warps copy the selected
rows by cp.async (Hopper's TMA has no gather).

The weights take the place of the block's rope keys, which only the scores
read. Shared memory: queries 72 KB (by TMA as the program starts), two
blocks 144 KB. The splits are merged by `triton_mla.combine_splits`. With
128 heads both programs of a sequence read each block (through the L2: TMA
multicast is not in Triton 3.6), and the tensor cores take about as long as
the copy: at batch 32 x 8k a launch that reads no block (`read_blocks`)
takes 0.126 ms, where reading at the copy bandwidth would take 0.104.
Tried and slower (notes of sessions 29, 33, 36 and 39): block k's sum
issued with block k + 1's scores (FlashAttention-3), blocks of 16-32
tokens in more stages (dense and sparse), the splits merged in the kernel
by the last warpgroup to finish, an L2 prefetch of the blocks ahead,
FlashMLA's "seesaw" (each warpgroup scores one block of a pair: with the
two-block ring a pair's blocks come back only at its end, 26-45% slower),
a warpgroup that only scores beside two that each take a value half (the
scores' softmax off the MMAs' path; 4-11% slower, its floor too: 12 warps
hold 168 registers a thread and spill; session 41).

Written for Triton's Gluon (`triton.experimental.gluon`, Triton 3.6 on the
GPU hosts). Hopper only, bfloat16 or float16 latents, 512 + 64 columns,
pages a multiple of 64 tokens. Heads fewer than 64 a program (16 at
DeepSeek-V3's attention TP 8, or a count not a multiple of 64) are padded:
the queries' TMA box fills the missing rows with zeros and their outputs
are not stored. The kernel reads the cache as fast as at 64 heads, since
the tensor cores are not what it waits for (H100, 16 heads, batch 32 at
32k: 0.397 ms against the Triton kernel's 0.481 and FlashInfer's 0.416).
A page's rows past a context's end must hold finite values (the KV pool
starts zeroed): they are read and weighted by zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dserve.attention.dependent_launch import dependent_launch
from dserve.attention.gluon_tma import HAVE_GLUON, descriptor, tma_readable
from dserve.attention.launch_shapes import BLOCK_TOKENS, MLA_HEADS, mla_splits
from dserve.attention.triton_mla import combine_splits

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from dserve.attention.gluon_tma import (
        block_page,
        block_pages,
        ring,
        start_next,
        tma_load,
        wait_previous,
    )

    # cp.async: `async_load` in later Tritons (3.9), the older name in 3.6
    cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

BLOCK_H = tl.constexpr(MLA_HEADS)  # heads a program: one warpgroup's MMA rows
BLOCK_N = BLOCK_TOKENS  # tokens a block: one TMA box, within a page
STAGES = 2  # blocks in flight (with 64 tokens, what fits)
LOG2E = tl.constexpr(1.4426950408889634)


def supported(q_latent, cache) -> bool:
    """Whether this kernel serves these shapes on this device (any number
    of heads: see the module's docstring)."""
    if not HAVE_GLUON or not q_latent.is_cuda:
        return False
    if torch.cuda.get_device_capability(q_latent.device) != (9, 0):
        return False
    return (
        q_latent.dtype in (torch.bfloat16, torch.float16)
        and cache.dtype == q_latent.dtype
        and q_latent.shape[-1] == 512
        and cache.shape[-1] == 576
        and cache.shape[1] % 64 == 0
    )


if HAVE_GLUON:

    @gluon.jit
    def _block_range(
        seq_lens,
        b,
        split,
        min_split,
        num_splits,
        BLOCK_N: gl.constexpr,
        width,
        SPARSE: gl.constexpr,
    ):
        """[start, end) of this split's context positions (a whole number of
        blocks from start), as the Triton kernel splits them."""
        if SPARSE:  # the row's selection, -1 where it has no position
            seq_len = width
        else:
            seq_len = gl.load(seq_lens + b).to(gl.int32)  # the engine's are int64
        per = gl.maximum(gl.cdiv(seq_len, num_splits), min_split)
        per = gl.cdiv(per, BLOCK_N) * BLOCK_N
        start = split * per
        end = gl.minimum(start + per, seq_len)
        return start, end

    @gluon.jit
    def _loader(descs, stages, bars, table, span, page_size, READ: gl.constexpr):
        """Worker (one warp): each block's latents and rope keys by
        TMA into the next free stage, its page read a group ahead
        (`block_page`). Not READ: the stage is handed over unread
        (`mla_decode`'s `read_blocks`)."""
        lat_desc, rope_desc = descs
        kv_s, rope_s, alpha_s, l_s = stages
        ready, free, p_ready, done = bars
        h0, start, end, sel_row = span
        STAGES: gl.constexpr = kv_s.shape[0]
        BLOCK_N: gl.constexpr = kv_s.shape[2]
        nbytes: gl.constexpr = lat_desc.block_type.nbytes + rope_desc.block_type.nbytes
        blocks = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        run = (table, start, blocks, page_size)
        pages = block_pages(run, 0, BLOCK_N)
        ahead = pages
        for k in range(blocks):
            s = k % STAGES
            page, pages, ahead = block_page(run, k, pages, ahead, BLOCK_N)
            off = (start + k * BLOCK_N) % page_size
            mbarrier.wait(free.index(s), ((k // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            if READ:
                mbarrier.expect(bar, nbytes)
                tma_load(lat_desc, [page, off, 0], bar, kv_s.index(s))
                tma_load(rope_desc, [page, off, 512], bar, rope_s.index(s))
            else:
                mbarrier.arrive(bar)

    @gluon.jit
    def _gather_loader(gather, stages, bars, table, span, page_size):
        """Worker (four warps) for sparse attention: each block's selected
        positions' latents and rope keys, row by row (cp.async: Hopper's
        TMA has no gather), into the next free stage. A position of -1
        reads zeros."""
        cache, s_c_page, s_c_tok = gather
        kv_s, rope_s, alpha_s, l_s = stages
        ready, free, p_ready, done = bars
        h0, start, end, sel_row = span
        STAGES: gl.constexpr = kv_s.shape[0]
        BLOCK_N: gl.constexpr = kv_s.shape[2]
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
        blocks = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        for k in range(blocks):
            s = k % STAGES
            idx = start + k * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
            pos = gl.load(sel_row + idx, mask=idx < end, other=-1)
            valid = pos >= 0
            pos = gl.maximum(pos, 0)
            page = gl.load(table + pos // page_size, mask=valid, other=0).to(gl.int64)
            row = page * s_c_page + (pos % page_size) * s_c_tok
            at = cache + row[:, None] + cols[None, :]
            mbarrier.wait(free.index(s), ((k // STAGES) & 1) ^ 1)
            keys = kv_s.index(s).reshape([BLOCK_N, 512])
            for c in gl.static_range(8):
                dst = keys.slice(c * 64, 64, dim=1)
                cp_async(dst, at + c * 64, valid[:, None])
            ropes = rope_s.index(s).reshape([BLOCK_N, 64])
            cp_async(ropes, at + 512, valid[:, None])
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)

    @gluon.jit
    def _scores_half(queries, stages, bars, out, span, scale_log2, SPARSE: gl.constexpr):
        """Default partition (warpgroup 0): once the queries are in shared
        memory (`q_ready`: their TMA), the scores, online softmax, the
        weights for warpgroup 1, the left 256 value columns."""
        q_lat_s, q_rope_s, q_ready = queries
        kv_s, rope_s, alpha_s, l_s = stages
        ready, free, p_ready, done = bars
        mid_o, mid_lse, o_base, lse_base, s_mo_h, s_ml_h, heads = out
        h0, start, end, sel_row = span
        STAGES: gl.constexpr = kv_s.shape[0]
        BLOCK_N: gl.constexpr = kv_s.shape[2]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]
        )
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        m = gl.full([64], float("-inf"), gl.float32, rows_s)
        l = gl.zeros([64], gl.float32, rows_s)
        o = gl.zeros([64, 256], gl.float32, o_layout)
        zeros = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
        blocks = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        q_lat = q_lat_s.reshape([64, 512])
        q_rope = q_rope_s.reshape([64, 64])
        mbarrier.wait(q_ready, 0)
        for k in range(blocks):
            s = k % STAGES
            mbarrier.wait(ready.index(s), (k // STAGES) & 1)
            if SPARSE:  # copied by threads (cp.async), read by the tensor cores
                fence_async_shared()
            keys = kv_s.index(s).reshape([BLOCK_N, 512])
            ropes = rope_s.index(s).reshape([BLOCK_N, 64])
            acc = warpgroup_mma(q_lat, keys.permute((1, 0)), zeros, use_acc=False, is_async=True)
            acc = warpgroup_mma(q_rope, ropes.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            cols += start + k * BLOCK_N
            seen = cols < end
            if SPARSE:
                seen &= gl.load(sel_row + cols, mask=seen, other=-1) >= 0
            x = gl.where(seen[None, :], acc * scale_log2, float("-inf"))
            m_new = gl.maximum(m, gl.max(x, 1))
            # rows that have seen no position yet (a sparse split can start
            # with blocks of -1) stay at zero instead of NaN
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m - m_safe)
            p = gl.exp2(x - m_safe[:, None])
            l = l * alpha + gl.sum(p, 1)
            m = m_new
            # the weights replace the rope keys, which the scores were the last to read
            weights = _weights(rope_s, s)
            weights.store(p.to(weights.dtype))
            alpha_s.index(s).store(alpha)
            fence_async_shared()
            mbarrier.arrive(p_ready.index(s))
            o = o * gl.convert_layout(alpha, rows_o)[:, None]
            o = warpgroup_mma(weights, keys.slice(0, 256, dim=1), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=(o,))
            mbarrier.arrive(free.index(s))
        l_s.store(l)
        mbarrier.arrive(done)
        rows = h0 + gl.arange(0, 64, layout=rows_s)
        filled = l > 0
        lse = (m + gl.log2(gl.where(filled, l, 1.0))) / LOG2E
        lse = gl.where(filled, lse, float("-inf"))
        # one split: the output itself, no log-sum-exp to merge by
        if mid_o.dtype.element_ty == gl.float32:
            gl.store(mid_lse + lse_base + rows * s_ml_h, lse, mask=rows < heads)
        _store_half(mid_o + o_base, o, l, (s_mo_h, h0, heads), 0)

    @gluon.jit
    def _values_half(stages, bars, out, span, SPARSE: gl.constexpr):
        """Worker (warpgroup 1): the right 256 value columns, weighted by
        what warpgroup 0 left in shared memory."""
        kv_s, rope_s, alpha_s, l_s = stages
        ready, free, p_ready, done = bars
        mid_o, mid_lse, o_base, lse_base, s_mo_h, s_ml_h, heads = out
        h0, start, end, sel_row = span
        STAGES: gl.constexpr = kv_s.shape[0]
        BLOCK_N: gl.constexpr = kv_s.shape[2]
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]
        )
        rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        o = gl.zeros([64, 256], gl.float32, o_layout)
        blocks = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        for k in range(blocks):
            s = k % STAGES
            mbarrier.wait(p_ready.index(s), (k // STAGES) & 1)
            if SPARSE:
                fence_async_shared()
            alpha = alpha_s.index(s).load(rows_o)
            weights = _weights(rope_s, s)
            values = kv_s.index(s).reshape([BLOCK_N, 512]).slice(256, 256, dim=1)
            o = warpgroup_mma(weights, values, o * alpha[:, None], is_async=True)
            o = warpgroup_mma_wait(0, deps=(o,))
            mbarrier.arrive(free.index(s))
        mbarrier.wait(done, 0)
        l = l_s.load(rows_o)
        _store_half(mid_o + o_base, o, l, (s_mo_h, h0, heads), 256)

    @gluon.jit
    def _weights(rope_s, s):
        """Stage s's softmax weights [64 heads, 64 tokens], in the place of
        its rope keys [64 tokens, 64] (the same bytes and layout)."""
        return rope_s.index(s).reshape([64, 64])

    @gluon.jit
    def _store_half(out, o, l, rows_at, col0: gl.constexpr):
        """A half's normalised output: rows h0.. below `heads` (`rows_at`:
        their stride, h0, heads), columns col0.. (zero where the split saw
        no token)."""
        s_mo_h, h0, heads = rows_at
        o_layout: gl.constexpr = o.type.layout
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, 256, layout=gl.SliceLayout(0, o_layout))
        l = gl.convert_layout(l, gl.SliceLayout(1, o_layout))
        o = o / gl.where(l > 0, l, 1.0)[:, None]
        at = (h0 + rows)[:, None] * s_mo_h + (col0 + cols)[None, :]
        mask = (h0 + rows)[:, None] < heads
        gl.store(out + at, o.to(out.dtype.element_ty), mask=mask)

    # counts that follow the batch, the context and the splits: one variant for all (Triton
    # specializes an int on == 1 and on divisibility by 16), or a step compiles after ready.
    # The output's strides stay specialized: multiples of 512 whatever the splits (`mla_decode`
    # makes them so), and the stores vectorize only where Triton knows that (unspecialized,
    # every element was its own store: 11 us more a launch at batch 32, H100)
    @gluon.jit(
        do_not_specialize=[
            "s_pt_b",
            "s_ml_b",
            "s_ml_h",
            "min_split",
            "num_splits",
            "s_sel_b",
            "sel_width",
        ]
    )
    def _mla_decode_kernel(
        q_desc,
        qr_desc,
        lat_desc,
        rope_desc,
        page_table,
        row_seqs,
        seq_lens,
        mid_o,
        mid_lse,
        s_pt_b,
        s_mo_b,
        s_mo_h,
        s_mo_s,
        s_ml_b,
        s_ml_h,
        scale_log2,
        page_size,
        min_split,
        num_splits,
        cache,
        s_c_page,
        s_c_tok,
        selected,
        s_sel_b,
        sel_width,
        heads,
        STAGES: gl.constexpr,
        SPARSE: gl.constexpr,
        READ: gl.constexpr,
        PDL: gl.constexpr,
    ):
        h0 = gl.program_id(0) * BLOCK_H
        b, split = gl.program_id(1), gl.program_id(2)
        BLOCK_N: gl.constexpr = lat_desc.block_type.shape[1]
        if PDL:  # a dependent launch, as is the merge after it
            start_next()
            wait_previous()
        start, end = _block_range(
            seq_lens, b, split, min_split, num_splits, BLOCK_N, sel_width, SPARSE
        )
        if SPARSE:
            sel_row = selected + b.to(gl.int64) * s_sel_b
        else:  # nothing to read
            sel_row: gl.constexpr = 0
        table = page_table + gl.load(row_seqs + b).to(gl.int64) * s_pt_b
        dtype: gl.constexpr = lat_desc.dtype
        q_lat_s = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
        q_rope_s = gl.allocate_shared_memory(dtype, qr_desc.block_type.shape, qr_desc.layout)
        kv_s = ring(lat_desc, STAGES)
        rope_s = ring(rope_desc, STAGES)
        vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        alpha_s = gl.allocate_shared_memory(gl.float32, [STAGES, 64], vec)
        l_s = gl.allocate_shared_memory(gl.float32, [64], vec)
        bar: gl.constexpr = mbarrier.MBarrierLayout()
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
        p_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
        done = gl.allocate_shared_memory(gl.int64, [1], bar)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
        for i in gl.static_range(STAGES):
            # the TMA's bytes, or each of the four gathering warps' threads
            mbarrier.init(ready.index(i), count=128 if SPARSE else 1)
            mbarrier.init(free.index(i), count=2)
            mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(done, count=1)
        mbarrier.init(q_ready, count=1)
        fence_async_shared()  # the barriers, before the partitions use them
        # the queries by TMA, while the loader brings the first blocks
        q_bytes: gl.constexpr = q_desc.block_type.nbytes + qr_desc.block_type.nbytes
        mbarrier.expect(q_ready, q_bytes)
        tma_load(q_desc, [b, h0, 0], q_ready, q_lat_s)
        tma_load(qr_desc, [b, h0, 0], q_ready, q_rope_s)
        o_base = b.to(gl.int64) * s_mo_b + split * s_mo_s
        lse_base = b.to(gl.int64) * s_ml_b + split
        stages = (kv_s, rope_s, alpha_s, l_s)
        bars = (ready, free, p_ready, done)
        out = (mid_o, mid_lse, o_base, lse_base, s_mo_h, s_ml_h, heads)
        span = (h0, start, end, sel_row)
        queries = (q_lat_s, q_rope_s, q_ready)
        if SPARSE:
            gather = (cache, s_c_page, s_c_tok)
            gl.warp_specialize(
                [
                    (_scores_half, (queries, stages, bars, out, span, scale_log2, SPARSE)),
                    (_values_half, (stages, bars, out, span, SPARSE)),
                    (_gather_loader, (gather, stages, bars, table, span, page_size)),
                ],
                [4, 4],
                [192, 80],
            )
        else:
            descs = (lat_desc, rope_desc)
            gl.warp_specialize(
                [
                    (_scores_half, (queries, stages, bars, out, span, scale_log2, SPARSE)),
                    (_values_half, (stages, bars, out, span, SPARSE)),
                    (_loader, (descs, stages, bars, table, span, page_size, READ)),
                ],
                [4, 1],
                [240, 24],
            )


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_len: int | None = None,
    row_seqs: torch.Tensor | None = None,
    min_split: int | None = None,
    selected: torch.Tensor | None = None,
    read_blocks: bool = True,
) -> torch.Tensor:
    """`triton_mla.mla_decode`'s contract on this kernel: q_latent [B, H, 512],
    q_rope [B, H, 64], one layer's `cache` [num_pages, page_size, 576];
    returns [B, H, 512]. Sparse attention: `selected` [B, K] each row's
    context positions (-1 for none), `seq_lens` not read. `read_blocks`
    False (dense only) times the kernel's own floor: every step but the
    blocks' copies (the output is then not attention; `bench.mla_decode`).
    A dependent launch on Hopper (`dependent_launch`), as is the merge of
    its splits."""
    batch, heads, rank = q_latent.shape
    if not batch:  # no rows: nothing to launch (TMA has no box of an empty tensor)
        return q_latent.new_empty(0, heads, rank)
    sparse = selected is not None
    assert read_blocks or not sparse, "the floor is the dense kernel's"
    if sparse:
        selected = selected.contiguous()
        max_len = selected.shape[1]
    if num_splits is None:
        longest = max_len or 1 << 16
        num_splits = mla_splits(batch, heads, longest, q_latent.device, sparse)
    if row_seqs is None:
        row_seqs = torch.arange(batch, device=q_latent.device)
    assert q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1
    assert cache.stride(-1) == 1 and page_table.stride(-1) == 1
    f32 = dict(dtype=torch.float32, device=q_latent.device)
    out = torch.empty(batch, heads, rank, dtype=q_latent.dtype, device=q_latent.device)
    if num_splits == 1:  # the kernel writes the output: nothing to merge
        mid_out, mid_lse = out.unsqueeze(2), out[:, :, :1]
    else:
        mid_out = torch.empty(batch, heads, num_splits, rank, **f32)
        mid_lse = torch.empty(batch, heads, num_splits, **f32)
    kind = gl.bfloat16 if cache.dtype == torch.bfloat16 else gl.float16
    queries = [_tma_ready(q) for q in (q_latent, q_rope)]
    queries = [descriptor(q, [1, BLOCK_H.value, q.shape[-1]], kind) for q in queries]
    descs = [descriptor(cache, [1, BLOCK_N, cols], kind) for cols in (512, 64)]
    grid = (triton.cdiv(heads, BLOCK_H.value), batch, num_splits)
    _mla_decode_kernel[grid](
        *queries,
        *descs,
        page_table,
        row_seqs,
        seq_lens if seq_lens is not None else selected,
        mid_out,
        mid_lse,
        page_table.stride(0),
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        scale * LOG2E.value,
        cache.shape[1],
        2 * BLOCK_N if min_split is None else min_split,
        num_splits,
        cache,
        cache.stride(0),
        cache.stride(1),
        selected if sparse else seq_lens,
        selected.stride(0) if sparse else 0,
        selected.shape[1] if sparse else 0,
        heads,
        STAGES,
        sparse,
        read_blocks,
        num_warps=4,
        maxnreg=168,
        **dependent_launch(q_latent.device),
    )
    if num_splits == 1:
        return out
    return combine_splits(mid_out, mid_lse, out)


def _tma_ready(x: torch.Tensor) -> torch.Tensor:
    """`x`, or a contiguous copy where TMA cannot read it."""
    return x if tma_readable(x) else x.contiguous()
