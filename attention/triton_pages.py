"""Each sequence's pages, one sequence after another, gathered from the page table on the device:
FlashInfer's `kv_indices` (CSR column indices of the paged KV). A boolean mask over the page table
(what `flashinfer_backend.page_lists` used) reads its count back to the host, a sync per pass; here
the offsets come from the host, which knows the context lengths, and one launch fills the list.
This is also the piece a CUDA graph needs: the list is written into a buffer of fixed address,
from the graph's static page table, with a table row per entry (a static pass lists one entry
per token, each reading its span's row)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["s_pt_b"])
def _gather_kernel(Table, Indptr, Rows, Out, s_pt_b, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Program b: the first Indptr[b + 1] - Indptr[b] pages of row b (Rows[b] where ROWS), to
    Out[Indptr[b]:]."""
    b = tl.program_id(0)
    start = tl.load(Indptr + b)
    count = tl.load(Indptr + b + 1) - start
    r = tl.load(Rows + b) if ROWS else b
    row = Table + r.to(tl.int64) * s_pt_b
    for j in range(0, count, BLOCK):
        idx = j + tl.arange(0, BLOCK)
        inside = idx < count
        pages = tl.load(row + idx, mask=inside, other=0)
        tl.store(Out + start + idx, pages.to(tl.int32), mask=inside)


def gather_pages(
    page_table: torch.Tensor,
    kv_indptr: torch.Tensor,
    total: int,
    out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """page_table [S, max_pages] (unit column stride), kv_indptr [B + 1] int32 on the same device
    (page offsets: a prefix sum of each entry's page count), `total` = kv_indptr[-1] (known on
    the host; with `out`, any bound of it) -> int32 [total]: entry 0's pages, then entry 1's, ...
    Entry b reads table row b, or `rows[b]` where given ([B] ints). `out`: a buffer of at least
    `total` entries to fill instead (the first `total` are returned)."""
    assert page_table.stride(-1) == 1 and kv_indptr.dtype == torch.int32
    if out is None:
        out = torch.empty(total, dtype=torch.int32, device=page_table.device)
    batch = kv_indptr.numel() - 1
    if batch > 0 and total > 0:
        _gather_kernel[(batch,)](
            page_table,
            kv_indptr,
            kv_indptr if rows is None else rows,
            out,
            page_table.stride(0),
            BLOCK=256,
            ROWS=rows is not None,
        )
    return out[:total]
