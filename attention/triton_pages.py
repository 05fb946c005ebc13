"""Each sequence's pages, one sequence after another, gathered from the page table on the device:
FlashInfer's `kv_indices` (CSR column indices of the paged KV). A boolean mask over the page table
(what `flashinfer_backend.page_lists` used) reads its count back to the host, a sync per pass; here
the offsets come from the host, which knows the context lengths, and one launch fills the list.
This is also the piece a CUDA graph needs: the list is written into a buffer of fixed address."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["s_pt_b"])
def _gather_kernel(Table, Indptr, Out, s_pt_b, BLOCK: tl.constexpr):
    """Program b: the first Indptr[b + 1] - Indptr[b] pages of row b, to Out[Indptr[b]:]."""
    b = tl.program_id(0)
    start = tl.load(Indptr + b)
    count = tl.load(Indptr + b + 1) - start
    row = Table + b.to(tl.int64) * s_pt_b
    for j in range(0, count, BLOCK):
        idx = j + tl.arange(0, BLOCK)
        inside = idx < count
        pages = tl.load(row + idx, mask=inside, other=0)
        tl.store(Out + start + idx, pages.to(tl.int32), mask=inside)


def gather_pages(
    page_table: torch.Tensor, kv_indptr: torch.Tensor, total: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """page_table [B, max_pages] (row b: sequence b's pages, unit column stride), kv_indptr
    [B + 1] int32 on the same device (page offsets: a prefix sum of each row's page count),
    `total` = kv_indptr[-1] (known on the host) -> int32 [total]: row 0's pages, then row 1's, ...
    `out`: a buffer of at least `total` entries to fill instead (the first `total` are returned)."""
    assert page_table.stride(-1) == 1 and kv_indptr.dtype == torch.int32
    if out is None:
        out = torch.empty(total, dtype=torch.int32, device=page_table.device)
    batch = kv_indptr.numel() - 1
    if batch > 0 and total > 0:
        grid = (batch,)
        _gather_kernel[grid](page_table, kv_indptr, out, page_table.stride(0), BLOCK=256)
    return out[:total]
