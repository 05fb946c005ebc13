"""The top-k of sparse attention's indexer scores on a GPU: per row the positions of the
`topk` highest finite scores (`index_cache.select_top`'s contract; that is the reference and
the CPU path), each row spread over many programs, in three launches.

Why: torch's top-k took 51 of a 70 us sparse decode step at batch 1 on an H100, and more
programs a row are what hides the latency of a pass over the scores. Against the selects it
replaced (H100, k 2048, the Gluon indexer's scores; bench/notes/session32-h100-2026-11-27.md):
at 1 / 32 / 128 rows of 32k, 19 / 31 / 62 us where a byte-digit radix select over many
programs (five launches) took 23 / 47 / 186 and one program a row 65-66; at 128k, 26 / 64 /
185 against 29 / 181 / 981 and 207-247; torch's 51-106 and 62-304.

How, per row (`chunk` positions a program in the first two launches):
- count: every program takes the row's bins from the same sample (`_range`: the lowest and
  highest finite scores of `SAMPLE` positions spread over the row span 256 linear bins,
  monotone in the score, those outside in the end bins, +inf in the last; so the select is
  exact whatever the sample), counts its chunk's scores in them, keeps its counts from each
  bin up (for the programs after it) and adds them into the row's histogram; chunk 0's
  program keeps the row's bins for the two launches after;
- split: every program finds the bin of the k-th score in the row's histogram and writes its
  chunk's positions above it and lists those in it (the candidates, up to `CAP` a row), each
  from where the chunks before it end (one scan a block ranks both): position order;
- finish, one program a row: the k-th of the candidates' keys (int32 whose unsigned order is
  the scores'): up to `SMALL_TILE` candidates read once into registers and sorted, more a
  byte digit at a time (more than `CAP` read from the whole row); those above it written,
  then those equal to it, lowest positions first, as many as slots are left; -1 past the
  finite scores; the row's histogram zeroed for the next call.

The output is the same on every run, order included. No host synchronisation and shapes
from the scores alone: CUDA graphs capture it. Triton's `tl.histogram` costs about 80
instructions per 32 values at 256 bins: the byte digits count candidates only.
Tried (bench/notes/session38-h100-2026-11-27.md): the three launches as one (rows waiting
for their chunks' counts): exact, no faster (with dependent launch the launches' gaps
already overlap).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dserve.attention.dependent_launch import dependent_launch, follow

# launch constants (module-wide, read at each launch: a test may set smaller ones)
SAMPLE = 512  # positions each program's bins come from
CAP = 4096  # candidates a row lists (more: read from the whole row)
# up to this many candidates (the usual count: a 256th of a row's span of scores holds a few
# hundred of 32k-128k) are read once into registers and sorted (a power of two)
SMALL_TILE = 512
# the same under the CPU's interpreter, which runs the sort's network an op at a time (a
# 512-wide sort made the CPU tests 4x slower); both paths still run there
INTERPRETED_SMALL_TILE = 64


@triton.jit
def _finite(scores, pos, end):
    """The scores at `pos` (-inf from `end` on), and which are above -inf (NaN is not)."""
    x = tl.load(scores + pos, mask=pos < end, other=float("-inf"))
    return x, x > float("-inf")


@triton.jit
def _key_of(x):
    """Keys of scores (int32 whose unsigned order is the scores'; -0 and +0 one key)."""
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
def _cut(h, left, FIRST: tl.constexpr):
    """From a histogram `h` [256] (of bins or byte digits): the slots for its keys (`left`;
    FIRST: at most the keys there are), the bin at which the count from the top reaches
    them, and the slots left for the keys in that bin once those above it have theirs."""
    bins = tl.arange(0, 256)
    total = tl.sum(h, 0)
    if FIRST:
        left = tl.minimum(total, left)
    at_least = total - tl.cumsum(h, 0) + h
    digit = tl.sum((at_least >= left).to(tl.int32), 0) - 1
    return left, digit, left - tl.sum(tl.where(bins > digit, h, 0), 0)


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
def _bin(x, finite, low, per):
    """The scores' linear bins (0-255) from `low` (`per` = 255 / (highest - low), 0 when
    that is no width): monotone in the score, +inf in the last."""
    v = tl.where(finite & (x < float("inf")), x, low)
    b = tl.minimum(tl.maximum((v - low) * per, 0.0), 255.0).to(tl.int32)
    return tl.where(x == float("inf"), 255, b)


@triton.jit
def _range(scores, end, TILE: tl.constexpr):
    """The row's bins: the lowest finite score of TILE positions spread over
    the row (all of a row that short) and `_bin`'s `per` to their highest.
    Scores outside it fall in the first or last bin: the bins stay monotone,
    so the select stays exact whatever the sample; it only holds fewer
    candidates, the closer the sample's range is to the row's."""
    i = tl.arange(0, TILE)
    x, finite = _finite(scores, (i.to(tl.int64) * end // TILE).to(tl.int32), end)
    finite &= x < float("inf")
    low = tl.min(tl.where(finite, x, float("inf")), 0)
    high = tl.max(tl.where(finite, x, float("-inf")), 0)
    per = tl.where(high > low, 255.0 / (high - low), 0.0)
    return tl.where(low < float("inf"), low, 0.0), per


@triton.jit
def _count(scores, first, span, low, per, TILE: tl.constexpr):
    """The histogram [256] of positions start..stop's scores over the bins;
    `first`: the first tile's (`_finite` to stop), loaded ahead by the caller,
    each next tile's load issued before this one is counted."""
    start, stop = span
    tile = tl.arange(0, TILE)
    hist = tl.zeros([256], tl.int32)
    x, finite = first
    for t0 in range(start, stop, TILE):
        ahead = _finite(scores, t0 + TILE + tile, stop)
        hist += tl.histogram(_bin(x, finite, low, per), 256, mask=finite)
        x, finite = ahead
    return hist


@triton.jit
def _split(
    scores, out, spill, first, span, bins, at, slot, count, TILE: tl.constexpr, CAP: tl.constexpr
):
    """Positions start..stop in bins above `at` to `out` from `slot` on (position order),
    those in bin `at` (the candidates) to `spill` from `count` on while CAP hold them;
    returns the next of each. One scan a tile ranks both: their counts in the low and high
    16 bits (a tile is under 65536 wide). `first` as `_count`'s."""
    start, stop = span
    low, per = bins
    tile = tl.arange(0, TILE)
    x, finite = first
    for t0 in range(start, stop, TILE):
        pos = t0 + tile
        ahead = _finite(scores, pos + TILE, stop)
        b = _bin(x, finite, low, per)
        above, member = finite & (b > at), finite & (b == at)
        both = above.to(tl.int32) + (member.to(tl.int32) << 16)
        ranks = tl.cumsum(both, 0) - both  # of the tile's earlier ones
        rank = slot + (ranks & 0xFFFF)
        tl.store(out + rank, pos.to(tl.int64), mask=above)
        rank = count + (ranks >> 16)
        tl.store(spill + rank, pos, mask=member & (rank < CAP))
        total = tl.sum(both, 0)
        slot += total & 0xFFFF
        count += total >> 16
        x, finite = ahead
    return slot, count


@triton.jit
def _candidates(scores, spill, i0, kept, TILE: tl.constexpr):
    """Tile i0 of the candidates: from `spill` where `listed`, else of the whole row (its
    members those in bin `at`). Returns their keys, positions, membership."""
    at, low, per, end, listed, n = kept
    i = i0 + tl.arange(0, TILE)
    pos = tl.load(spill + i, mask=i < tl.where(listed, n, 0), other=0)
    pos = tl.where(listed, pos, i)
    x, finite = _finite(scores, pos, end)
    member = finite & (_bin(x, finite, low, per) == at) & (i < n)
    return _key_of(x), pos, member


@triton.jit
def _kth_of_tile(key, member, left):
    """The k-th key's (`left`-th from the top) among the members of one
    tile, by a bitonic sort of their keys (`tl.sort`; 2.0-2.3 us less a
    call than four levels of byte digits, H100, session 38): (the key, the
    slots left for the keys equal to it)."""
    low: tl.constexpr = -2147483648  # signed order of keys, non-members last
    signed = tl.where(member, key ^ low, low)
    ordered = tl.sort(signed, descending=True)
    i = tl.arange(0, ordered.shape[0])
    kth = tl.max(tl.where(i == left - 1, ordered, low), 0)
    above = tl.sum((member & (signed > kth)).to(tl.int32), 0)
    return kth ^ low, left - above


@triton.jit
def _take(out, key, pos, member, kth, filled, left, slot, tied):
    """The members above the k-th key `kth` to slots from `slot`; those
    equal to it to the last `left` slots before `filled`, lowest positions
    first (`tied` of them already seen). Returns (slot, tied) after them."""
    signed, kth = key ^ -2147483648, kth ^ -2147483648  # unsigned order as int32's
    slot = _write(out, member & (signed > kth), pos, slot)
    tie = member & (signed == kth)
    rank = tied + tl.cumsum(tie.to(tl.int32), 0) - 1
    tl.store(out + filled - left + rank, pos.to(tl.int64), mask=tie & (rank < left))
    return slot, tied + tl.sum(tie.to(tl.int32), 0)


@triton.jit
def _finish(scores, out, spill, kept, slots, topk, TILE: tl.constexpr, SMALL: tl.constexpr):
    """The candidates' part of the selection (those in the k-th's bin, `count` listed in
    `spill` while they fit its CAP, else read from the whole row), then -1 in the slots no
    finite score takes. `slots`: (filled, the slots left for the candidates, the next)."""
    at, low, per, end, listed, count = kept
    filled, left, slot = slots
    n = tl.where(listed, count, end)
    kept = (at, low, per, end, listed, n)
    if n <= SMALL:  # the usual case: the candidates gathered once, kept in registers
        few = _candidates(scores, spill, 0, kept, SMALL)
        kth, left = _kth_of_tile(few[0], few[2], left)
        _take(out, few[0], few[1], few[2], kth, filled, left, slot, 0)
    else:
        prefix = 0
        for level in tl.static_range(1, 5):  # the k-th key, a byte a time
            hist = tl.zeros([256], tl.int32)
            for i0 in range(0, n, TILE):
                key, pos, member = _candidates(scores, spill, i0, kept, TILE)
                group = _in_group(key, member, prefix, level - 1)
                hist += tl.histogram(_digit(key, level), 256, mask=group)
            _, digit, left = _cut(hist, left, False)
            prefix = (prefix << 8) | digit
        tied = 0
        for i0 in range(0, n, TILE):
            key, pos, member = _candidates(scores, spill, i0, kept, TILE)
            slot, tied = _take(out, key, pos, member, prefix, filled, left, slot, tied)
    tile = tl.arange(0, TILE)
    for s0 in range(0, topk, TILE):
        s = s0 + tile
        tl.store(out + s, tl.full([TILE], -1, tl.int64), mask=(s >= filled) & (s < topk))


@triton.jit
def _row_end(Lens, row, width, LENS: tl.constexpr):
    """Row `row`'s positions: up to its length (`Lens`) within the width."""
    end = width
    if LENS:
        end = tl.minimum(tl.load(Lens + row).to(tl.int32), width)
    return end


@triton.jit(do_not_specialize=["s_row", "width", "topk", "chunks"])
def _chunk_kernel(
    Scores,
    Lens,
    Out,
    Hist,
    Sfx,
    Spill,
    Bins,
    s_row,
    width,
    topk,
    chunks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    LENS: tl.constexpr,
    SPLIT: tl.constexpr,
    SAMPLE: tl.constexpr,
    CAP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, c) over chunk c of the row: its counts (`Sfx`, and added into `Hist`;
    chunk 0 keeps the row's bins in `Bins`), or, once `Hist` holds the row's (SPLIT), its
    positions above the k-th's bin and its candidates."""
    follow(PDL)
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    scores, sfx = Scores + row * s_row, Sfx + row * chunks * 256
    end = _row_end(Lens, row, width, LENS)
    start, bins = c * CHUNK, tl.arange(0, 256)
    stop = tl.minimum(start + CHUNK, end)
    # the chunk's first scores, their load in flight during the reads they do not need
    first = _finite(scores, start + tl.arange(0, BLOCK), stop)
    if SPLIT:
        if start < end:
            filled, at, left = _cut(tl.load(Hist + row * 256 + bins), topk, True)
            slot = _before(sfx, c, at + 1)  # the chunks before: above it
            count = _before(sfx, c, at) - slot  # and in it
            out, spill = Out + row * topk, Spill + row * CAP
            row_bins = tl.load(Bins + row * 2), tl.load(Bins + row * 2 + 1)
            where = (out, spill, first, (start, stop), row_bins)
            _split(scores, *where, at, slot, count, BLOCK, CAP)
    else:
        counts = tl.zeros([256], tl.int32)
        if start < end or c == 0:
            low, per = _range(scores, end, SAMPLE)
            if c == 0:  # the same for every chunk: the later launches read them
                tl.store(Bins + row * 2, low)
                tl.store(Bins + row * 2 + 1, per)
            if start < end:
                counts = _count(scores, first, (start, stop), low, per, BLOCK)
        at_least = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
        tl.store(sfx + c * 256 + bins, at_least)
        tl.atomic_add(Hist + row * 256 + bins, counts, mask=counts > 0, sem="relaxed")


@triton.jit(do_not_specialize=["s_row", "width", "topk"])
def _finish_kernel(
    Scores,
    Lens,
    Out,
    Hist,
    Spill,
    Bins,
    s_row,
    width,
    topk,
    TILE: tl.constexpr,
    SMALL: tl.constexpr,
    LENS: tl.constexpr,
    CAP: tl.constexpr,
    PDL: tl.constexpr,
):
    follow(PDL)
    row = tl.program_id(0).to(tl.int64)
    scores = Scores + row * s_row
    end = _row_end(Lens, row, width, LENS)
    bins = tl.arange(0, 256)
    hist = tl.load(Hist + row * 256 + bins)
    filled, at, left = _cut(hist, topk, True)
    count = tl.sum(tl.where(bins == at, hist, 0), 0)
    low, per = tl.load(Bins + row * 2), tl.load(Bins + row * 2 + 1)
    kept = (at, low, per, end, count <= CAP, count)
    out, spill = Out + row * topk, Spill + row * CAP
    _finish(scores, out, spill, kept, (filled, left, filled - left), topk, TILE, SMALL)
    tl.store(Hist + row * 256 + bins, tl.zeros([256], tl.int32))  # for the next call


def top_hist(rows: int, device) -> torch.Tensor:
    """Zeroed row histograms for `select_top_triton` ([rows, 256] int32), which it zeroes
    again as it ends: a caller that keeps them saves a memset per call."""
    return torch.zeros(rows, 256, dtype=torch.int32, device=device)


CHUNKS = (512, 1024, 2048, 4096, 8192, 16384)  # the chunk sizes `default_chunk` picks


def default_chunk(tokens: int, width: int) -> int:
    """Positions per program: about 512 programs in all (4 per SM of an H100), 512-16k
    (H100, k 2048: within 10% of the best of 1k-8k at 1 to 128 rows of 32k and 128k)."""
    per_program = triton.next_power_of_2(triton.cdiv(tokens * width, 512))
    return min(max(per_program, CHUNKS[0]), CHUNKS[-1])


@functools.lru_cache(maxsize=None)
def compile_every_chunk(topk: int, device: str) -> None:
    """Runs the select once per chunk size `default_chunk` can pick (its only compile-time
    choice with the rows' lengths, as the engine passes them; widths, rows and chunk counts
    are runtime values), so that no request compiles one: an engine calls this as it warms up."""
    lens = torch.ones(1, dtype=torch.int64, device=device)
    for chunk in CHUNKS:
        select_top_triton(torch.zeros(1, chunk, device=device), topk, lens, chunk=chunk)


def select_top_triton(
    scores: torch.Tensor,
    topk: int,
    lens: torch.Tensor | None = None,
    hist: torch.Tensor | None = None,
    chunk: int | None = None,
    block: int = 2048,
    num_warps: int = 4,
) -> torch.Tensor:
    """`select_top` on the GPU: scores [T, width] float32 -> per row the positions of the
    `topk` highest finite scores (ties: the lowest positions), then -1, [T, topk] int64.
    `lens` [T]: row t's positions from `lens[t]` on count as -inf, unread. `hist`: zeroed
    histograms of at least T rows (`top_hist`; fresh ones if None). `chunk` positions per
    program (a power of two; `default_chunk`), in blocks of `block` (2048 against 1024: 128 rows
    of 32k 55.6 -> 50.1 us, 32 rows 25.9 -> 24.4, H100; bench/notes/session34-h100-2026-11-27.md)."""
    tokens, width = scores.shape
    device = scores.device
    out = torch.empty(tokens, topk, dtype=torch.int64, device=device)
    if not tokens or not width:
        return out.fill_(-1)
    assert scores.dtype == torch.float32 and scores.stride(1) == 1
    chunk = chunk or default_chunk(tokens, width)
    block, chunks = min(block, chunk), triton.cdiv(width, chunk)
    hist = top_hist(tokens, device) if hist is None else hist
    assert hist.is_contiguous() and hist.shape[0] >= tokens
    sfx = torch.empty(tokens, chunks, 256, dtype=torch.int32, device=device)
    spill = torch.empty(tokens, CAP, dtype=torch.int32, device=device)
    bins = torch.empty(tokens, 2, dtype=torch.float32, device=device)  # each row's low, per
    rows = scores if lens is None else lens
    pdl = dependent_launch(device)
    common = dict(CHUNK=chunk, BLOCK=block, LENS=lens is not None, CAP=CAP, **pdl)
    grid, stride = (tokens, chunks), scores.stride(0)
    args = (scores, rows, out, hist, sfx, spill, bins, stride, width, topk, chunks)
    for split in (False, True):
        _chunk_kernel[grid](*args, **common, SPLIT=split, SAMPLE=SAMPLE, num_warps=num_warps)
    tile = min(2048, chunk)  # one variant per chunk: `compile_every_chunk` compiles them all
    small = SMALL_TILE if device.type == "cuda" else INTERPRETED_SMALL_TILE
    finish = dict(TILE=tile, SMALL=min(small, tile), LENS=lens is not None, CAP=CAP, num_warps=8)
    finish.update(pdl)
    launch = (scores, rows, out, hist, spill, bins, stride, width, topk)
    _finish_kernel[(tokens,)](*launch, **finish)
    return out
