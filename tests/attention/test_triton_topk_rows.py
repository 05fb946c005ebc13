"""The one-program-per-row top-k (`select_top_rows`) against the stable sort and against the
many-programs select (`select_top_triton`): the same set in every row, ties to the lower
positions, -1 after the finite scores; rows bounded by `lens` and tiled several times. On a
CPU host under TRITON_INTERPRET=1 at small shapes; at GLM-5's on a GPU."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.attention.index_cache import select_top  # noqa: E402
from dserve.attention.triton_topk import select_top_triton  # noqa: E402
from dserve.attention.triton_topk_rows import select_top_rows  # noqa: E402
from tests.attention.test_triton_topk import (  # noqa: E402
    DEVICE,
    INF,
    chosen,
    distinct_rows,
    packed,
    ragged,
    stable_top,
    tied_rows,
)
from tests.attention.test_triton_topk import check as topk_check  # noqa: E402

check = functools.partial(topk_check, select=select_top_rows)  # the same checks, this select


@pytest.mark.parametrize(
    "width,topk,tile", [(1, 4, None), (7, 4, None), (300, 64, None), (200, 8, 32)]
)
def test_distinct_scores_select_as_torch(width, topk, tile):
    scores = distinct_rows(width, topk)
    launch = {"tile": tile, "num_warps": 1} if tile else {}
    got = check(scores, topk, **launch)
    assert chosen(got) == chosen(select_top(scores, topk))
    assert chosen(got) == chosen(select_top_triton(scores.to(DEVICE), topk).cpu())


def test_ties_take_the_lowest_positions_across_tiles():
    scores = tied_rows()
    check(scores, 64, again=True, tile=64, num_warps=1)
    check(scores, 24, cap=16)  # more candidates than listed: read from the row


def test_candidates_past_the_list_are_read_from_the_row():
    """Bins of one score each (a candidate list of one), of many, and all in one bin. With
    tiles of 128 the candidates' own tile (`SMALL_TILE`, at most the tile) is 128 too: a few
    candidates are gathered once, more than 128 (or than `cap`) counted tile by tile."""
    spread = torch.arange(256.0).repeat(2, 2)  # the lowest bin holds one score, then two
    spread[1] = torch.linspace(-1.0, 1.0, 512) ** 9  # most in the middle bins
    scores = torch.cat([spread, torch.full((1, 512), -3.0)])
    for cap in (1, 8, 512):
        check(scores, 100, tile=128, num_warps=1, cap=cap)


def test_scores_outside_the_sampled_range_select_exactly():
    """The bins span a sample of the row (a tile's positions spread over it, every 15th or
    16th here): the highest and lowest scores, unsampled, fall in the end bins; a row whose
    sampled positions are all -inf puts every finite score in one bin."""
    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(2, 1000, generator=gen)
    sampled = torch.arange(64) * 1000 // 64
    unsampled = torch.tensor(sorted(set(range(1000)) - set(sampled.tolist()))[:40])
    scores[0, unsampled[:20]] = 1e6 + torch.arange(20.0)  # over the sample's highest
    scores[0, unsampled[20:]] = -1e6  # under its lowest
    scores[1, sampled] = -INF
    for topk in (10, 30, 500):
        check(scores, topk, tile=64, num_warps=1)


def test_more_candidates_than_one_small_tile():
    """The default launch: 1500 tied scores in the k-th's bin, over `SMALL_TILE` (512), listed
    (under `cap`) and counted tile by tile; beside them a row of few candidates."""
    from dserve.attention.triton_topk_rows import SMALL_TILE

    gen = torch.Generator().manual_seed(6)
    tied = torch.cat([torch.full((1500,), 0.5), torch.randn(500, generator=gen) + 5])
    scores = torch.stack([tied, torch.randn(2000, generator=gen)])
    assert SMALL_TILE < 1500  # counted tile by tile
    check(scores, 700)


def test_lens_bound_the_rows_unread():
    """Positions from a row's length on are not chosen whatever they hold (finite here, as
    the engine's scores are not: only `lens` keeps them out)."""
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(3, 500, generator=gen)
    lens = torch.tensor([500, 123, 0])
    got = select_top_rows(scores.to(DEVICE), 40, lens=lens.to(DEVICE), tile=64, num_warps=1)
    assert packed(got.cpu())
    assert chosen(got.cpu()) == stable_top(ragged(scores, lens.tolist()), 40)


def test_launches_of_a_few_rows_each(monkeypatch):
    """Rows past `SPILL_ROWS` take more launches sharing one candidate buffer; the backend's
    rule (`select_top_gpu`) picks this select from `TOP_ROWS_MIN` rows."""
    from dserve.attention import triton_backend, triton_topk_rows

    monkeypatch.setattr(triton_topk_rows, "SPILL_ROWS", 2)
    monkeypatch.setattr(triton_backend, "TOP_ROWS_MIN", 5)
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(5, 200, generator=gen)
    lens = torch.tensor([200, 3, 150, 0, 77])
    want = stable_top(ragged(scores, lens.tolist()), 16)
    got = triton_backend.select_top_gpu(scores.to(DEVICE), 16, lens.to(DEVICE))
    assert packed(got.cpu()) and chosen(got.cpu()) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GLM-5's shapes run on a GPU")
@pytest.mark.parametrize("batch", [1, 32, 128])
@pytest.mark.parametrize("width", [32768, 131072])
def test_glm5_shapes_select_as_torch(batch, width):
    """k 2048 over 32k and 128k scores, contexts ragged (as -inf, and as `lens`): torch's set
    where no score ties at the threshold, else the stable sort's."""
    gen = torch.Generator(device="cuda").manual_seed(batch)
    scores = torch.randn(batch, width, generator=gen, device="cuda") * 10
    lens = torch.randint(1, width + 1, (batch,), generator=gen, device="cuda")
    lens[0] = width
    past = torch.arange(width, device="cuda") >= lens[:, None]
    want = chosen(select_top(scores.masked_fill(past, INF), 2048).cpu())
    got = select_top_rows(scores.masked_fill(past, INF), 2048).cpu()
    assert packed(got) and chosen(got) == want
    got = select_top_rows(scores, 2048, lens=lens).cpu()
    assert packed(got) and chosen(got) == want
    tied = scores.round().masked_fill(past, INF)  # about 80 values: ties at the threshold
    got = select_top_rows(tied, 2048).cpu()
    assert packed(got) and chosen(got) == stable_top(tied.cpu(), 2048)
