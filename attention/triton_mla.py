"""Triton MLA decode over the paged latent cache: absorbed form, split-KV for long contexts.

One query token per sequence (decode). Every head of a sequence reads the same latent cache
entries (c_kv | k_rope, R + P wide), so a program takes a block of heads of one sequence and one
split of its context: it walks the split's tokens through the page table, keeps an online softmax
per head and accumulates the attention-weighted latents. A second kernel merges the splits by
their log-sum-exp. Checked against the torch reference backend (`tests/attention`), under
`TRITON_INTERPRET=1` on the CPU at small shapes.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dserve.attention.dependent_launch import dependent_launch, follow


@triton.jit(
    do_not_specialize=[
        "s_pt_b",
        "s_ml_b",
        "s_ml_h",
        "min_split",
        "num_splits",
    ]
)
def _split_kernel(
    QL,
    QR,
    Cache,
    HalfBlocks,
    RopeBlocks,
    PageTable,
    RowSeqs,
    SeqLens,
    Selected,
    MidO,
    MidLse,
    s_sel_b,
    sel_width,
    s_ql_b,
    s_ql_h,
    s_qr_b,
    s_qr_h,
    s_c_page,
    s_c_tok,
    s_pt_b,
    s_mo_b,
    s_mo_h,
    s_mo_s,
    s_ml_b,
    s_ml_h,
    num_heads,
    scale,
    page_size,
    min_split,
    num_splits,
    R: tl.constexpr,
    P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    REST: tl.constexpr,
    IEEE: tl.constexpr,
    TMA: tl.constexpr,
    SELECT: tl.constexpr,
    BOTH: tl.constexpr,
    REST_ACC: tl.constexpr,
):
    b, split = tl.program_id(0), tl.program_id(2)
    # a program owns BLOCK_V of the R value columns: the scores need all R (+ P) columns, the
    # accumulator only its own, which keeps it in registers when R is wide. BOTH: a program
    # owns both halves (BLOCK_V = R / 2), in two accumulators that share the scores
    blocks: tl.constexpr = 1 if BOTH else R // BLOCK_V
    hb, vb = tl.program_id(1) // blocks, tl.program_id(1) % blocks
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    sel_row = Selected + b.to(tl.int64) * s_sel_b
    if SELECT:  # the row's selection, -1 where it has no position
        seq_len = sel_width
    else:
        seq_len = tl.load(SeqLens + b)
    # a short context takes fewer splits than the launch has (no split under min_split tokens): the
    # split count is fixed at launch (a CUDA graph keeps it) while contexts vary from step to step
    per_split = tl.cdiv(tl.maximum(tl.cdiv(seq_len, num_splits), min_split), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    hmask = heads < tl.where(start < end, num_heads, 0)  # an empty split reads nothing
    own = vb * BLOCK_V + tl.arange(0, BLOCK_V)  # this program's value columns, then the other half
    rest, p = (1 - vb) * BLOCK_V + tl.arange(0, REST), tl.arange(0, P)
    q_own = tl.load(
        QL + b * s_ql_b + heads[:, None] * s_ql_h + own[None, :], mask=hmask[:, None], other=0.0
    )
    q_rest = tl.load(
        QL + b * s_ql_b + heads[:, None] * s_ql_h + rest[None, :],
        mask=hmask[:, None] & (BLOCK_V < R),
        other=0.0,
    )
    qr = tl.load(
        QR + b * s_qr_b + heads[:, None] * s_qr_h + p[None, :], mask=hmask[:, None], other=0.0
    )
    table = PageTable + tl.load(RowSeqs + b).to(tl.int64) * s_pt_b
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    acc_rest = tl.zeros([BLOCK_H, REST_ACC], tl.float32)
    # whole blocks (one page each) through Hopper's tensor memory accelerator; the tail below
    if TMA:
        whole_end = start + (end - start) // BLOCK_N * BLOCK_N
        for n0 in range(start, whole_end, BLOCK_N):
            page, off = tl.load(table + n0 // page_size).to(tl.int32), (n0 % page_size).to(tl.int32)
            c_own = HalfBlocks.load([page, off, vb * BLOCK_V]).reshape(BLOCK_N, BLOCK_V)
            c_rest = HalfBlocks.load([page, off, (1 - vb) * BLOCK_V]).reshape(BLOCK_N, BLOCK_V)
            kr = RopeBlocks.load([page, off, R]).reshape(BLOCK_N, P)
            s = _dot(q_own, tl.trans(c_own), IEEE) + _dot(q_rest, tl.trans(c_rest), IEEE)
            s += _dot(qr, tl.trans(kr), IEEE)
            whole = n0 + tl.arange(0, BLOCK_N) < end
            m, l, acc, acc_rest = _softmax_step(
                s * scale, whole[None, :], c_own, c_rest, m, l, acc, acc_rest, BOTH, IEEE
            )
        start = whole_end
    for n0 in range(start, end, BLOCK_N):
        if SELECT:  # sparse attention: the row's selected positions, not its whole context
            toks, tmask, page, off = _selected_block(table, sel_row, n0, end, page_size, BLOCK_N)
        else:
            toks, tmask, page, off = _context_block(table, n0, end, page_size, BLOCK_N)
        base = page * s_c_page + off * s_c_tok
        c_own = tl.load(Cache + base[:, None] + own[None, :], mask=tmask[:, None], other=0.0)
        kr = tl.load(Cache + base[:, None] + R + p[None, :], mask=tmask[:, None], other=0.0)
        s = _dot(q_own, tl.trans(c_own), IEEE) + _dot(qr, tl.trans(kr), IEEE)
        c_rest = c_own  # unused unless BLOCK_V < R
        if BLOCK_V < R:
            c_rest = tl.load(Cache + base[:, None] + rest[None, :], mask=tmask[:, None], other=0.0)
            s += _dot(q_rest, tl.trans(c_rest), IEEE)
        m, l, acc, acc_rest = _softmax_step(
            s * scale, tmask[None, :], c_own, c_rest, m, l, acc, acc_rest, BOTH, IEEE
        )
    # every value block writes the same log-sum-exp
    out_at, lse_at = MidO + b * s_mo_b + split * s_mo_s, MidLse + b * s_ml_b + split
    written = heads < num_heads
    _store_split(out_at, lse_at, heads, own, written, s_mo_h, s_ml_h, m, l, acc)
    if BOTH:
        _store_split(out_at, lse_at, heads, rest, written, s_mo_h, s_ml_h, m, l, acc_rest)


@triton.jit
def _context_block(table, n0, end, page_size, BLOCK_N: tl.constexpr):
    """Context positions n0 .. n0 + BLOCK_N (valid below `end`), their pages from the sequence's
    page-table row `table` (int64) and their offsets in them."""
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < end
    page = tl.load(table + pos // page_size, mask=valid, other=0).to(tl.int64)
    return pos, valid, page, pos % page_size


@triton.jit
def _selected_block(table, sel_row, n0, end, page_size, BLOCK_N: tl.constexpr):
    """`_context_block` for entries n0 .. n0 + BLOCK_N (below `end`, not -1) of a row's selected
    context positions `sel_row`."""
    idx = n0 + tl.arange(0, BLOCK_N)
    pos = tl.load(sel_row + idx, mask=idx < end, other=-1)
    valid = pos >= 0
    pos = tl.maximum(pos, 0)
    page = tl.load(table + pos // page_size, mask=valid, other=0).to(tl.int64)
    return pos, valid, page, pos % page_size


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b; float32 inputs exactly (not TF32: the parity tests run in float32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _softmax_step(
    s, visible, values, rest, m, l, acc, acc_rest, BOTH: tl.constexpr, IEEE: tl.constexpr
):
    """`_online_softmax_step` over `values`, and with BOTH the same weights over the other
    half of the value columns, `rest`, into `acc_rest`."""
    m, l, alpha, probs = _softmax_weights(s, visible, m, l)
    acc = acc * alpha[:, None] + _dot(probs.to(values.dtype), values, IEEE)
    if BOTH:
        acc_rest = acc_rest * alpha[:, None] + _dot(probs.to(rest.dtype), rest, IEEE)
    return m, l, acc, acc_rest


@triton.jit
def _softmax_weights(s, visible, m, l):
    """One block of scores s [rows, BLOCK_N] (masked where `visible`, broadcast to s, is false)
    into the running max m and sum l of the rows: (new m, new l, the factor that rescales what
    was accumulated, the block's weights). A row that has seen nothing yet (m = -inf) stays at
    zero instead of NaN."""
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    probs = tl.exp(s - m_safe[:, None])
    return m_new, l * alpha + tl.sum(probs, 1), alpha, probs


@triton.jit
def _online_softmax_step(s, visible, values, m, l, acc, IEEE: tl.constexpr):
    """One block of scores s [rows, BLOCK_N] (masked where `visible`) into the running max m,
    sum l and weighted values acc of the rows (`_softmax_weights`)."""
    m, l, alpha, probs = _softmax_weights(s, visible, m, l)
    acc = acc * alpha[:, None] + _dot(probs.to(values.dtype), values, IEEE)
    return m, l, acc


@triton.jit
def _store_split(MidO, MidLse, heads, cols, written, s_mo_h, s_ml_h, m, l, acc):
    """A split's normalised output and log-sum-exp per head (-inf where it saw no token)."""
    filled = l > 0
    out = acc / tl.where(filled, l, 1.0)[:, None]
    lse = tl.where(filled, m + tl.log(tl.where(filled, l, 1.0)), float("-inf"))
    tl.store(MidO + heads[:, None] * s_mo_h + cols[None, :], out, mask=written[:, None])
    tl.store(MidLse + heads * s_ml_h, lse, mask=written)


@triton.jit(do_not_specialize=["s_ml_b", "s_ml_h", "s_ml_s"])
def _combine_kernel(
    MidO,
    MidLse,
    Out,
    s_mo_b,
    s_mo_h,
    s_mo_s,
    s_ml_b,
    s_ml_h,
    s_ml_s,
    s_o_b,
    s_o_h,
    R: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Out = the splits' outputs weighted by softmax(lse); the [splits, R] partial outputs are read
    CHUNK splits at a time, so many splits do not spill registers. NUM_SPLITS stays a
    compile-time value (an unrolled loop overlaps the chunks' loads: batch 1 at 32k took 32
    against 38 us with a runtime count, H200), so `compile_every_split_count` compiles each.
    The log-sum-exps' strides are not specialized: `gluon_mla`'s partials (a split's one run
    slot apart) take the variant this module's contiguous ones compile."""
    b, h = tl.program_id(0), tl.program_id(1)
    follow(PDL)  # a dependent launch: the splits' kernel may still be running
    r = tl.arange(0, R)
    lse_row = MidLse + b * s_ml_b + h * s_ml_h
    lse = tl.load(lse_row + tl.arange(0, NUM_SPLITS) * s_ml_s)
    top = tl.max(lse, 0)
    # empty splits (-inf) weigh nothing; a row no split saw a position of
    # (a sparse row selecting none) is zeros, as one split writes it
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(lse - top), 0)
    total = tl.where(total == 0.0, 1.0, total)
    out = tl.zeros([R], tl.float32)
    for c in tl.static_range(0, NUM_SPLITS, CHUNK):
        splits = c + tl.arange(0, CHUNK)
        weights = tl.exp(tl.load(lse_row + splits * s_ml_s) - top) / total
        parts = tl.load(MidO + b * s_mo_b + h * s_mo_h + splits[:, None] * s_mo_s + r[None, :])
        out += tl.sum(parts * weights[:, None], 0)
    tl.store(Out + b * s_o_b + h * s_o_h + r, out.to(Out.dtype.element_ty))


def default_splits(
    batch: int,
    heads: int,
    max_len: int,
    block_n: int,
    device: torch.device,
    block_h: int = 16,
    value_blocks: int = 1,
    gathered: bool = False,
) -> int:
    """Enough programs to fill the GPU, no split shorter than four blocks, at most 256; a power of
    two. Programs of few heads are memory-bound and fill it twice over; programs of many heads
    (128 heads on one rank) are bound by their tensor-core work, and every split more costs its
    share of the merge: they fill it once. (H100, 16 heads, batch 1, 32k context: 256 splits read at
    32% of the copy bandwidth, 64 splits at 23%: bench/notes/flashinfer-2026-11-23.md; 128 heads,
    1k context: 1 split at batch 128 takes 0.22 ms a layer where 4 took 0.35, 2 splits at batch 32
    0.07 ms where 16 took 0.12: bench/notes/rank-steps-2026-11-23.md.) Sparse attention's
    `gathered` positions allow splits of two blocks: batch 1 over 2048 positions took 20 us in
    32 splits where 16 took 24-31 (H100, bench/notes/session22-h100-2026-11-24.md); programs of
    many heads over gathered positions fill the GPU at most once, the power of two below (64
    heads, batch 32 over 2048 positions: 4 splits 115 us, 8 splits 132, 16 splits 162;
    bench/notes/session23-h100-2026-11-24.md)."""
    sms = 8
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    waves = 2 if block_h <= 16 else 1
    programs = batch * triton.cdiv(heads, block_h) * value_blocks
    shortest = (2 if gathered else 4) * block_n  # gathered positions: latency-bound
    want = max(1, min(256, -(-waves * sms // programs), max_len // shortest))
    if gathered and waves == 1:
        return 1 << (want.bit_length() - 1)
    return 1 << (want - 1).bit_length()


FEW_ROWS = 8  # fewer query rows than this fill the GPU only with twice the programs


def default_tune(
    heads: int,
    rank: int,
    page_size: int,
    device: torch.device,
    sparse: bool = False,
    rows: int = FEW_ROWS,
) -> dict:
    """Launch parameters by heads per rank, from `bench.mla_decode` and `bench.sparse_decode`
    sweeps on an H100 (bench/notes/mla-decode-2026-11-23.md, session27-h100-2026-11-26.md).
    Up to 16 heads (DeepSeek-V3 at attention TP 8) the kernel is memory-bound: one program
    takes every head and all value columns, so the cache is read once. With more heads each
    latent token feeds more FLOPs than the tensor cores keep up with at this structure. On
    Hopper, from `FEW_ROWS` query `rows` up, a program takes 64 heads and both halves of the
    value columns (two accumulators sharing the scores) over blocks of 64 tokens, loaded by
    TMA where they are whole pages of 64 (not for `sparse` attention's gathered positions).
    128 heads, batch 32 / 128 at 8k: 0.322 / 1.216 ms, where 128 heads and half the columns
    a program took 0.363 / 1.347; sparse, 64 heads over 2048 positions: 0.089 / 0.287 ms,
    where all columns in one accumulator took 0.118 / 0.394. Fewer rows fill the GPU with
    more programs: up to 128 heads and half the value columns a program (batch 1 at 1k: 25
    against 29 us)."""
    if heads <= 16:
        return {"block_h": 16, "num_warps": 4, "block_n": 32}
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    halves = rank // 2 <= 256
    if hopper and halves and rows >= FEW_ROWS and (sparse or page_size % 64 == 0):
        both = {"both_halves": True, "block_h": 64, "num_warps": 8, "block_n": 64}
        return {"tma": not sparse, **both}
    if hopper and page_size % 32 == 0 and halves:
        return {
            "tma": True,
            "block_h": min(128, triton.next_power_of_2(heads)),
            "num_warps": 8,
            "block_n": 32,
        }
    return {"block_h": 64, "num_warps": 8, "block_n": 32}


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor | None,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    max_len: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    row_seqs: torch.Tensor | None = None,
    min_split: int | None = None,
    block_v: int | None = None,
    tma: bool | None = None,
    selected: torch.Tensor | None = None,
    both_halves: bool | None = None,
) -> torch.Tensor:
    """q_latent [B, H, R], q_rope [B, H, P] (one query row per decode token); `cache` one layer's
    latent pages [num_pages, page_size, R + P] (any page stride); `seq_lens` [B] tokens in KV each row
    sees (the new one's latent already stored); `page_table` [S, max_pages], row `row_seqs[b]` for
    query row b (by default row b: one row per sequence). Returns the attention-weighted latents
    [B, H, R]. R and P must be powers of two, `num_splits` too (by default from the batch and `max_len`,
    the longest context, so no host sync is needed); a row uses fewer splits where its context is
    short (none under `min_split` tokens, by default 2 * block_n). A program accumulates `block_v` of
    the R value columns (by default all). `tma` reads whole blocks through tensor descriptors
    (Hopper's TMA; half the value columns per program unless `both_halves`, blocks within a
    page). Parameters left None come from `default_tune`. Sparse attention: `selected` [B, K]
    lists each row's context positions to attend (-1 for none, anywhere in the row) and
    `seq_lens` is not read (None). `both_halves`: a program accumulates both halves of the value
    columns (block_v R / 2) in two accumulators that share one computation of the scores
    (FlashMLA's split: 64 heads a program)."""
    batch, heads, rank = q_latent.shape
    sparse = selected is not None
    tune = default_tune(heads, rank, cache.shape[1], q_latent.device, sparse, batch)
    block_n, block_h, num_warps = (
        block_n or tune["block_n"],
        block_h or tune["block_h"],
        num_warps or tune["num_warps"],
    )
    tma = tune.get("tma", False) if tma is None else tma
    # selected positions are gathered, not whole blocks: a few rows of many heads still take
    # half the value columns a program, for twice the programs (H100, 64 heads: batch 1 took
    # 20-25 us with half the columns, 20-31 with all; batch 32 and 128 were faster with all)
    few_rows = tma and batch < FEW_ROWS
    tma = tma and selected is None
    both = tune.get("both_halves", False) if both_halves is None else both_halves
    block_v = block_v or (rank // 2 if tma or few_rows or both else rank)
    assert block_v == rank // 2 or not both, "both halves: block_v is half the columns"
    value_blocks = 1 if both else rank // block_v
    if num_splits is None:
        longest, device = max_len or 1 << 16, q_latent.device
        num_splits = default_splits(
            batch, heads, longest, block_n, device, block_h, value_blocks, selected is not None
        )
    if row_seqs is None:
        row_seqs = torch.arange(batch, device=q_latent.device)
    rope = q_rope.shape[-1]
    assert (
        cache.shape[-1] == rank + rope and cache.stride(-1) == 1 and cache.stride(1) == rank + rope
    )
    assert q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1 and page_table.stride(-1) == 1
    mid_out = torch.empty(
        batch, heads, num_splits, rank, dtype=torch.float32, device=q_latent.device
    )
    mid_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q_latent.device)
    assert block_v in (rank, rank // 2), "a program accumulates all value columns or half of them"
    halves = ropes = None
    if tma:
        assert block_v == rank // 2 and cache.shape[1] % block_n == 0, (
            "TMA blocks: half the columns, within a page"
        )
        from triton.tools.tensor_descriptor import TensorDescriptor

        shape, strides = list(cache.shape), list(cache.stride())
        halves = TensorDescriptor(cache, shape, strides, [1, block_n, block_v])
        ropes = TensorDescriptor(cache, shape, strides, [1, block_n, rope])
    _split_kernel[(batch, triton.cdiv(heads, block_h) * value_blocks, num_splits)](
        q_latent,
        q_rope,
        cache,
        halves,
        ropes,
        page_table,
        row_seqs,
        selected if seq_lens is None else seq_lens,
        selected if selected is not None else seq_lens,
        mid_out,
        mid_lse,
        selected.stride(0) if selected is not None else 0,
        selected.shape[1] if selected is not None else 0,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        cache.stride(0),
        cache.stride(1),
        page_table.stride(0),
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        heads,
        scale,
        cache.shape[1],
        2 * block_n if min_split is None else min_split,
        R=rank,
        P=rope,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_V=block_v,
        REST=max(rank - block_v, 1),
        num_splits=num_splits,
        IEEE=q_latent.dtype == torch.float32,
        TMA=tma,
        SELECT=selected is not None,
        BOTH=both,
        REST_ACC=rank - block_v if both else 1,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return combine_splits(mid_out, mid_lse, torch.empty_like(q_latent))


SPLIT_COUNTS = tuple(2**k for k in range(9))  # 1 .. 256: what `default_splits` picks


def combine_splits(mid_out: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [B, H, R] = the splits' partial outputs mid_out [B, H, S, R] weighted by the
    softmax of their log-sum-exps mid_lse [B, H, S]. A compiled variant per split count S:
    outside a CUDA graph's capture the first call compiles all of `SPLIT_COUNTS`."""
    batch, heads, num_splits, rank = mid_out.shape
    if out.is_cuda and not torch.cuda.is_current_stream_capturing():
        compile_every_split_count(heads, rank, out.dtype, str(out.device))
    _launch_combine(mid_out, mid_lse, out)
    return out


@functools.lru_cache(maxsize=None)
def compile_every_split_count(heads: int, rank: int, dtype, device: str) -> None:
    """Runs the combine once per split count a decode can pick, so that a context that first
    needs another count compiles nothing mid-request."""
    for n in SPLIT_COUNTS:
        mid_out = torch.zeros(1, heads, n, rank, device=device)
        mid_lse = torch.zeros(1, heads, n, device=device)
        _launch_combine(mid_out, mid_lse, torch.empty(1, heads, rank, dtype=dtype, device=device))


def _launch_combine(mid_out, mid_lse, out) -> None:
    batch, heads, num_splits, rank = mid_out.shape
    _combine_kernel[(batch, heads)](
        mid_out,
        mid_lse,
        out,
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        mid_lse.stride(2),
        out.stride(0),
        out.stride(1),
        R=rank,
        NUM_SPLITS=num_splits,
        CHUNK=min(num_splits, 16),
        **dependent_launch(out.device),
    )
