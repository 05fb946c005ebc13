"""The read-only floors' kernels (`bench.read_floor`) read what they time:
the gather's sums are the selected rows' through the page table, the
read's the tensor's words. CPU: Triton's interpreter; a GPU where there
is one."""

from __future__ import annotations

import pytest
import torch

from bench.read_floor import gather_sums, read_sums

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`


@pytest.mark.parametrize("shape", [(16, 1, 4), (8, 3, 4)])
def test_the_gather_sums_the_selected_rows(shape):
    """Row b's positions, -1 skipped and past the width masked, each
    through table[b]'s pages; the sums per program add up to the rows'."""
    gen = torch.Generator().manual_seed(0)
    page, pages, batch, width = 4, 6, 2, 37
    cache = torch.randn(batch * pages, page, 576, generator=gen).to(torch.bfloat16)
    table = torch.randperm(batch * pages, generator=gen).to(torch.int32).view(batch, pages)
    selected = torch.randint(0, pages * page, (batch, width), generator=gen)
    selected[0, 5] = -1
    got = gather_sums(cache.to(DEVICE), table.to(DEVICE), selected.to(DEVICE), shape)
    for b in range(batch):
        pos = selected[b][selected[b] >= 0]
        rows = cache[table[b].long()[pos // page], pos % page].float()
        want = rows.sum(0)
        torch.testing.assert_close(got[b].sum(0).cpu(), want, rtol=1e-4, atol=1e-3)


def test_the_read_sums_every_word():
    """Each tensor's bytes as int32 words, summed with int32's wrap."""
    gen = torch.Generator().manual_seed(1)
    keys = torch.randint(0, 256, (3, 8, 132), dtype=torch.uint8, generator=gen)
    scales = torch.randn(3, 8, generator=gen)
    sums = read_sums([keys.to(DEVICE), scales.to(DEVICE)], (64, 2, 4))
    for t, s in zip((keys, scales), sums):
        words = t.reshape(-1).view(torch.uint8).view(torch.int32).long()
        want = (words.sum() + 2**31) % 2**32 - 2**31
        assert s.long().sum().item() % 2**32 == want.item() % 2**32
