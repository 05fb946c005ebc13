"""Triton store of the new tokens' KV into their pages: one launch writes every token's row of one or
two buffers (MLA's latent; MHA's K and V together) at its slot (page * page_size + offset), where
`KVPool.write` takes three small kernels per buffer. Rows are cast to the pool's dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n0", "n1"])
def _store_kernel(
    Slots,
    Src0,
    Dst0,
    Src1,
    Dst1,
    s_s0,
    s_d0_page,
    s_d0_tok,
    n0,
    s_s1,
    s_d1_page,
    s_d1_tok,
    n1,
    page_size,
    TWO: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(Slots + t).to(tl.int64)
    page, off = slot // page_size, slot % page_size
    m0 = cols < n0
    row = tl.load(Src0 + t.to(tl.int64) * s_s0 + cols, mask=m0)
    tl.store(
        Dst0 + page * s_d0_page + off * s_d0_tok + cols, row.to(Dst0.dtype.element_ty), mask=m0
    )
    if TWO:
        m1 = cols < n1
        row = tl.load(Src1 + t.to(tl.int64) * s_s1 + cols, mask=m1)
        tl.store(
            Dst1 + page * s_d1_page + off * s_d1_tok + cols, row.to(Dst1.dtype.element_ty), mask=m1
        )


def store_tokens(slots: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`pairs` of (pages [num_pages, page_size, *token_shape], values [T, *token_shape]), one or two;
    token t's row goes to slot `slots[t]` of each."""
    tokens = slots.shape[0]
    if not tokens:
        return
    args, widths = [], []
    for pages, values in pairs + pairs[:1] * (2 - len(pairs)):
        src = values.reshape(tokens, -1)
        width = src.shape[1]
        assert pages[0, 0].numel() == width and pages[0, 0].is_contiguous() and src.stride(-1) == 1
        args += [src, pages]
        widths.append((src.stride(0), pages.stride(0), pages.stride(1), width))
    widest = max(w[3] for w in widths)
    block = min(1024, triton.next_power_of_2(widest))
    _store_kernel[(tokens, triton.cdiv(widest, block))](
        slots, *args, *widths[0], *widths[1], pairs[0][0].shape[1], TWO=len(pairs) == 2, BLOCK=block
    )
