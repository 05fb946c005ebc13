"""The Gluon MLA decode's loader partitions (`gluon_mla`): each block of
each segment of a program's run into the next free stage of the ring, by
TMA (64 tokens of a page) or, for sparse attention's selected positions,
row by row by cp.async (Hopper's TMA has no gather).
"""

from __future__ import annotations

from dserve.attention.gluon_tma import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from dserve.attention.gluon_tma import block_page, block_pages, tma_load
    from dserve.attention.mla_runs import segment

    # cp.async: `async_load` in later Tritons (3.9), the older name in 3.6
    cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

    @gluon.jit
    def tma_loader(descs, stages, bars, rows_at, run, page_size, READ: gl.constexpr):
        """Worker (one warp): each block of each segment of the run (its
        latents and rope keys) by TMA into the next free stage, its page
        read a group ahead (`block_page`). Not READ: the stage is handed
        over unread (`mla_decode`'s `read_blocks`)."""
        lat_desc, rope_desc = descs
        kv_s, rope_s, alpha_s, l_s = stages
        ready, free, p_ready, done, l_free = bars
        STAGES: gl.constexpr = kv_s.shape[0]
        BLOCK_N: gl.constexpr = kv_s.shape[2]
        nbytes: gl.constexpr = lat_desc.block_type.nbytes + rope_desc.block_type.nbytes
        first, lo0, last, hi0, alone = run
        n = 0  # blocks before this segment: the stages' count goes on
        for r in range(first, last + 1):
            start, end, blocks, table, sel_row, whole = segment(rows_at, run, r, False, BLOCK_N)
            seg = (table, start, blocks, page_size)
            pages = block_pages(seg, 0, BLOCK_N)
            ahead = pages
            for k in range(blocks):
                i = n + k
                s = i % STAGES
                page, pages, ahead = block_page(seg, k, pages, ahead, BLOCK_N)
                off = (start + k * BLOCK_N) % page_size
                mbarrier.wait(free.index(s), ((i // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                if READ:
                    mbarrier.expect(bar, nbytes)
                    tma_load(lat_desc, [page, off, 0], bar, kv_s.index(s))
                    tma_load(rope_desc, [page, off, 512], bar, rope_s.index(s))
                else:
                    mbarrier.arrive(bar)
            n += blocks

    @gluon.jit
    def gather_loader(gather, stages, bars, rows_at, run, page_size):
        """Worker (four warps) for sparse attention: each block's selected
        positions' latents and rope keys, row by row (cp.async: Hopper's
        TMA has no gather), into the next free stage. A position of -1
        reads zeros."""
        cache, s_c_page, s_c_tok = gather
        kv_s, rope_s, alpha_s, l_s = stages
        ready, free, p_ready, done, l_free = bars
        STAGES: gl.constexpr = kv_s.shape[0]
        BLOCK_N: gl.constexpr = kv_s.shape[2]
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
        first, lo0, last, hi0, alone = run
        n = 0
        for r in range(first, last + 1):
            start, end, blocks, table, sel_row, whole = segment(rows_at, run, r, True, BLOCK_N)
            for k in range(blocks):
                i = n + k
                s = i % STAGES
                idx = start + k * BLOCK_N
                idx += gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
                pos = gl.load(sel_row + idx, mask=idx < end, other=-1)
                valid = pos >= 0
                pos = gl.maximum(pos, 0)
                page = gl.load(table + pos // page_size, mask=valid, other=0).to(gl.int64)
                row = page * s_c_page + (pos % page_size) * s_c_tok
                at = cache + row[:, None] + cols[None, :]
                mbarrier.wait(free.index(s), ((i // STAGES) & 1) ^ 1)
                keys = kv_s.index(s).reshape([BLOCK_N, 512])
                for c in gl.static_range(8):
                    dst = keys.slice(c * 64, 64, dim=1)
                    cp_async(dst, at + c * 64, valid[:, None])
                ropes = rope_s.index(s).reshape([BLOCK_N, 64])
                cp_async(ropes, at + 512, valid[:, None])
                async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
            n += blocks
