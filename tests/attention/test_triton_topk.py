"""The Triton top-k of the indexer's scores (`select_top_triton`) against torch: the same set
as `select_top` where no scores tie at the threshold, and everywhere the set of a stable sort
(ties to the lower position), the same output (order too) on a second run. Rows of every
context length (-inf past it, or `lens`; shorter than k), ties, zeros of both signs, +inf,
one chunk per row or many placing their positions by the chunks before, scores outside the
sampled bins, more candidates than a tile or than the list holds, kept histograms zeroed
for the next call. On a CPU host under TRITON_INTERPRET=1 at small shapes; at GLM-5's on a
GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.attention.index_cache import select_top  # noqa: E402
from dserve.attention.triton_topk import select_top_triton, top_hist  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`
INF = float("-inf")


def ragged(scores: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """`scores` with -inf past each row's context length."""
    past = torch.arange(scores.shape[1])[None, :] >= torch.tensor(lens)[:, None]
    return scores.masked_fill(past, INF)


def stable_top(scores: torch.Tensor, topk: int) -> list[set[int]]:
    """Per row the positions of the `topk` highest finite scores, ties to the lower
    position."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    finite = (scores > INF).sum(-1).tolist()
    return [set(order[r, : min(topk, n)].tolist()) for r, n in enumerate(finite)]


def chosen(selection: torch.Tensor) -> list[set[int]]:
    """Per row the selected positions (not -1)."""
    return [{p for p in row if p >= 0} for row in selection.tolist()]


def packed(selection: torch.Tensor) -> bool:
    """Whether every row holds its positions once each, then only -1s."""
    for row in selection.tolist():
        n = sum(p >= 0 for p in row)
        if len(set(row[:n])) < n or row[n:] != [-1] * (len(row) - n):
            return False
    return True


def distinct_rows(width: int, topk: int) -> torch.Tensor:
    """Four rows without ties: all negative, all positive, mixed; shorter than k, empty."""
    gen = torch.Generator().manual_seed(width + topk)
    scores = torch.randn(4, width, generator=gen) * torch.tensor([[1.0], [50.0], [1e-3], [7.0]])
    scores += torch.tensor([[0.0], [-100.0], [0.5], [3.0]])
    return ragged(scores, [width, width // 2, min(width, topk - 1), 0])


def check(scores: torch.Tensor, topk: int, again: bool = True, **launch) -> torch.Tensor:
    """The select's sets are the stable sort's (`again`: the same on a second run, order
    too); returns them."""
    got = select_top_triton(scores.to(DEVICE), topk, **launch)
    assert packed(got.cpu()) and chosen(got.cpu()) == stable_top(scores, topk)
    if again:
        assert torch.equal(got, select_top_triton(scores.to(DEVICE), topk, **launch))
    return got.cpu()


@pytest.mark.parametrize(
    "width,topk,chunk", [(1, 4, None), (7, 4, None), (64, 16, None), (300, 64, None), (200, 8, 32)]
)
def test_distinct_scores_select_as_torch(width, topk, chunk):
    scores = distinct_rows(width, topk)
    launch = {"chunk": chunk, "block": 16} if chunk else {}
    got = check(scores, topk, **launch)
    assert chosen(got) == chosen(select_top(scores, topk))


def tied_rows() -> torch.Tensor:
    """Rows of 300 scores with ties: few values, one value, zeros of both signs, values that
    differ in the last byte only, +inf; contexts of every length."""
    gen = torch.Generator().manual_seed(1)
    few = torch.randint(-3, 4, (2, 300), generator=gen).float()  # 7 values
    same = torch.full((2, 300), 2.5)
    zeros = torch.zeros(2, 300)
    zeros[:, ::3] = -0.0  # one key with +0: ties, not an order
    zeros[1, 250:] = 1.0
    close = 1.0 + torch.randint(0, 4, (1, 300), generator=gen) * 2**-20
    top = torch.randn(1, 300, generator=gen)
    top[0, [5, 77, 299]] = float("inf")
    rows = torch.cat([few, same, zeros, close, top])
    return ragged(rows, [300, 200, 300, 9, 300, 280, 300, 300])


def test_ties_take_the_lowest_positions():
    check(tied_rows(), 64)
    check(tied_rows(), 24, chunk=32, block=16)


def test_many_chunks_place_ties_by_the_chunks_before():
    """Chunks of 16 positions: where each writes and which of the tied it takes come from
    the counts of the chunks before it."""
    gen = torch.Generator().manual_seed(2)
    few = torch.randint(0, 3, (2, 100), generator=gen).float()
    close = 1.0 + torch.randint(0, 4, (1, 100), generator=gen) * 2**-20  # last byte only
    scores = ragged(torch.cat([few, close]), [100, 71, 90])
    check(scores, 24, chunk=16, block=8)


def test_scores_outside_the_sampled_bins_select_exactly(monkeypatch):
    """The bins span a sample of the row (`SAMPLE` positions spread over it, 64 here): the
    highest and lowest scores, unsampled, fall in the end bins; a row whose sampled
    positions are all -inf puts every finite score in one bin."""
    from dserve.attention import triton_topk

    monkeypatch.setattr(triton_topk, "SAMPLE", 64)
    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(2, 1000, generator=gen)
    sampled = torch.arange(64) * 1000 // 64
    unsampled = torch.tensor(sorted(set(range(1000)) - set(sampled.tolist()))[:40])
    scores[0, unsampled[:20]] = 1e6 + torch.arange(20.0)  # over the sample's highest
    scores[0, unsampled[20:]] = -1e6  # under its lowest
    scores[1, sampled] = INF
    for topk in (10, 30, 500):
        check(scores, topk, chunk=256, block=64)


def test_candidates_past_a_tile_and_past_the_list():
    """The k-th's bin holding 1500 tied scores: more than `SMALL_TILE` (read a tile at a
    time) and, with a list of 8 (`CAP`), more than it lists (read from the whole row)."""
    from dserve.attention import triton_topk

    gen = torch.Generator().manual_seed(6)
    tied = torch.cat([torch.full((1500,), 0.5), torch.randn(500, generator=gen) + 5])
    scores = torch.stack([tied, torch.randn(2000, generator=gen)])
    assert triton_topk.SMALL_TILE < 1500 and triton_topk.INTERPRETED_SMALL_TILE < 1500
    check(scores, 700)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_topk, "CAP", 8)
        check(scores, 700, chunk=512, block=256)


def test_lens_bound_the_rows_unread():
    """Positions from a row's length on are not chosen whatever they hold (finite here, as
    the engine's scores are not: only `lens` keeps them out)."""
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(3, 500, generator=gen)
    lens = torch.tensor([500, 123, 0])
    got = select_top_triton(scores.to(DEVICE), 40, lens.to(DEVICE), chunk=128, block=64)
    assert packed(got.cpu())
    assert chosen(got.cpu()) == stable_top(ragged(scores, lens.tolist()), 40)


def test_kept_histograms_serve_calls_of_any_size():
    """A caller's histograms: the last launch zeroes them for the next call, whatever its rows."""
    gen = torch.Generator().manual_seed(3)
    hist = top_hist(6, DEVICE)
    for rows, width in [(6, 100), (2, 40), (6, 70)]:
        scores = ragged(torch.randn(rows, width, generator=gen), [width] * rows)
        got = select_top_triton(scores.to(DEVICE), 16, hist=hist).cpu()
        assert packed(got) and chosen(got) == stable_top(scores, 16)
        assert not hist.any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GLM-5's shapes run on a GPU")
@pytest.mark.parametrize("batch", [1, 32, 128])
@pytest.mark.parametrize("width", [32768, 131072])
def test_glm5_shapes_select_as_torch(batch, width):
    """k 2048 over 32k and 128k scores, contexts ragged (as -inf, and as `lens`): torch's set
    where no score ties at the threshold, else the stable sort's (rows of few values)."""
    gen = torch.Generator(device="cuda").manual_seed(batch)
    scores = torch.randn(batch, width, generator=gen, device="cuda") * 10
    lens = torch.randint(1, width + 1, (batch,), generator=gen, device="cuda")
    lens[0] = width
    past = torch.arange(width, device="cuda") >= lens[:, None]
    want = chosen(select_top(scores.masked_fill(past, INF), 2048).cpu())
    got = select_top_triton(scores.masked_fill(past, INF), 2048).cpu()
    assert packed(got) and chosen(got) == want
    got = select_top_triton(scores, 2048, lens).cpu()
    assert packed(got) and chosen(got) == want
    tied = scores.round().masked_fill(past, INF)  # about 80 values: ties at the threshold
    got = select_top_triton(tied, 2048, lens).cpu()
    assert packed(got) and chosen(got) == stable_top(tied.cpu(), 2048)
