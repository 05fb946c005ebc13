"""The indexer's top-k with one program per row: `triton_topk`'s radix select (the same keys,
byte digits and contract) where a row's passes run in one program instead of spreading over
many, for batches with enough rows to fill the GPU.

Why: the many-programs select pays five launches and, per chunk, the counts of the chunks
before it; at 128 rows of 32k scores it took 183 us on an H100 where torch took 110
(bench/notes/session30-h100-2026-11-26.md). One program per row needs neither: it keeps
the row's histogram in registers and reads the scores again from L2 at each pass (the
indexer has just written them).

How, per row:
- a pass finds the lowest and highest finite scores;
- a pass counts the scores in 256 linear bins of that range (monotone in the score, +inf
  in the last) and finds the bin that holds the k-th;
- a pass writes the positions in the bins above it (in position order) and lists those in
  it, the candidates (up to `cap`; when more tie, they are read from the whole row);
- four passes over the candidates count one byte digit each of the keys (`triton_topk`'s)
  still tied with the k-th, until the prefix is the k-th key itself;
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
    """The row's bins: its lowest finite score and `_bin`'s `per`."""
    tile = tl.arange(0, TILE)
    low = tl.full([TILE], float("inf"), tl.float32)
    high = tl.full([TILE], float("-inf"), tl.float32)
    for t0 in range(0, end, TILE):
        x, finite = _finite(scores, t0 + tile, end)
        finite &= x < float("inf")
        low = tl.minimum(low, tl.where(finite, x, float("inf")))
        high = tl.maximum(high, tl.where(finite, x, float("-inf")))
    low, high = tl.min(low, 0), tl.max(high, 0)
    return low, tl.where(high > low, 255.0 / (high - low), 0.0)


@triton.jit
def _split(scores, out, spill, end, low, per, at, TILE: tl.constexpr, CAP: tl.constexpr):
    """Positions in bins above `at` to `out` (position order), those in bin `at` (the
    candidates) to `spill` while CAP hold them; returns how many of each."""
    tile = tl.arange(0, TILE)
    slot, count = 0, 0
    for t0 in range(0, end, TILE):
        pos = t0 + tile
        x, finite = _finite(scores, pos, end)
        b = _bin(x, finite, low, per)
        slot = _write(out, finite & (b > at), pos, slot)
        member = finite & (b == at)
        rank = count + tl.cumsum(member.to(tl.int32), 0) - 1
        tl.store(spill + rank, pos, mask=member & (rank < CAP))
        count += tl.sum(member.to(tl.int32), 0)
    return slot, count


@triton.jit
def _candidates(scores, spill, i0, n, listed, end, low, per, at, TILE: tl.constexpr):
    """Tile i0 of the candidates: from `spill` where `listed`, else of the whole row (its
    members those in bin `at`). Returns their keys, positions, membership."""
    i = i0 + tl.arange(0, TILE)
    pos = tl.load(spill + i, mask=i < tl.where(listed, n, 0), other=0)
    pos = tl.where(listed, pos, i)
    x, finite = _finite(scores, pos, end)
    member = finite & (_bin(x, finite, low, per) == at) & (i < n)
    return _key_of(x), pos, member


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
    prefix = 0
    for level in tl.static_range(1, 5):  # the k-th key among the candidates, a byte a time
        hist = tl.zeros([256], tl.int32)
        for i0 in range(0, n, TILE):
            key, pos, member = _candidates(scores, spill, i0, n, listed, end, low, per, at, TILE)
            group = _in_group(key, member, prefix, level - 1)
            hist += tl.histogram(_digit(key, level), 256, mask=group)
        _, digit, left = _cut(hist, left, False)
        prefix = (prefix << 8) | digit
    kth, tied = prefix ^ -2147483648, 0  # the k-th key, signed
    for i0 in range(0, n, TILE):
        key, pos, member = _candidates(scores, spill, i0, n, listed, end, low, per, at, TILE)
        signed = key ^ -2147483648  # the keys' unsigned order as int32's
        slot = _write(out, member & (signed > kth), pos, slot)
        tie = member & (signed == kth)
        rank = tied + tl.cumsum(tie.to(tl.int32), 0) - 1
        tl.store(out + filled - left + rank, pos.to(tl.int64), mask=tie & (rank < left))
        tied += tl.sum(tie.to(tl.int32), 0)
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
            LENS=lens is not None,
            num_warps=num_warps,
        )
    return out
