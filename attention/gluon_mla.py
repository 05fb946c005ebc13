"""MLA decode for Hopper in Gluon: warp-specialized, FlashMLA's split of the work.

The Triton kernel (`triton_mla`) runs every step of a block in every warp:
scores, softmax and the weighted sum one after another, so the tensor
cores wait while the softmax runs and the loads wait for both. With 128
heads a rank (DeepSeek-V3 with DP attention) that kept it at about a third
of the copy bandwidth. Here a program takes 64 heads and a run of the
batch's blocks (`mla_runs`: each row in equal parts, or every row's blocks
end to end cut evenly over one program an SM, a run then holding the end
of one row, whole rows and the start of another), segment by segment, in
three partitions:

- a loader warp brings each block of 64 tokens (latents and rope keys)
  into shared memory by TMA, two blocks in flight;
- warpgroup 0 computes the scores of a block (64 heads x 64 tokens over
  the 576 columns), their online softmax, writes the weights to shared
  memory, and accumulates the left half of the value columns (256);
- warpgroup 1 takes the weights and accumulates the right half;
- after a segment's blocks, warpgroup 0 loads the next row's queries while
  both store their halves: a whole row's output, or a partial (float32,
  normalised, with its log-sum-exp) that `combine_splits` (rows in parts)
  or `mla_runs.merge_runs` (the even cut) merges.

Sparse attention (GLM-5's 64 heads over 2048 selected positions) takes
the same partitions with a gathering loader: four warps copy the selected
rows by cp.async (Hopper's TMA has no gather).

The weights take the place of the block's rope keys, which only the scores
read. Shared memory: queries 72 KB (by TMA as a segment starts), two
blocks 144 KB. With
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
from dserve.attention.launch_shapes import BLOCK_TOKENS, MLA_HEADS
from dserve.attention.mla_runs import compile_merge, launch_cut, merge_runs, min_blocks
from dserve.attention.triton_mla import combine_splits

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from dserve.attention.gluon_mla_loaders import gather_loader, tma_loader
    from dserve.attention.gluon_tma import ring, tma_load
    from dserve.attention.mla_runs import schedule, segment

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
    def _scores_half(queries, stages, bars, out, rows_at, run, scale_log2, SPARSE: gl.constexpr):
        """Default partition (warpgroup 0), segment by segment: once the
        row's queries are in shared memory (`q_ready`: their TMA), the
        scores, online softmax, the weights for warpgroup 1, the left 256
        value columns; then the next row's queries' TMA and the outputs."""
        q_lat_s, q_rope_s, q_ready, q_descs, h0 = queries
        kv_s, rope_s, alpha_s, l_s = stages
        ready, free, p_ready, done, l_free = bars
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
        zeros = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
        q_lat = q_lat_s.reshape([64, 512])
        q_rope = q_rope_s.reshape([64, 64])
        first, lo0, last, hi0, alone = run
        n = 0
        for r in range(first, last + 1):
            seg_i = r - first
            start, end, blocks, table, sel_row, whole = segment(rows_at, run, r, SPARSE, BLOCK_N)
            m = gl.full([64], float("-inf"), gl.float32, rows_s)
            l = gl.zeros([64], gl.float32, rows_s)
            o = gl.zeros([64, 256], gl.float32, o_layout)
            mbarrier.wait(q_ready, seg_i & 1)
            for k in range(blocks):
                i = n + k
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                if SPARSE:  # copied by threads (cp.async), read by the tensor cores
                    fence_async_shared()
                keys = kv_s.index(s).reshape([BLOCK_N, 512])
                ropes = rope_s.index(s).reshape([BLOCK_N, 64])
                acc = warpgroup_mma(
                    q_lat, keys.permute((1, 0)), zeros, use_acc=False, is_async=True
                )
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
            n += blocks
            if r < last:  # the next row's queries (their buffers read for the last time above)
                _load_queries(q_descs, (q_lat_s, q_rope_s, q_ready), r + 1, h0)
            if seg_i > 0:  # warpgroup 1 has read the last segment's sums
                mbarrier.wait(l_free, (seg_i - 1) & 1)
            l_s.store(l)
            mbarrier.arrive(done)
            filled = l > 0
            lse = (m + gl.log2(gl.where(filled, l, 1.0))) / LOG2E
            lse = gl.where(filled, lse, float("-inf"))
            where = (r, whole, (r != first).to(gl.int32))
            _store_half(out, o, l, lse, where, 0)

    @gluon.jit
    def _values_half(stages, bars, out, rows_at, run, SPARSE: gl.constexpr):
        """Worker (warpgroup 1): the right 256 value columns, weighted by
        what warpgroup 0 left in shared memory, segment by segment."""
        kv_s, rope_s, alpha_s, l_s = stages
        ready, free, p_ready, done, l_free = bars
        STAGES: gl.constexpr = kv_s.shape[0]
        BLOCK_N: gl.constexpr = kv_s.shape[2]
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]
        )
        rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        first, lo0, last, hi0, alone = run
        n = 0
        for r in range(first, last + 1):
            seg_i = r - first
            start, end, blocks, table, sel_row, whole = segment(rows_at, run, r, SPARSE, BLOCK_N)
            o = gl.zeros([64, 256], gl.float32, o_layout)
            for k in range(blocks):
                i = n + k
                s = i % STAGES
                mbarrier.wait(p_ready.index(s), (i // STAGES) & 1)
                if SPARSE:
                    fence_async_shared()
                alpha = alpha_s.index(s).load(rows_o)
                weights = _weights(rope_s, s)
                values = kv_s.index(s).reshape([BLOCK_N, 512]).slice(256, 256, dim=1)
                o = warpgroup_mma(weights, values, o * alpha[:, None], is_async=True)
                o = warpgroup_mma_wait(0, deps=(o,))
                mbarrier.arrive(free.index(s))
            n += blocks
            mbarrier.wait(done, seg_i & 1)
            l = l_s.load(rows_o)
            mbarrier.arrive(l_free)
            where = (r, whole, (r != first).to(gl.int32))
            _store_half(out, o, l, l, where, 256)

    @gluon.jit
    def _weights(rope_s, s):
        """Stage s's softmax weights [64 heads, 64 tokens], in the place of
        its rope keys [64 tokens, 64] (the same bytes and layout)."""
        return rope_s.index(s).reshape([64, 64])

    @gluon.jit
    def _load_queries(q_descs, q_bufs, r, h0):
        """Row r's queries of heads h0.. by TMA (`q_ready` counts their bytes)."""
        q_desc, qr_desc = q_descs
        q_lat_s, q_rope_s, q_ready = q_bufs
        q_bytes: gl.constexpr = q_desc.block_type.nbytes + qr_desc.block_type.nbytes
        mbarrier.expect(q_ready, q_bytes)
        tma_load(q_desc, [r, h0, 0], q_ready, q_lat_s)
        tma_load(qr_desc, [r, h0, 0], q_ready, q_rope_s)

    @gluon.jit
    def _store_half(out, o, l, lse, where, col0: gl.constexpr):
        """A half's normalised output (zero where the segment saw no
        position), `where` = (row, whole, slot): a whole row's own output
        (heads h0.. below `heads`), else the run's partial in `slot`, with
        its log-sum-exp (`lse`, from the left half's call)."""
        final, s_f_b, s_f_h, mid_o, mid_lse, part, h0, heads = out
        padded = gl.num_programs(0) * 64  # the partials' heads: every group's 64
        r, whole, slot = where
        o_layout: gl.constexpr = o.type.layout
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, 256, layout=gl.SliceLayout(0, o_layout))
        l = gl.convert_layout(l, gl.SliceLayout(1, o_layout))
        o = o / gl.where(l > 0, l, 1.0)[:, None]
        if whole:
            at = r.to(gl.int64) * s_f_b + (h0 + rows)[:, None] * s_f_h
            at += (col0 + cols)[None, :]
            mask = (h0 + rows)[:, None] < heads
            gl.store(final + at, o.to(final.dtype.element_ty), mask=mask)
        else:
            block = (part + slot) * padded + h0
            gl.store(mid_o + ((block + rows) * 512)[:, None] + (col0 + cols)[None, :], o)
            if col0 == 0:
                lse_rows = gl.arange(0, 64, layout=lse.type.layout)
                gl.store(mid_lse + block + lse_rows, lse)

    # counts that follow the batch and the launch: one variant for all (Triton specializes an
    # int on == 1 and on divisibility by 16), or a step compiles after ready. The output's
    # strides stay specialized: multiples of 512 (unspecialized, every element was its own
    # store: 11 us more a launch at batch 32, H100)
    @gluon.jit(
        do_not_specialize=[
            "rows",
            "programs",
            "least",
            "parts",
            "s_pt_b",
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
        final,
        s_f_b,
        s_f_h,
        mid_o,
        mid_lse,
        row_meta,
        rows,
        programs,
        least,
        parts,
        s_pt_b,
        scale_log2,
        page_size,
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
        g, p = gl.program_id(0), gl.program_id(1)
        h0 = g * BLOCK_H
        BLOCK_N: gl.constexpr = lat_desc.block_type.shape[1]
        if PDL:  # a dependent launch, as is the merge after it
            gdc_launch_dependents()
            gdc_wait()
        lens = (seq_lens, rows, sel_width)
        run = schedule(lens, p, (programs, least, parts), row_meta, SPARSE, BLOCK_N)
        first, lo0, last, hi0, alone = run
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
        l_free = gl.allocate_shared_memory(gl.int64, [1], bar)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
        for i in gl.static_range(STAGES):
            # the TMA's bytes, or each of the four gathering warps' threads
            mbarrier.init(ready.index(i), count=128 if SPARSE else 1)
            mbarrier.init(free.index(i), count=2)
            mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(done, count=1)
        mbarrier.init(l_free, count=1)
        mbarrier.init(q_ready, count=1)
        fence_async_shared()  # the barriers, before the partitions use them
        q_descs = (q_desc, qr_desc)
        if first <= last:  # the first row's queries, while the loader brings its first blocks
            _load_queries(q_descs, (q_lat_s, q_rope_s, q_ready), first, h0)
        stages = (kv_s, rope_s, alpha_s, l_s)
        bars = (ready, free, p_ready, done, l_free)
        out = (final, s_f_b, s_f_h, mid_o, mid_lse, p * 2, h0, heads)
        rows_at = (seq_lens, row_seqs, page_table, s_pt_b, selected, s_sel_b, sel_width)
        queries = (q_lat_s, q_rope_s, q_ready, q_descs, h0)
        if SPARSE:
            gather = ((cache, s_c_page, s_c_tok), stages, bars, rows_at, run, page_size)
            gl.warp_specialize(
                [
                    (_scores_half, (queries, stages, bars, out, rows_at, run, scale_log2, True)),
                    (_values_half, (stages, bars, out, rows_at, run, True)),
                    (gather_loader, gather),
                ],
                [4, 4],
                [192, 80],
            )
        else:
            load = ((lat_desc, rope_desc), stages, bars, rows_at, run, page_size, READ)
            gl.warp_specialize(
                [
                    (_scores_half, (queries, stages, bars, out, rows_at, run, scale_log2, False)),
                    (_values_half, (stages, bars, out, rows_at, run, False)),
                    (tma_loader, load),
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
    The batch's blocks are cut into one run a program (`mla_runs`): each
    row in parts, or the batch's blocks evenly over one program an SM
    (`launch_cut`, from the longest row's `max_len`); `num_splits` sets the
    parts, `min_split` the shortest run in positions. A dependent launch
    on Hopper (`dependent_launch`), as is the merge of the split rows."""
    batch, heads, rank = q_latent.shape
    if not batch:  # no rows: nothing to launch (TMA has no box of an empty tensor)
        return q_latent.new_empty(0, heads, rank)
    sparse = selected is not None
    assert read_blocks or not sparse, "the floor is the dense kernel's"
    device = q_latent.device
    if sparse:
        selected = selected.contiguous()
    groups = triton.cdiv(heads, BLOCK_H.value)
    least = min_blocks(sparse) if min_split is None else max(1, min_split // BLOCK_N)
    if num_splits is not None:  # each row in as many parts
        programs, parts = batch * num_splits, num_splits
    else:
        longest = selected.shape[1] if sparse else max_len or 1 << 16
        programs, parts = launch_cut(batch, heads, longest, device, sparse)
    if row_seqs is None:
        row_seqs = torch.arange(batch, device=device)
    assert q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1
    assert cache.stride(-1) == 1 and page_table.stride(-1) == 1
    f32 = dict(dtype=torch.float32, device=device)
    out = torch.empty(batch, heads, rank, dtype=q_latent.dtype, device=device)
    runs = 1 if parts == 1 else programs  # one part a row: no partial outputs
    padded = groups * BLOCK_H.value
    mid_out = torch.empty(runs, 2, padded, rank, **f32)
    mid_lse = torch.empty(runs, 2, padded, **f32)
    row_meta = torch.empty(batch, 2, dtype=torch.int32, device=device)
    kind = gl.bfloat16 if cache.dtype == torch.bfloat16 else gl.float16
    queries = [_tma_ready(q) for q in (q_latent, q_rope)]
    queries = [descriptor(q, [1, BLOCK_H.value, q.shape[-1]], kind) for q in queries]
    descs = [descriptor(cache, [1, BLOCK_N, cols], kind) for cols in (512, 64)]
    _mla_decode_kernel[(groups, programs)](
        *queries,
        *descs,
        page_table,
        row_seqs,
        seq_lens if seq_lens is not None else selected,
        out,
        out.stride(0),
        out.stride(1),
        mid_out,
        mid_lse,
        row_meta,
        batch,
        programs,
        least,
        parts,
        page_table.stride(0),
        scale * LOG2E.value,
        cache.shape[1],
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
        **dependent_launch(device),
    )
    if out.is_cuda and not torch.cuda.is_current_stream_capturing():
        compile_merge(rank, out.dtype, str(device))
    if parts == 1:  # every row whole in one run: written by the decode
        return out
    if parts:  # row b's part s in run b * parts + s, slot 0: the merge of equal splits
        split = (batch, parts, 2, padded)
        mid_out = mid_out.view(*split, rank)[:, :, 0, :heads].transpose(1, 2)
        mid_lse = mid_lse.view(*split)[:, :, 0, :heads].transpose(1, 2)
        return combine_splits(mid_out, mid_lse, out)
    return merge_runs(mid_out, mid_lse, row_meta, out)


def _tma_ready(x: torch.Tensor) -> torch.Tensor:
    """`x`, or a contiguous copy where TMA cannot read it."""
    return x if tma_readable(x) else x.contiguous()
