"""The Triton top-k of the indexer's scores (`select_top_triton`) against torch: the same set
as `select_top` where no scores tie at the threshold, and everywhere the set of a stable sort
(ties to the lower position: deterministic). Rows of every context length (-inf past it,
shorter than k), ties, zeros of both signs, one chunk per row or many. On a CPU host under
TRITON_INTERPRET=1 at small shapes; at GLM-5's on a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.attention.index_cache import select_top  # noqa: E402
from dserve.attention.triton_topk import select_top_triton, top_hist  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
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


def check(
    scores: torch.Tensor, topk: int, again: bool = False, select=select_top_triton, **launch
) -> torch.Tensor:
    """The kernel's (`select`'s) sets are the stable sort's (`again`: the same on a second
    run, order too); returns them."""
    got = select(scores.to(DEVICE), topk, **launch)
    assert packed(got.cpu()) and chosen(got.cpu()) == stable_top(scores, topk)
    if again:
        assert torch.equal(got, select(scores.to(DEVICE), topk, **launch))
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
    check(tied_rows(), 64, again=True)


def test_many_chunks_place_ties_by_the_chunks_before():
    """Chunks of 16 positions: where each writes and which of the tied it takes come from
    the counts of the chunks before it."""
    gen = torch.Generator().manual_seed(2)
    few = torch.randint(0, 3, (2, 100), generator=gen).float()
    close = 1.0 + torch.randint(0, 4, (1, 100), generator=gen) * 2**-20  # last byte only
    scores = ragged(torch.cat([few, close]), [100, 71, 90])
    check(scores, 24, again=True, chunk=16, block=8)


def test_kept_histograms_serve_calls_of_any_size():
    """A caller's histograms: the kernels clear them for the next call, whatever its rows."""
    gen = torch.Generator().manual_seed(3)
    hist = top_hist(6, DEVICE)
    for rows, width in [(6, 100), (2, 40), (6, 70)]:
        scores = ragged(torch.randn(rows, width, generator=gen), [width] * rows)
        got = select_top_triton(scores.to(DEVICE), 16, hist=hist).cpu()
        assert packed(got) and chosen(got) == stable_top(scores, 16)
        assert not hist[:, :3].any()  # the last level's is cleared as the next call starts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GLM-5's shapes run on a GPU")
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("width", [32768, 131072])
def test_glm5_shapes_select_as_torch(batch, width):
    """k 2048 over 32k and 128k scores, contexts ragged: torch's set where no score ties at
    the threshold, else the stable sort's (rows of few distinct values)."""
    gen = torch.Generator(device="cuda").manual_seed(batch)
    scores = torch.randn(batch, width, generator=gen, device="cuda") * 10
    lens = torch.randint(1, width + 1, (batch,), generator=gen, device="cuda")
    lens[0] = width
    scores = scores.masked_fill(torch.arange(width, device="cuda") >= lens[:, None], INF)
    got = select_top_triton(scores, 2048).cpu()
    assert packed(got) and chosen(got) == chosen(select_top(scores, 2048).cpu())
    tied = scores.round()  # about 80 values: ties at the threshold
    got = select_top_triton(tied, 2048).cpu()
    assert packed(got) and chosen(got) == stable_top(tied.cpu(), 2048)
