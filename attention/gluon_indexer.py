"""The lightning indexer's scores over FP8 keys for Hopper, in Gluon: a TMA ring of key pages.

`triton_dsa.indexer_scores` reads FP8 keys at 57-64% of the copy bandwidth
(bf16 keys at 89%): a program takes one token and one block of 64 keys,
so it reads the token's queries (8 KB, as much as the block's keys) for
every block, and nothing overlaps a block's loads with its arithmetic.
Here a program takes one token and a run of blocks, in three partitions:

- a loader warp brings each block's keys (64 x 128 bytes) and their
  float32 scales (256 bytes) by TMA into a ring of 8 stages, the blocks'
  pages read 32 at a time a group ahead;
- two warpgroups take the blocks in turn: each multiplies a block's keys
  by the queries (kept in shared memory for the whole run; the first
  warpgroup brings them while the loader brings the first blocks) on
  the tensor cores, and reduces the [64 keys x 32 heads] products to the
  block's scores with the keys' scales.

Each token's positions are split over programs by how well their rounds
fill the SMs (`launch_shapes.per_program_for`). Until session 34 the
loader read each block's page as it went and the scorers each block's
scales, each read waited for before the next step could start, with 4
stages and two programs an SM: batch 32 x 32k 0.065 ms (73% of the copy
bandwidth), now 0.057 (84%); batch 128 0.231 -> 0.205 (93%); 128 x 128k
0.985 -> 0.798 (96%). The same scores, bit for bit (H100,
bench/notes/session34-h100-2026-11-27.md).

Two kinds of queries:

- FP8 (`q_fp8`, the triton backend's with FP8 keys on Hopper: the
  production indexer's arithmetic, as DeepGEMM's `fp8_mqa_logits`): each
  head's queries are scaled to e4m3's range and rounded to e4m3 when the
  program starts, the scale moving into the head's weight; the MMA takes
  both operands straight from shared memory. Its scores are torch's over
  the same e4m3 queries (`fp8_queries`) within the MMA's own rounding
  (Hopper adds FP8 products in about 14 bits: 3-5e-4 of the largest
  score), a few percent of the largest from the 16-bit queries' (the
  selection: 98-99% the same positions at GLM-5's shapes). H100, 32
  heads, at 32k: batch 128 0.205 ms against the Triton kernel's 0.293,
  batch 32 0.056 against 0.078.
- 16-bit: the keys go into registers and widen to bfloat16 there
  (exactly: e4m3 widens without rounding). Equal to the Triton kernel's
  within float32 rounding; 0.25 ms at batch 128 against its 0.29: each
  warpgroup's chain per 8 KB block (the keys from shared memory into
  registers, a small MMA, the sum over heads, the store) is the limit
  (bench/notes/session30-h100-2026-11-26.md).

Per token t and position j below its context: sum over heads h of
w[t, h] x ReLU(q[t, h] . k[j]), times k[j]'s scale and `scale` (both
positive, so they pass the ReLU), float32; -inf from the context's end to
`width`.

Hopper only; FP8 keys in the pool's layout (`index_cache`), head dim 128,
pages a multiple of 64 tokens, bfloat16 or float16 queries, 16 to 64 heads.
`bench.sparse_decode --fp8-keys` times both kinds beside the Triton kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dserve.attention.gluon_tma import HAVE_GLUON, descriptor, tma_readable
from dserve.attention.launch_shapes import BLOCK_TOKENS, indexer_per_program
from dserve.attention.triton_dsa import scores_out

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from dserve.attention.gluon_tma import block_page, block_pages, ring, tma_load

BLOCK_N = BLOCK_TOKENS  # keys a block: one TMA box, within a page
DIM = 128  # the indexer's head dim
STAGES = 8  # blocks in flight: 8 KB each (64 KB: an SM's share of the bandwidth for ~3 us)
REGS = 128  # registers a thread of the second scoring warpgroup
_1 = tl.constexpr(1)  # its first block (a constexpr, as a worker partition takes it)


def supported(q, keys, key_scales) -> bool:
    """Whether this kernel serves these shapes on this device."""
    if not HAVE_GLUON or not q.is_cuda or key_scales is None:
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    heads = q.shape[1]
    return (
        q.dtype in (torch.bfloat16, torch.float16)
        and keys.dtype == torch.uint8
        and q.shape[-1] == DIM
        and keys.shape[-1] == DIM
        and heads in (16, 32, 64)
        and keys.shape[1] % BLOCK_N == 0
        and tma_readable(key_scales)
    )


if HAVE_GLUON:

    @gluon.jit
    def _loader(descs, stages, bars, table, span, page_size):
        """Worker (one warp): each block's keys and their scales by TMA
        into the next free stage, its page read a group ahead
        (`block_page`: one read a block, waited for before its copy
        could start, was what held the kernel back)."""
        key_desc, scale_desc = descs
        keys_s, scales_s = stages
        ready, free, _ = bars
        n0, loaded = span
        STAGES: gl.constexpr = keys_s.shape[0]
        BLOCK_N: gl.constexpr = keys_s.shape[2]
        nbytes: gl.constexpr = key_desc.block_type.nbytes + scale_desc.block_type.nbytes
        run = (table, n0, loaded, page_size)
        pages = block_pages(run, 0, BLOCK_N)
        ahead = pages
        for k in range(loaded):
            s = k % STAGES
            page, pages, ahead = block_page(run, k, pages, ahead, BLOCK_N)
            off = (n0 + k * BLOCK_N) % page_size
            mbarrier.wait(free.index(s), ((k // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma_load(key_desc, [page, off, 0], bar, keys_s.index(s))
            tma_load(scale_desc, [page, off], bar, scales_s.index(s))

    @gluon.jit
    def _scorer(
        queries,
        stages,
        bars,
        block,
        FIRST: gl.constexpr,
        STEP: gl.constexpr,
    ):
        """A warpgroup's blocks' scores: blocks FIRST, FIRST + STEP, ...
        The first warpgroup brings the queries while the loader brings
        the first blocks."""
        q_s, w_s, row = queries
        out, span, scale, end, width = block
        keys_s, scales_s = stages
        ready, free, q_ready = bars
        if FIRST == 0:
            _queries(q_s, w_s, row)
            mbarrier.arrive(q_ready)
        mbarrier.wait(q_ready, 0)
        n0, loaded = span
        STAGES: gl.constexpr = keys_s.shape[0]
        BLOCK_N: gl.constexpr = keys_s.shape[2]
        H: gl.constexpr = q_s.shape[0]
        D: gl.constexpr = q_s.shape[1]
        FP8: gl.constexpr = q_s.dtype == gl.float8e4nv
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0],
            warps_per_cta=[4, 1],
            instr_shape=[16, H, 32 if FP8 else 16],
        )
        rows: gl.constexpr = gl.SliceLayout(1, acc_layout)
        scale_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])
        w = w_s.load(gl.SliceLayout(0, acc_layout))
        zeros = gl.zeros([BLOCK_N, H], gl.float32, acc_layout)
        pos = n0 + FIRST * BLOCK_N + gl.arange(0, BLOCK_N, layout=rows)
        for k in range(FIRST, loaded, STEP):
            s = k % STAGES
            mbarrier.wait(ready.index(s), (k // STAGES) & 1)
            k_scale = gl.sum(scales_s.index(s).load(scale_layout), 0)
            k_scale = gl.convert_layout(k_scale, rows)
            keys = keys_s.index(s).reshape([BLOCK_N, D])
            acc = _block_dots(keys, q_s, zeros, acc_layout, free.index(s))
            dots = gl.sum(gl.maximum(acc, 0.0) * w[None, :], 1)
            x = gl.where(pos < end, dots * (k_scale * scale), float("-inf"))
            gl.store(out + pos, x, mask=pos < width)
            pos += STEP * BLOCK_N

    @gluon.jit
    def _block_dots(keys, q_s, zeros, acc_layout: gl.constexpr, free):
        """[keys x heads] dot products of a block, its stage `free` as
        soon as the keys are read: FP8 queries take the keys straight
        from shared memory (free after the MMA); 16-bit ones, the keys
        widened in registers (exactly: e4m3 widens without rounding;
        free once loaded)."""
        if q_s.dtype == gl.float8e4nv:
            acc = warpgroup_mma(keys, q_s.permute((1, 0)), zeros, use_acc=False, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc, keys))[0]
            mbarrier.arrive(free)
            return acc
        else:
            k_layout: gl.constexpr = gl.DotOperandLayout(
                operand_index=0, parent=acc_layout, k_width=2
            )
            wide = keys.load(k_layout).to(q_s.dtype)
            mbarrier.arrive(free)
            acc = warpgroup_mma(wide, q_s.permute((1, 0)), zeros, use_acc=False, is_async=True)
            return warpgroup_mma_wait(0, deps=(acc,))

    @gluon.jit
    def _queries(q_s, w_s, row):
        """A token's queries into shared memory (`q_s`), for the MMA, and
        its head weights beside them (`w_s`). FP8: each head's queries
        divided by a scale (its largest magnitude over 448, e4m3's
        largest) and rounded to e4m3; the scale moves into the head's
        weight (positive: it passes the ReLU)."""
        q_row, s_q_h, w_row = row
        H: gl.constexpr = q_s.shape[0]
        D: gl.constexpr = q_s.shape[1]
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
        hs = gl.arange(0, H, layout=gl.SliceLayout(1, layout))
        ds = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        x = gl.load(q_row + hs[:, None] * s_q_h + ds[None, :])
        w = gl.load(w_row + hs)
        if q_s.dtype == gl.float8e4nv:
            # rounded divisions and conversions, as torch's (`fp8_queries`)
            wide = x.to(gl.float32)
            most = gl.maximum(gl.max(gl.abs(wide), 1), 1e-30)
            w = w * gl.div_rn(most, gl.full_like(most, 448.0))
            inverse = gl.div_rn(gl.full_like(most, 448.0), most)
            half = (wide * inverse[:, None]).to(gl.float16)
            q_s.store(half.to(gl.float8e4nv))
        else:
            q_s.store(x)
        w_s.store(w)
        fence_async_shared()

    # the pass's longest context and the page table's width vary step by step: one variant
    # (Triton specializes an int on == 1 and on divisibility by 16), or a step compiles
    @gluon.jit(do_not_specialize=["s_pt_b", "width"])
    def _scores_kernel(
        q,
        weights,
        key_desc,
        scale_desc,
        page_table,
        row_seqs,
        ctx_lens,
        out,
        s_q_t,
        s_q_h,
        s_w_t,
        s_pt_b,
        s_o_t,
        scale,
        page_size,
        width,
        per_program,
        H: gl.constexpr,
        STAGES: gl.constexpr,
        REGS: gl.constexpr,
        Q_FP8: gl.constexpr,
    ):
        t, part = gl.program_id(0), gl.program_id(1)
        t64 = t.to(gl.int64)
        BLOCK_N: gl.constexpr = key_desc.block_type.shape[1]
        D: gl.constexpr = key_desc.block_type.shape[2]
        end = gl.load(ctx_lens + t).to(gl.int32)  # the engine's are int64
        n0 = part * per_program
        n1 = gl.minimum(n0 + per_program, width)
        loaded = gl.cdiv(gl.maximum(gl.minimum(n1, end) - n0, 0), BLOCK_N)
        table = page_table + gl.load(row_seqs + t).to(gl.int64) * s_pt_b
        row_out = out + t64 * s_o_t
        # past the context: -inf, nothing read
        tail_layout: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
        for p0 in range(n0 + loaded * BLOCK_N, n1, 512):
            pos = p0 + gl.arange(0, 512, layout=tail_layout)
            minus = gl.full([512], float("-inf"), gl.float32, tail_layout)
            gl.store(row_out + pos, minus, mask=pos < n1)
        q_type: gl.constexpr = gl.float8e4nv if Q_FP8 else q.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, D], q_type)
        q_s = gl.allocate_shared_memory(q_type, [H, D], q_layout)
        w_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        w_s = gl.allocate_shared_memory(gl.float32, [H], w_layout)
        row = (q + t64 * s_q_t, s_q_h, weights + t64 * s_w_t)
        keys_s = ring(key_desc, STAGES)
        scales_s = ring(scale_desc, STAGES)
        bar: gl.constexpr = mbarrier.MBarrierLayout()
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(free.index(i), count=1)
        mbarrier.init(q_ready, count=1)
        fence_async_shared()
        bars = (ready, free, q_ready)
        span = (n0, loaded)
        block = (row_out, span, scale, end, width)
        stages = (keys_s, scales_s)
        load = ((key_desc, scale_desc), stages, bars, table, span, page_size)
        gl.warp_specialize(
            [
                (_scorer, ((q_s, w_s, row), stages, bars, block, 0, 2)),
                (_scorer, ((q_s, w_s, row), stages, bars, block, _1, 2)),
                (_loader, load),
            ],
            [4, 1],
            [REGS, 40],
        )


def fp8_queries(q: torch.Tensor, weights: torch.Tensor):
    """(queries in e4m3 as float32, weights times their scales): what the
    kernel computes with `q_fp8` (each head's scale its largest magnitude
    over 448), in torch. Both round to e4m3 through float16: Triton's
    direct conversion differs from torch's in rare ties (GPU-checked)."""
    most = q.float().abs().amax(-1).clamp(min=1e-30)
    scaled = q.float() * (448.0 / most)[..., None]
    q8 = scaled.to(torch.float16).to(torch.float8_e4m3fn)
    return q8.float(), weights * (most / 448.0)


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    page_table: torch.Tensor,
    row_seqs: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    width: int,
    key_scales: torch.Tensor,
    per_program: int | None = None,
    q_fp8: bool = False,
) -> torch.Tensor:
    """`triton_dsa.indexer_scores`' contract for FP8 keys (`supported`):
    q [T, H, 128], weights [T, H] float32, `keys` [num_pages, page_size,
    128] uint8, `key_scales` [num_pages, page_size] float32 -> scores
    [T, width] float32."""
    tokens, heads, dim = q.shape
    out = scores_out(tokens, width, q.device)
    if not tokens or not width:
        return out
    assert q.stride(-1) == 1 and weights.stride(-1) == 1 and keys.stride(-1) == 1
    per = per_program or indexer_per_program(tokens, width, q.device)
    assert per % BLOCK_N == 0, "a program's run is whole blocks"
    keys = keys.view(torch.float8_e4m3fn)
    key_desc = descriptor(keys, [1, BLOCK_N, DIM], gl.float8e4nv)
    # a page's row of scales is 16-byte aligned, as the pool lays it out
    scale_desc = descriptor(key_scales, [1, BLOCK_N], gl.float32)
    grid = (tokens, triton.cdiv(width, per))
    _scores_kernel[grid](
        q,
        weights,
        key_desc,
        scale_desc,
        page_table,
        row_seqs,
        ctx_lens,
        out,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        page_table.stride(0),
        out.stride(0),
        scale,
        keys.shape[1],
        width,
        per,
        heads,
        STAGES,
        REGS,
        q_fp8,
        num_warps=4,
        maxnreg=REGS,
    )
    return out
