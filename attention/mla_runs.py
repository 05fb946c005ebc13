"""What each program of the Gluon MLA decode reads (its run), and the
merge of the rows that more than one run holds a part of.

Two cuts of a batch (`launch_cut` picks one per launch):
- each row in equal parts, a program a part (`launch_shapes.mla_splits`'
  count, as before session 41); rows end on runs' ends, and one part a row
  needs no merge;
- every row's blocks laid end to end and cut into one equal run a program,
  one program an SM for each head group (FlashMLA's tile scheduler): a
  run may hold the end of one row, whole rows and the start of another.
  Parts came in whole rounds of programs or left SMs idle: at 128 heads
  and 8k, batch 40 ran at 52% of the copy bandwidth (80 programs on 132
  SMs), batch 80 at 64%; cut evenly 69% and 75% (H100, session 41).

A run's part of a row is a segment. A segment that is its whole row writes
the row's output itself (unless the row is in parts, whose merge reads
every part); the others write a partial output (normalised, float32) and
its log-sum-exp into the program's slot 0 (its run's first segment) or 1
(its last). Parts merge by `triton_mla.combine_splits`, the even cut's
split rows by `merge_runs`, from what the program holding a row's first
block notes (`row_meta`: how many runs the row spans, the slot of its
first). A row has at least one block (an empty row: one block of no
position, zeros). `runs_reference` is the even cut in Python, for the
tests.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dserve.attention.dependent_launch import dependent_launch, follow
from dserve.attention.gluon_tma import HAVE_GLUON
from dserve.attention.launch_shapes import BLOCK_TOKENS, MLA_HEADS, mla_splits

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

# rows the schedule reads at a time (a runtime loop: one variant for any batch)
ROW_CHUNK = tl.constexpr(128)


def programs_for(heads: int, device) -> int:
    """Programs a head group: one an SM (a program holds a whole SM's
    shared memory) over the launch's head groups."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    groups = -(-heads // MLA_HEADS)
    return max(1, sms // groups)


def min_blocks(gathered: bool) -> int:
    """The shortest run: four blocks (two over sparse attention's gathered
    positions), as the splits it replaced were bounded."""
    return 2 if gathered else 4


ROUND_BLOCKS = 8  # a round of programs' own cost (start, queries, outputs), in blocks' time
PARTIAL_BLOCKS = 3.6  # a partial output's write and merge (128 KB), in blocks' bytes (72 KB)


def launch_cut(batch: int, heads: int, max_len: int, device, gathered: bool) -> tuple[int, int]:
    """(programs a head group, parts a row; 0: the even cut). Each row in
    `mla_splits`' parts (rows end on runs' ends; one part: no merge), unless
    the even cut is more than 5% faster by a model of the rounds
    (`cut_costs`): at 128 heads and 8k the parts left SMs idle at batch
    40-56 and 80-112, and sparse rows at batch 70-140 (H100, session 41).
    Not where one head group reads at the memory's bandwidth (up to 64
    heads, dense): there a later round's few programs still read at the
    memory's rate, and the even cut's merges made it 6-8% slower (16 and 64
    heads at 8k, batch 40-100)."""
    props = torch.cuda.get_device_properties(device)
    parts = mla_splits(batch, heads, max_len, device, gathered)
    if heads <= MLA_HEADS and not gathered:
        return batch * parts, parts
    blocks = max(1, -(-max_len // BLOCK_TOKENS))
    shape = (batch, -(-heads // MLA_HEADS), blocks, min_blocks(gathered))
    by_rows, even = cut_costs(shape, parts, props.multi_processor_count)
    if even * 1.05 < by_rows:
        return programs_for(heads, device), 0
    return batch * parts, parts


def cut_costs(shape: tuple, parts: int, sms: int) -> tuple[float, float]:
    """The launch's time in blocks' time, rows in `parts` against the even
    cut, for `shape` = (rows, head groups, blocks a row, least blocks a run):
    rounds of programs times their blocks and `ROUND_BLOCKS`; the even
    cut's one round plus a partial for each run a row spans."""
    rows, groups, blocks, least = shape
    rounds = -(-rows * parts * groups // sms)
    by_rows = rounds * (-(-blocks // parts) + ROUND_BLOCKS)
    programs = max(1, sms // groups)
    per = max(-(-rows * blocks // programs), least)
    even = per + ROUND_BLOCKS + PARTIAL_BLOCKS * -(-programs // rows)
    return by_rows, even


def runs_reference(blocks: list[int], programs: int, least: int) -> list[list[tuple]]:
    """The even cut's segments of each program, (row, first block, block
    after its last), for rows of `blocks` blocks each (at least one)."""
    blocks = [max(1, n) for n in blocks]
    total = sum(blocks)
    per = max(-(-total // programs), least)
    starts = [sum(blocks[:r]) for r in range(len(blocks))]
    runs = []
    for p in range(programs):
        x, e = p * per, min(p * per + per, total)
        segs = []
        for r, (s0, n) in enumerate(zip(starts, blocks)):
            lo, hi = max(x, s0), min(e, s0 + n)
            if lo < hi:
                segs.append((r, lo - s0, hi - s0))
        runs.append(segs)
    return runs


if HAVE_GLUON:

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def row_blocks(seq_lens, r, rows, width, SPARSE: gl.constexpr, BLOCK_N: gl.constexpr):
        """Blocks of rows `r` (a vector; at least one a row, none past
        `rows`); sparse rows are `width` positions each."""
        if SPARSE:
            n = r * 0 + width
        else:
            n = gl.load(seq_lens + r, mask=r < rows, other=0).to(gl.int32)
        return gl.where(r < rows, gl.maximum((n + BLOCK_N - 1) // BLOCK_N, 1), 0)

    @gluon.jit
    def schedule(lens, p, runs, row_meta, SPARSE: gl.constexpr, BLOCK_N: gl.constexpr):
        """Program p's run: (its first row, that row's first block, its last
        row, the block after that row's last, whether a whole row's segment
        writes the row's output); no rows (last < first) when it has none.
        `lens` = (seq_lens, rows, width), `runs` = (programs, least blocks a
        run, parts a row or 0 for the even cut). Writes `row_meta` for the
        rows whose first block is in the run: [the runs the row spans,
        p * 2 + the slot of its part in p]."""
        seq_lens, rows, width = lens
        programs, least, parts = runs
        even = parts == 0
        scanned = gl.where(even, rows, 0)  # the even cut reads every row's length
        CH: gl.constexpr = ROW_CHUNK
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        total = 0
        for c0 in range(0, scanned, CH):
            r = c0 + gl.arange(0, CH, layout=layout)
            total += gl.sum(row_blocks(seq_lens, r, rows, width, SPARSE, BLOCK_N), 0)
        per = gl.maximum(gl.cdiv(total, programs), least)
        x = p * per
        e = gl.minimum(x + per, total)
        first, last, below_x, below_e, carry = 0, 0, 0, 0, 0
        for c0 in range(0, scanned, CH):
            r = c0 + gl.arange(0, CH, layout=layout)
            n = row_blocks(seq_lens, r, rows, width, SPARSE, BLOCK_N)
            ends = carry + gl.associative_scan(n, 0, _add)
            starts = ends - n
            carry += gl.sum(n, 0)
            before_x = (r < rows) & (ends <= x)
            before_e = (r < rows) & (ends <= e - 1)
            first += gl.sum(before_x.to(gl.int32), 0)
            last += gl.sum(before_e.to(gl.int32), 0)
            below_x = gl.maximum(below_x, gl.max(gl.where(before_x, ends, 0), 0))
            below_e = gl.maximum(below_e, gl.max(gl.where(before_e, ends, 0), 0))
            mine = (r < rows) & (starts >= x) & (starts < e)
            spans = (ends - 1) // per - p + 1
            slot = gl.where(starts == x, 0, 1)
            gl.store(row_meta + r * 2, spans, mask=mine)
            gl.store(row_meta + r * 2 + 1, p * 2 + slot, mask=mine)
        b, lo, b_last, hi = _row_part(lens, p, (least, parts), SPARSE, BLOCK_N)
        first = gl.where(even, first, b)
        last = gl.where(even, last, b_last)
        # a whole row's segment writes its output, but for parts of a row,
        # which the merge of equal splits reads all of
        alone = even | (parts == 1)
        lo = gl.where(even, x - below_x, lo)
        return first, lo, last, gl.where(even, e - below_e, hi), alone

    @gluon.jit
    def _row_part(lens, p, cut, SPARSE: gl.constexpr, BLOCK_N: gl.constexpr):
        """`schedule` with each row in `parts` equal parts (at least `least`
        blocks), a program a part: row p // parts, part p % parts (every
        part written, as the merge of equal splits reads them all; it
        needs no `row_meta`)."""
        seq_lens, rows, width = lens
        least, parts = cut
        parts = gl.maximum(parts, 1)  # 0: the even cut's, not used
        b, part = p // parts, p % parts
        if SPARSE:
            seq_len = width
        else:
            seq_len = gl.load(seq_lens + b, mask=b < rows, other=0).to(gl.int32)
        blocks = gl.maximum(gl.cdiv(seq_len, BLOCK_N), 1)
        per = gl.maximum(gl.cdiv(blocks, parts), least)
        lo = part * per
        hi = gl.minimum(lo + per, blocks)
        # a part past the row's end is a segment of no block: its partial is
        # zeros with a log-sum-exp of -inf, which the merge weighs as nothing
        return b, lo, gl.where(b >= rows, b - 1, b), hi

    @gluon.jit
    def segment(rows_at, run, r, SPARSE: gl.constexpr, BLOCK_N: gl.constexpr):
        """Row r's segment of this program's run (`run`: `schedule`'s five
        values): [start, end) of its positions, its blocks of them, its
        page-table row, its selection (sparse), and whether it writes the
        row's output (a whole row, where the run may)."""
        seq_lens, row_seqs, page_table, s_pt_b, selected, s_sel_b, width = rows_at
        first, lo0, last, hi0, alone = run
        if SPARSE:
            seq_len = width
            sel_row = selected + r.to(gl.int64) * s_sel_b
        else:
            seq_len = gl.load(seq_lens + r).to(gl.int32)  # the engine's are int64
            sel_row = selected
        blocks = gl.maximum(gl.cdiv(seq_len, BLOCK_N), 1)
        lo = gl.where(r == first, lo0, 0)
        hi = gl.where(r == last, hi0, blocks)
        table = page_table + gl.load(row_seqs + r).to(gl.int64) * s_pt_b
        start, end = lo * BLOCK_N, gl.minimum(hi * BLOCK_N, seq_len)
        count = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)  # none: an empty row
        return start, end, count, table, sel_row, alone & (lo == 0) & (hi == blocks)


@triton.jit
def _merge_kernel(
    MidO,
    MidLse,
    RowMeta,
    Out,
    s_o_b,
    s_o_h,
    padded,
    R: tl.constexpr,
    CH: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row b, head h: the partials of the runs it spans (the first run's in
    the slot `RowMeta` names, the others' in slot 0) weighted by the
    softmax of their log-sum-exps; rows one run holds were written by the
    decode itself."""
    b, h = tl.program_id(0), tl.program_id(1)
    follow(PDL)
    spans = tl.load(RowMeta + b * 2)
    if spans > 1:
        at = tl.load(RowMeta + b * 2 + 1)
        p0, first = at // 2, at % 2
        r = tl.arange(0, R)
        m = float("-inf")
        total = 0.0
        out = tl.zeros([R], tl.float32)
        for c0 in range(0, spans, CH):
            i = c0 + tl.arange(0, CH)
            valid = i < spans
            slot = tl.where(i == 0, first, 0)
            part = ((p0 + i) * 2 + slot) * padded + h
            lse = tl.load(MidLse + part, mask=valid, other=float("-inf"))
            top = tl.maximum(m, tl.max(lse, 0))
            safe = tl.where(top == float("-inf"), 0.0, top)
            scale = tl.exp(m - safe)
            w = tl.exp(lse - safe)
            parts = tl.load(MidO + part[:, None] * R + r[None, :], mask=valid[:, None], other=0.0)
            out = out * scale + tl.sum(parts * w[:, None], 0)
            total = total * scale + tl.sum(w, 0)
            m = top
        total = tl.where(total == 0.0, 1.0, total)  # no part saw a position: zeros
        tl.store(Out + b * s_o_b + h * s_o_h + r, (out / total).to(Out.dtype.element_ty))


def merge_runs(mid_out, mid_lse, row_meta, out) -> torch.Tensor:
    """out [B, H, R]: each split row's partials (`mid_out` [programs, 2,
    heads padded to the head groups', R], `mid_lse` [programs, 2, padded
    heads], float32) merged; rows the decode wrote itself are left as they
    are. A dependent launch on Hopper."""
    batch, heads, rank = out.shape
    padded = mid_out.shape[2]
    _merge_kernel[(batch, heads)](
        mid_out,
        mid_lse,
        row_meta,
        out,
        out.stride(0),
        out.stride(1),
        padded,
        R=rank,
        CH=4,
        **dependent_launch(out.device),
    )
    return out


@functools.lru_cache(maxsize=None)
def compile_merge(rank: int, dtype, device: str) -> None:
    """Runs the merge once (its one variant), so that a batch that first
    takes the even cut compiles nothing mid-request: the decode calls this
    outside a CUDA graph's capture."""
    f32 = dict(dtype=torch.float32, device=device)
    meta = torch.tensor([[2, 0]], dtype=torch.int32, device=device)
    out = torch.empty(1, 1, rank, dtype=dtype, device=device)
    merge_runs(torch.zeros(2, 2, 64, rank, **f32), torch.zeros(2, 2, 64, **f32), meta, out)
