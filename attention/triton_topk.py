"""The top-k of sparse attention's indexer scores on a GPU: per row the positions of the
`topk` highest finite scores (`index_cache.select_top`'s contract; that is the reference and
the CPU path), as a radix select that spreads each row over many programs.

Why: at 32k scores and k 2048, torch's top-k took 51 of a 70 us sparse decode step at batch
1 on an H100 (several kernels per 2-bit digit), and a select with one program per row 83-112
us (bench/notes/session22-h100-2026-11-24.md): one program cannot overlap its chain of loads
and block reductions. Here every pass runs many programs per row, `chunk` positions each.
Not timed on a GPU yet: `python -m bench.sparse_decode` puts it beside torch's.

How: each score becomes an int32 key whose unsigned order is the scores' (-0 and +0 one key),
read as four byte digits from the top. Five launches, each a pass over the scores. Level 1
counts the top digit (a histogram per program, added into the row's with atomics) and keeps
per chunk how many keys reach each digit. Level L (2-4) finds the row's threshold digit of
level L-1 in that histogram (where the count from the top reaches the slots left), writes
the positions above it and counts the next digit over the keys at it. Level 5 does the same
for the last digit, then writes the positions whose key equals the k-th, lowest positions
first, as many as slots are left. A chunk knows where its positions go from the counts of
the chunks before it: the result is deterministic, order included (per level, by position).
A chunk without keys in a level's group skips that pass (at level 5 most chunks do).

No host synchronisation and shapes from the scores' alone: CUDA graphs capture it. The row
histograms must be zero as a call starts; each level clears one that is no longer read (the
last one at the next call's level 2), so a caller that keeps them (`top_hist`) saves a
memset per call.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LEVELS, BINS, STATE = 4, 256, 8  # byte digits of a key; a row's state: see `_decide`


@triton.jit
def _finite(scores, pos, end):
    """The scores at `pos` (-inf from `end` on), and which are above -inf (NaN is not)."""
    x = tl.load(scores + pos, mask=pos < end, other=float("-inf"))
    return x, x > float("-inf")


@triton.jit
def _keys(scores, pos, width):
    """Keys of the scores at `pos` (unsigned order = the scores'), and which are above -inf."""
    x, finite = _finite(scores, pos, width)
    return _key_of(x), finite


@triton.jit
def _key_of(x):
    """`_keys` of scores in registers."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return key ^ -2147483648


@triton.jit
def _digit(key, LEVEL: tl.constexpr):
    """The LEVEL-th byte of the keys from the top (1-4)."""
    return (key >> (32 - 8 * LEVEL)) & 255


@triton.jit
def _in_group(key, finite, prefix, LEVEL: tl.constexpr):
    """The finite keys whose top LEVEL bytes are `prefix` (all of them at level 0)."""
    group = finite
    if LEVEL > 0:
        top = (key >> (32 - 8 * LEVEL)) & ((1 << (8 * LEVEL)) - 1)
        group = finite & (top == prefix)
    return group


@triton.jit
def _threshold(hist, left, FIRST: tl.constexpr):
    """From a histogram of 256 digits: the slots for its keys (`left`, at the first level
    at most the keys there are), the digit at which the count from the top reaches them,
    and the slots left for the keys at it once those above have theirs."""
    return _cut(tl.load(hist + tl.arange(0, 256)), left, FIRST)


@triton.jit
def _cut(h, left, FIRST: tl.constexpr):
    """`_threshold` of a histogram `h` [256] in registers."""
    bins = tl.arange(0, 256)
    total = tl.sum(h, 0)
    if FIRST:
        left = tl.minimum(total, left)
    at_least = total - tl.cumsum(h, 0) + h
    digit = tl.sum((at_least >= left).to(tl.int32), 0) - 1
    return left, digit, left - tl.sum(tl.where(bins > digit, h, 0), 0)


@triton.jit
def _decide(hist, state, c, topk, LEVEL: tl.constexpr):
    """Level LEVEL - 1's threshold digit, from its row histogram. A row's state: the slots
    it fills (min(topk, finite scores)), then per level its prefix (the top bytes of the
    k-th key) and the slots left after the keys above it; the row's first program records
    them. Returns (slots, left before, left after, digit, prefix of the group so far)."""
    level_hist = hist + (LEVEL - 2) * 256
    if LEVEL == 2:
        filled, digit, left = _threshold(level_hist, topk, True)
        left_in, prefix = filled, 0
    else:
        filled = tl.load(state)
        prefix = tl.load(state + 2 * (LEVEL - 2) - 1)
        left_in = tl.load(state + 2 * (LEVEL - 2))
        left_in, digit, left = _threshold(level_hist, left_in, False)
    if LEVEL < 5 and c == 0:
        if LEVEL == 2:
            tl.store(state, filled)
        tl.store(state + 2 * (LEVEL - 1) - 1, prefix * 256 + digit)
        tl.store(state + 2 * (LEVEL - 1), left)
    return filled, left_in, left, digit, prefix


@triton.jit
def _before(sfx, c, col):
    """The sum of column `col` (none past 255) of the counts of the chunks before c."""
    n = tl.where(col < 256, c, 0)
    total = tl.zeros([64], tl.int32)
    for c0 in range(0, n, 64):
        chunk = c0 + tl.arange(0, 64)
        total += tl.load(sfx + chunk * 256 + col, mask=chunk < n, other=0)
    return tl.sum(total, 0)


@triton.jit
def _write(out, chosen, pos, slot):
    """The positions `chosen`, in order, to slots `slot`, `slot` + 1, ...; the next slot."""
    ones = chosen.to(tl.int32)
    at = slot + tl.cumsum(ones, 0) - 1
    tl.store(out + at, pos.to(tl.int64), mask=chosen)
    return slot + tl.sum(ones, 0)


@triton.jit
def _fill_unused(out, filled, topk, c, chunks, BLOCK: tl.constexpr):
    """-1 in slots `filled` .. topk, the chunks' programs a share each."""
    share = tl.cdiv(topk, chunks)
    end = tl.minimum(c * share + share, topk)
    for start in range(tl.maximum(c * share, filled), end, BLOCK):
        slot = start + tl.arange(0, BLOCK)
        tl.store(out + slot, tl.full([BLOCK], -1, tl.int64), mask=slot < end)


@triton.jit(do_not_specialize=["s_row", "width", "chunks"])
def _level_kernel(
    Scores,
    Out,
    Hist,
    State,
    SfxIn,
    SfxOut,
    s_row,
    width,
    topk,
    chunks,
    LEVEL: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One pass of one chunk of a row; SfxIn / SfxOut: per chunk how many of the level's
    group have each digit or above, from the last level / for the next."""
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    scores, out = Scores + row * s_row, Out + row * topk
    hist, state = Hist + row * (4 * 256), State + row * 8
    sfx_in = SfxIn + row * chunks * 256
    bins = tl.arange(0, 256)
    counts = tl.zeros([256], tl.int32)
    if LEVEL == 1:
        for i in tl.static_range(0, CHUNK, BLOCK):
            pos = c * CHUNK + i + tl.arange(0, BLOCK)
            key, finite = _keys(scores, pos, width)
            counts += tl.histogram(_digit(key, 1), 256, mask=finite)
    else:
        members = tl.load(sfx_in + c * 256)  # of the level's group in the chunk
        filled, left_in, left, digit, prefix = _decide(hist, state, c, topk, LEVEL)
        above = _before(sfx_in, c, digit + 1)  # the chunks before: above it
        slot = filled - left_in + above
        if LEVEL == 5:  # and equal to the k-th key
            tied = _before(sfx_in, c, digit) - above
        if members > 0:
            for i in tl.static_range(0, CHUNK, BLOCK):
                pos = c * CHUNK + i + tl.arange(0, BLOCK)
                key, finite = _keys(scores, pos, width)
                group = _in_group(key, finite, prefix, LEVEL - 2)
                d = _digit(key, LEVEL - 1)
                slot = _write(out, group & (d > digit), pos, slot)
                at = group & (d == digit)
                if LEVEL < 5:
                    counts += tl.histogram(_digit(key, LEVEL), 256, mask=at)
                else:  # keys equal to the k-th: the lowest positions first
                    rank = tied + tl.cumsum(at.to(tl.int32), 0) - 1
                    take = at & (rank < left)
                    tl.store(out + filled - left + rank, pos.to(tl.int64), mask=take)
                    tied += tl.sum(at.to(tl.int32), 0)
        if LEVEL == 2:
            _fill_unused(out, filled, topk, c, chunks, BLOCK)
        if c == 0:  # a histogram no longer read: zero for the next call
            tl.store(hist + ((LEVEL + 1) % 4) * 256 + bins, tl.zeros([256], tl.int32))
    if LEVEL < 5:
        at_least = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
        tl.store(SfxOut + (row * chunks + c) * 256 + bins, at_least)
        level_hist = hist + (LEVEL - 1) * 256 + bins
        tl.atomic_add(level_hist, counts, mask=counts > 0, sem="relaxed")


def top_hist(rows: int, device) -> torch.Tensor:
    """Zeroed row histograms for `select_top_triton` ([rows, 4, 256] int32), which it
    zeroes again for its next call: a caller that keeps them saves a memset per call."""
    return torch.zeros(rows, LEVELS, BINS, dtype=torch.int32, device=device)


CHUNKS = (512, 1024, 2048, 4096, 8192, 16384)  # the chunk sizes `default_chunk` picks


def default_chunk(tokens: int, width: int) -> int:
    """Positions per program: about 512 programs in all (4 per SM of an H100), 512-16k positions
    (H100, batch 1 at 32k: 64 programs of 512 took 23 us, 32 of 1024 26 us)."""
    per_program = triton.next_power_of_2(triton.cdiv(tokens * width, 512))
    return min(max(per_program, CHUNKS[0]), CHUNKS[-1])


@functools.lru_cache(maxsize=None)
def compile_every_chunk(topk: int, device: str) -> None:
    """Runs the select once per chunk size `default_chunk` can pick (its only compile-time
    choice; widths, rows and chunk counts are runtime values), so no request compiles one:
    a serving engine calls this while it warms up."""
    for chunk in CHUNKS:
        select_top_triton(torch.zeros(1, chunk, device=device), topk, chunk=chunk)


def select_top_triton(
    scores: torch.Tensor,
    topk: int,
    hist: torch.Tensor | None = None,
    chunk: int | None = None,
    block: int = 1024,
    num_warps: int = 4,
) -> torch.Tensor:
    """`select_top` on the GPU: scores [T, width] float32 -> per row the positions of the
    `topk` highest finite scores (ties: the lowest positions), then -1, [T, topk] int64.
    `hist`: zeroed histograms of at least T rows (`top_hist`; fresh ones if None). `chunk`
    positions per program (a power of two; `default_chunk`), in blocks of `block`."""
    tokens, width = scores.shape
    device = scores.device
    out = torch.empty(tokens, topk, dtype=torch.int64, device=device)
    if not tokens or not width:
        return out.fill_(-1)
    assert scores.dtype == torch.float32 and scores.stride(1) == 1
    chunk = chunk or default_chunk(tokens, width)
    block, chunks = min(block, chunk), triton.cdiv(width, chunk)
    assert chunk % block == 0, "chunks of whole blocks"
    hist = top_hist(tokens, device) if hist is None else hist
    assert hist.is_contiguous() and hist.shape[0] >= tokens
    state = torch.empty(tokens, STATE, dtype=torch.int32, device=device)
    sfx = torch.empty(2, tokens, chunks, BINS, dtype=torch.int32, device=device)
    for level in range(1, LEVELS + 2):
        _level_kernel[(tokens, chunks)](
            scores,
            out,
            hist,
            state,
            sfx[(level - 1) % 2],
            sfx[level % 2],
            scores.stride(0),
            width,
            topk,
            chunks,
            LEVEL=level,
            CHUNK=chunk,
            BLOCK=block,
            num_warps=num_warps,
        )
    return out
