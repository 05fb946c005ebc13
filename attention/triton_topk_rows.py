"""The indexer's top-k with one program per row: `triton_topk`'s radix select (the same keys,
byte digits and contract) where a row's passes run in one program instead of spreading over
many, for batches with enough rows to fill the GPU.

Why: the many-programs select pays five launches and, per chunk, the counts of the chunks
before it; at 128 rows of 32k scores it took 183 us on an H100 where torch took 110
(bench/notes/session30-h100-2026-11-26.md). One program per row needs neither: it keeps
the row's histogram in registers and reads the scores again from L2 at each pass (the
indexer has just written them).

How, per row:
- the lowest and highest finite scores of a sample (a tile's positions spread over the
  row) span 256 linear bins (monotone in the score: those below in the first, those above
  and +inf in the last);
- a pass counts the row's scores in them and finds the bin that holds the k-th;
- a pass writes the positions in the bins above it (in position order) and lists those in
  it, the candidates (up to `cap`; when more tie, they are read from the whole row);
- four passes over the candidates count one byte digit each of the keys (`triton_topk`'s)
  still tied with the k-th, until the prefix is the k-th key itself (up to `SMALL_TILE`
  candidates, the usual case, are read once into registers for all four);
- a last pass writes the candidates above it, then those equal to it (lowest positions
  first, as many as slots are left); -1 fills the slots no finite score takes.

The byte levels run over the candidates only: Triton's `tl.histogram` costs about 80
instructions per 32 values at 256 bins (a ballot per bit of the bin, then per bin a lane
owns an AND and a popcount), and over whole 32k rows the four levels took 115-200 us.
`lens` bounds each row's positions (the rest count as -inf, unread): the engine's scores
are as wide as the pass's longest context, or its CUDA graph's context width.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dserve.attention.triton_topk import _cut, _digit, _finite, _in_group, _key_of, _write


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
def _split(scores, out, spill, end, low, per, at, TILE: tl.constexpr, CAP: tl.constexpr):
    """Positions in bins above `at` to `out` (position order), those in bin `at` (the
    candidates) to `spill` while CAP hold them; returns how many of each. One scan a tile
    ranks both: their counts in the low and high 16 bits (a tile is under 65536 wide)."""
    tile = tl.arange(0, TILE)
    slot, count = 0, 0
    for t0 in range(0, end, TILE):
        pos = t0 + tile
        x, finite = _finite(scores, pos, end)
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
    tile, a byte a time: (the key, the slots left for the keys equal to it)."""
    prefix = 0
    for level in tl.static_range(1, 5):
        group = _in_group(key, member, prefix, level - 1)
        hist = tl.histogram(_digit(key, level), 256, mask=group)
        _, digit, left = _cut(hist, left, False)
        prefix = (prefix << 8) | digit
    return prefix, left


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


@triton.jit(do_not_specialize=["s_row", "width", "topk"])
def _rows_kernel(
    Scores,
    Lens,
    Out,
    Spill,
    s_row,
    width,
    topk,
    TILE: tl.constexpr,
    CAP: tl.constexpr,
    SMALL: tl.constexpr,
    LENS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    scores, out, spill = Scores + row * s_row, Out + row * topk, Spill + row * CAP
    end = width
    if LENS:
        end = tl.minimum(tl.load(Lens + row).to(tl.int32), width)
    tile = tl.arange(0, TILE)
    low, per = _range(scores, end, TILE)
    hist = tl.zeros([256], tl.int32)
    for t0 in range(0, end, TILE):
        x, finite = _finite(scores, t0 + tile, end)
        hist += tl.histogram(_bin(x, finite, low, per), 256, mask=finite)
    filled, at, left = _cut(hist, topk, True)
    slot, count = _split(scores, out, spill, end, low, per, at, TILE, CAP)
    listed = count <= CAP  # else the candidates are read from the whole row
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
    for s0 in range(0, topk, TILE):
        s = s0 + tile
        tl.store(out + s, tl.full([TILE], -1, tl.int64), mask=(s >= filled) & (s < topk))


def default_tile(width: int) -> tuple[int, int]:
    """Positions per tile and warps for rows of `width` scores: 8 per
    thread, up to 2048 on 8 warps (4096 on 8 past 64k). On an H100 at 32k,
    92 us against 103 for 4096 on 16; at 128k, 300 against 332 for 2048
    (bench/notes/session30-h100-2026-11-26.md)."""
    most = 2048 if width <= 65536 else 4096
    tile = min(max(triton.next_power_of_2(max(width, 1)), 256), most)
    return tile, min(max(tile // 256, 1), 8)


@functools.lru_cache(maxsize=None)
def compile_for(topk: int, width: int, device: str) -> None:
    """Runs the select once at `width` (its launch follows the width alone), so that no
    request compiles it: a serving engine calls this while it warms up."""
    lens = torch.zeros(1, dtype=torch.int64, device=device)
    select_top_rows(torch.zeros(1, width, device=device), topk, lens=lens)


# candidates up to this many (the usual count, a few hundred at 32k) are gathered once into
# registers and their levels count over a tile this wide, not the row's
SMALL_TILE = 512
SPILL_ROWS = 1024  # rows a launch takes: their candidate lists, 16 KB a row, are one buffer


def select_top_rows(
    scores: torch.Tensor,
    topk: int,
    lens: torch.Tensor | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
    cap: int = 4096,
) -> torch.Tensor:
    """`triton_topk.select_top_triton`'s selection (the same set, another order) with one
    program per row: scores [T, width] float32 -> [T, topk] int64. `lens` [T]: row t's
    positions from `lens[t]` on count as -inf, unread. `tile` positions per pass step (a
    power of two) on `num_warps` warps (`default_tile`); `cap` candidates a row lists."""
    tokens, width = scores.shape
    out = torch.empty(tokens, topk, dtype=torch.int64, device=scores.device)
    if not tokens or not width:
        return out.fill_(-1)
    assert scores.dtype == torch.float32 and scores.stride(1) == 1
    default = default_tile(width)
    tile, num_warps = tile or default[0], num_warps or default[1]
    spill = torch.empty(min(tokens, SPILL_ROWS), cap, dtype=torch.int32, device=scores.device)
    for r0 in range(0, tokens, SPILL_ROWS):
        r1 = min(r0 + SPILL_ROWS, tokens)
        _rows_kernel[(r1 - r0,)](
            scores[r0:r1],
            scores if lens is None else lens[r0:r1],
            out[r0:r1],
            spill,
            scores.stride(0),
            width,
            topk,
            TILE=tile,
            CAP=cap,
            SMALL=min(SMALL_TILE, tile),
            LENS=lens is not None,
            num_warps=num_warps,
        )
    return out
