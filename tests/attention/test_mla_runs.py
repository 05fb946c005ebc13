"""The Gluon MLA decode's schedule (`mla_runs`): the batch's blocks cut into
equal runs cover every block once, and the merge of a row's partials over
the runs it spans gives the row's attention (the merge kernel under the
CPU interpreter; the schedule inside the kernel is checked on a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dserve.attention import mla_runs  # noqa: E402


@pytest.mark.parametrize(
    "blocks,programs,least",
    [
        ([128] * 40, 66, 4),
        ([128] * 64, 66, 4),
        ([3, 1, 0, 17, 64, 2], 8, 4),
        ([512], 66, 4),
        ([1] * 200, 132, 2),
        ([5, 9], 132, 4),
        ([32] * 7, 132, 2),
    ],
)
def test_the_even_cut_covers_every_block_once(blocks, programs, least):
    """Every row's blocks (one for an empty row) in exactly one segment of
    one of the launch's programs; no run longer than the even share."""
    runs = mla_runs.runs_reference(blocks, programs, least)
    assert len(runs) == programs
    seen = [[0] * max(1, n) for n in blocks]
    for segs in runs:
        for r, lo, hi in segs:
            for j in range(lo, hi):
                seen[r][j] += 1
    assert all(c == 1 for row in seen for c in row)
    per = max(-(-sum(max(1, n) for n in blocks) // programs), least)
    assert all(sum(hi - lo for _, lo, hi in segs) <= per for segs in runs)


class H100:
    multi_processor_count = 132
    memory_clock_rate = 2_619_000  # kHz
    memory_bus_width = 5120


@pytest.mark.parametrize(
    "batch,heads,max_len,gathered,even",
    [
        (32, 128, 8192, False, False),  # two parts a row fill the SMs
        (64, 128, 8192, False, False),  # one part a row fills them
        (128, 128, 8192, False, False),  # two full rounds
        (40, 128, 8192, False, True),  # 80 programs: 52 SMs idle
        (48, 128, 8192, False, True),
        (80, 128, 8192, False, True),  # 640 programs in 5 rounds
        (96, 128, 8192, False, True),
        (112, 128, 8192, False, True),
        (1, 64, 32768, False, False),  # one row: parts (the even cut's partials cost more)
        (32, 64, 2048, True, False),  # sparse: every row as wide as the selection
        (128, 64, 2048, True, False),
        (1, 64, 2048, True, False),
        (80, 64, 2048, True, True),  # sparse, 80 programs: the even cut
        (140, 64, 2048, True, True),
        (40, 16, 8192, False, False),  # one head group, dense: reads at the memory's rate
        (80, 64, 8192, False, False),
        (20, 128, 8192, False, True),
    ],
)
def test_the_even_cut_where_parts_leave_sms_idle(
    batch, heads, max_len, gathered, even, monkeypatch
):
    """The cut a launch takes (H100): rows in parts where they fill the
    SMs' rounds, the even cut where its one round is more than 5% shorter
    (the cases session 41 measured at 128 heads and 8k: 52-72% of the
    copy bandwidth in parts at batch 40-112, 70-79% cut evenly; sparse
    batch 140 200 -> 170 us), never for one dense head group (16 and 64
    heads: 6-8% slower cut evenly)."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H100())
    programs, parts = mla_runs.launch_cut(batch, heads, max_len, "cuda", gathered)
    assert (parts == 0) == even
    groups = -(-heads // 64)
    if even:
        assert programs * groups <= 132
    else:
        assert programs == batch * parts


def _meta(runs, rows):
    """`row_meta` as the kernel writes it: per row [runs it spans, first
    run * 2 + the slot of its part there]."""
    spans = [
        [p for p, segs in enumerate(runs) if any(r == row for r, _, _ in segs)]
        for row in range(rows)
    ]
    meta = []
    for row, ps in enumerate(spans):
        first = ps[0]
        slot = 0 if runs[first][0][0] == row else 1
        meta.append([len(ps), first * 2 + slot])
    return torch.tensor(meta, dtype=torch.int32)


def test_the_merge_of_the_runs_is_the_rows_attention():
    """Scores of each row's positions (64 a block) split over the runs as
    the kernel splits them: each run's part written as the kernel writes
    it (normalised output and log-sum-exp in its slot), the merge's rows
    equal the softmax over all of the row's positions; rows one run holds
    are left as the decode wrote them."""
    gen = torch.Generator().manual_seed(0)
    heads, rank, padded = 2, 16, 64
    blocks, programs = [3, 1, 7, 2, 5], 6
    runs = mla_runs.runs_reference(blocks, programs, 1)
    scores = [torch.randn(heads, n * 64, generator=gen) for n in blocks]
    values = [torch.randn(n * 64, rank, generator=gen) for n in blocks]
    mid_o = torch.zeros(programs, 2, padded, rank)
    mid_lse = torch.full((programs, 2, padded), float("-inf"))
    out = torch.full((len(blocks), heads, rank), 7.0)
    meta = _meta(runs, len(blocks))
    for p, segs in enumerate(runs):
        for i, (r, lo, hi) in enumerate(segs):
            s, v = scores[r][:, lo * 64 : hi * 64], values[r][lo * 64 : hi * 64]
            if meta[r, 0] == 1:
                continue  # the decode writes a whole row itself
            slot = 0 if i == 0 else 1
            mid_o[p, slot, :heads] = s.softmax(-1) @ v
            mid_lse[p, slot, :heads] = s.logsumexp(-1)
    mla_runs.merge_runs(mid_o, mid_lse, meta, out)
    for r in range(len(blocks)):
        if meta[r, 0] == 1:
            assert torch.equal(out[r], torch.full_like(out[r], 7.0))
        else:
            want = scores[r].softmax(-1) @ values[r]
            assert torch.allclose(out[r], want, atol=1e-5), r
    assert (meta[:, 0] > 1).sum() >= 2  # the case splits rows


def test_a_row_no_part_saw_a_position_of_is_zeros():
    """Sparse rows may select nothing in any run: every part's
    log-sum-exp is -inf and the merge writes zeros, not NaN."""
    mid_o = torch.zeros(2, 2, 64, 16)
    mid_lse = torch.full((2, 2, 64), float("-inf"))
    meta = torch.tensor([[2, 0]], dtype=torch.int32)
    out = torch.full((1, 4, 16), 7.0)
    mla_runs.merge_runs(mid_o, mid_lse, meta, out)
    assert torch.equal(out, torch.zeros_like(out))
