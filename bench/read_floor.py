"""Read-only floors for the benchmarks: how long this GPU takes only to read
a kernel's bytes, in the same run, with the same scatter.

The copy bandwidth (`cuda_timing.copy_bandwidth`, a 1 GiB copy) is the
limit of long streams. A sparse decode step reads less, and in pieces: at
batch 32 the sparse MLA gathers 75 MB of 1152-byte rows, the indexer
streams 138 MB of keys. Two floors say what a kernel that did nothing but
read those bytes would take here:

- `gather_floor_seconds`: every selected position's row (latent and rope
  key, 576 16-bit values), through the page table, as the sparse MLA
  reads it;
- `read_floor_seconds`: contiguous tensors' bytes (the indexer's pool:
  its keys and their scales).

Each program sums what it read into a few float32s (so the reads cannot
be dropped, and nearly nothing is written); the floor is the fastest of a
few launch shapes. `gather_sums` and `read_sums` return those sums, which
the tests check against torch (`tests/bench/test_read_floor.py`). They are
simple kernels, not proven lower bounds: where a part reads more cleverly
than they do (the sparse MLA at batch 128 on an H100), it beats its
floor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bench.cuda_timing import graph_seconds

ROW = 576  # a position's latent (512) and rope key (64)
# (rows a program reads at a time, times it does so, warps)
GATHER_SHAPES = ((16, 1, 4), (32, 1, 4), (32, 4, 4), (64, 1, 8))
# (int32 words a program reads at a time, times it does so, warps)
READ_SHAPES = ((2048, 1, 4), (2048, 4, 4), (4096, 2, 8))


@triton.jit
def _gather_kernel(
    cache,
    table,
    selected,
    out,
    s_sel,
    s_tab,
    width,
    PAGE: tl.constexpr,
    ROWS: tl.constexpr,
    LOOPS: tl.constexpr,
):
    """Program (b, j): row b's selected positions j * ROWS * LOOPS on,
    each position's 576 values summed over the positions into out[b, j]
    (-1: nothing read)."""
    b, j = tl.program_id(0), tl.program_id(1)
    lat = tl.arange(0, 512)
    rope = tl.arange(0, 64)
    acc = tl.zeros([512], tl.float32)
    acc_r = tl.zeros([64], tl.float32)
    for i in range(LOOPS):
        idx = (j * LOOPS + i) * ROWS + tl.arange(0, ROWS)
        pos = tl.load(selected + b * s_sel + idx, mask=idx < width, other=-1)
        valid = pos >= 0
        pos = tl.maximum(pos, 0)
        page = tl.load(table + b * s_tab + pos // PAGE, mask=valid, other=0)
        at = (page.to(tl.int64) * PAGE + pos % PAGE) * 576
        x = tl.load(cache + at[:, None] + lat[None, :], mask=valid[:, None], other=0.0)
        y = tl.load(cache + at[:, None] + 512 + rope[None, :], mask=valid[:, None], other=0.0)
        acc += tl.sum(x.to(tl.float32), 0)
        acc_r += tl.sum(y.to(tl.float32), 0)
    o = out + (b * tl.num_programs(1) + j) * 576
    tl.store(o + lat, acc)
    tl.store(o + 512 + rope, acc_r)


@triton.jit
def _read_kernel(words, out, n, BLOCK: tl.constexpr, LOOPS: tl.constexpr):
    """Program p: words p * BLOCK * LOOPS on, summed (wrapping) into out[p]."""
    p = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(LOOPS):
        at = (p * LOOPS + i) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(words + at, mask=at < n, other=0)
    tl.store(out + p, tl.sum(acc, 0))


def gather_sums(cache, table, selected, shape=(32, 1, 4)) -> torch.Tensor:
    """[batch, programs a row, 576]: the selected rows' values summed per
    program (`cache` [pages, page size, 576] 16-bit, `table` [batch,
    pages a row], `selected` [batch, width] positions, -1 for none)."""
    rows, loops, warps = shape
    batch, width = selected.shape
    assert cache.is_contiguous() and cache.shape[-1] == ROW
    programs = triton.cdiv(width, rows * loops)
    out = torch.empty(batch, programs, ROW, dtype=torch.float32, device=cache.device)
    _gather_kernel[(batch, programs)](
        cache,
        table,
        selected,
        out,
        selected.stride(0),
        table.stride(0),
        width,
        PAGE=cache.shape[1],
        ROWS=rows,
        LOOPS=loops,
        num_warps=warps,
    )
    return out


def read_sums(tensors, shape=(2048, 1, 4)) -> list[torch.Tensor]:
    """Each contiguous tensor's bytes as int32 words, summed per program."""
    block, loops, warps = shape
    sums = []
    for t in tensors:
        assert t.is_contiguous(), "a view would be copied, and the copy timed"
        words = t.reshape(-1).view(torch.uint8).view(torch.int32)
        programs = triton.cdiv(words.numel(), block * loops)
        out = torch.empty(programs, dtype=torch.int32, device=t.device)
        _read_kernel[(programs,)](
            words, out, words.numel(), BLOCK=block, LOOPS=loops, num_warps=warps
        )
        sums.append(out)
    return sums


def gather_floor_seconds(cache, table, selected, repeats: int = 10) -> float:
    """The fastest of `GATHER_SHAPES` at gathering the selected rows."""
    return min(
        graph_seconds(lambda s=shape: gather_sums(cache, table, selected, s), repeats)
        for shape in GATHER_SHAPES
    )


def read_floor_seconds(tensors, repeats: int = 10) -> float:
    """The fastest of `READ_SHAPES` at reading the tensors (contiguous, a
    multiple of 4 bytes each), one launch each, back to back."""
    return min(
        graph_seconds(lambda s=shape: read_sums(tensors, s), repeats) for shape in READ_SHAPES
    )
