"""The page gather behind FlashInfer's `kv_indices` against a boolean mask over the page table
(what `flashinfer_backend.page_lists` did before, with a host sync): rows of different lengths,
empty ones, more pages than a block, an int64 table with spare columns, a buffer to fill. On a CPU
host under TRITON_INTERPRET=1; on a GPU on the device (no flashinfer needed)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.attention.flashinfer_backend import page_lists  # noqa: E402
from dserve.attention.triton_pages import gather_pages  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`


def masked_pages(table: torch.Tensor, counts: list[int]) -> torch.Tensor:
    used = torch.arange(table.shape[1]) < torch.tensor(counts)[:, None]
    return table.cpu()[used].to(torch.int32)


def indptr_of(counts: list[int]) -> torch.Tensor:
    sums = torch.tensor([0, *counts]).cumsum(0)
    return sums.to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_gathered_pages_are_the_masked_ones(dtype):
    gen = torch.Generator().manual_seed(5)
    counts = [3, 0, 300, 1, 17]  # 300: more than one block of 256
    wide = torch.randint(0, 10_000, (len(counts), 320), generator=gen, dtype=dtype)
    table = wide.to(DEVICE)[:, :310]  # spare columns: the row stride is not the width
    got = gather_pages(table, indptr_of(counts), sum(counts))
    assert got.dtype == torch.int32
    assert torch.equal(got.cpu(), masked_pages(table, counts))


def test_a_buffer_is_filled_in_place_and_nothing_past_the_total():
    table = torch.arange(40, dtype=torch.int32).view(4, 10).to(DEVICE)
    counts = [2, 5, 0, 1]
    buffer = torch.full((20,), -7, dtype=torch.int32, device=DEVICE)
    got = gather_pages(table, indptr_of(counts), 8, out=buffer)
    assert got.data_ptr() == buffer.data_ptr()
    assert got.tolist() == [0, 1, 10, 11, 12, 13, 14, 30]
    assert buffer[8:].tolist() == [-7] * 12


def test_entries_read_the_table_rows_they_name():
    """A static pass lists one entry per token, each reading its span's row (`rows`), into the
    graph's buffer: entries 0-2 read row 1 (a chain of three tokens), 3 row 0, 4 row 2."""
    table = torch.arange(30, dtype=torch.int32).view(3, 10).to(DEVICE)
    counts = [1, 2, 3, 4, 1]
    rows = torch.tensor([1, 1, 1, 0, 2], device=DEVICE)
    buffer = torch.full((16,), -7, dtype=torch.int32, device=DEVICE)
    got = gather_pages(table, indptr_of(counts), 16, out=buffer, rows=rows)
    assert got.data_ptr() == buffer.data_ptr()
    assert buffer[:11].tolist() == [10, 10, 11, 10, 11, 12, 0, 1, 2, 3, 20]
    assert buffer[11:].tolist() == [-7] * 5


def test_no_rows_or_no_pages_launch_nothing():
    table = torch.zeros(0, 4, dtype=torch.int32, device=DEVICE)
    assert gather_pages(table, indptr_of([]), 0).numel() == 0
    table = torch.ones(2, 4, dtype=torch.int32, device=DEVICE)
    assert gather_pages(table, indptr_of([0, 0]), 0).numel() == 0


def test_page_lists_gives_flashinfers_csr_form():
    page_size, seq_lens, q_lens = 4, [1, 9, 4, 13], [1, 3, 4, 2]
    table = torch.arange(100, 100 + 4 * 6, dtype=torch.int32).view(4, 6).to(DEVICE)
    batch = SimpleNamespace(page_table=table, q_lens=q_lens, seq_lens=seq_lens)
    lists = {k: v.cpu().tolist() for k, v in page_lists(batch, page_size).items()}
    assert lists["qo_indptr"] == [0, 1, 4, 8, 10]
    assert lists["kv_indptr"] == [0, 1, 4, 5, 9]
    assert lists["kv_lens"] == seq_lens
    assert lists["last_page_lens"] == [1, 1, 4, 1]
    counts = [1, 3, 1, 4]
    assert lists["kv_indices"] == masked_pages(table, counts).tolist()


def test_a_static_pass_is_one_request_per_token():
    """Under CUDA graphs (`flashinfer_graphs.GraphPlan.prepare`) each token of a padded pass is
    one query over the context it sees: a chain of three tokens over 9-11 positions, a decode
    token over 4, a pad token over 1."""
    from dserve.attention.flashinfer_graphs import csr_lists

    ctx_lens = np.array([9, 10, 11, 4, 1])
    lists = {k: v.tolist() for k, v in csr_lists(np.ones(5), ctx_lens, 4).items()}
    assert lists["qo_indptr"] == [0, 1, 2, 3, 4, 5]
    assert lists["kv_indptr"] == [0, 3, 6, 9, 10, 11]
    assert lists["kv_lens"] == [9, 10, 11, 4, 1]
    assert lists["last_page_lens"] == [1, 2, 3, 4, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_at_a_decode_batch_of_long_contexts():
    """128 sequences of up to 2048 pages (128k tokens in pages of 64), int32 as the pool's."""
    gen = torch.Generator().manual_seed(9)
    counts = torch.randint(0, 2049, (128,), generator=gen).tolist()
    table = torch.randint(0, 1 << 20, (128, 2048), generator=gen, dtype=torch.int32).cuda()
    got = gather_pages(table, indptr_of(counts), sum(counts))
    assert torch.equal(got.cpu(), masked_pages(table, counts))
