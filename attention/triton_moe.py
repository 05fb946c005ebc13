"""Triton fused MoE: the routed experts of a batch as two grouped GEMMs, with no host sync.

The (token, slot) pairs are sorted by expert on the device into a buffer of static size (each
expert's run padded to a multiple of BLOCK_M, pairs of experts this rank does not hold left out), so
the launch shape depends only on the batch size: a CUDA graph can hold it. Each program takes one
BLOCK_M run of one expert and a BLOCK_N slice of the output: gate/up for every pair, then
SiLU(gate) * up, then down scaled by the pair's routing weight; the slots of a token are summed last.
Same arithmetic as `models.layers.moe.Experts.forward` up to rounding (float32 accumulation, one
rounding to the activation dtype per GEMM). FP8 experts (`models/quant.py`) are read as FP8, one
byte per weight, and scaled per output row and K block in the program before the product with
the activations (weight-only FP8: a decode step's experts are bound by the bytes they read).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm(
    a_ptr,
    w_ptr,
    out_ptr,
    pairs_ptr,
    block_expert_ptr,
    scale_ptr,
    ws_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_wse,
    stride_wsn,
    group_k,
    FP8: tl.constexpr,
    TOP_K: tl.constexpr,
    ROWS_PER_TOKEN: tl.constexpr,
    SCALE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pair < num_pairs
        row = pair // TOP_K if ROWS_PER_TOKEN else pair
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                a_ptr + row[:, None] * stride_am + offs_k[None, :],
                mask=valid[:, None] & (offs_k[None, :] < K),
                other=0.0,
            )
            w = tl.load(
                w_ptr
                + expert * stride_we
                + offs_n[None, :] * stride_wn
                + offs_k[:, None] * stride_wk,
                mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
                other=0.0,
            )
            if FP8:  # this K block's scale of each output row
                s = tl.load(
                    ws_ptr + expert * stride_wse + offs_n * stride_wsn + k0 // group_k,
                    mask=offs_n < N,
                    other=0.0,
                )
                w = (w.to(tl.float32) * s[None, :]).to(a.dtype)
            acc += tl.dot(a, w, input_precision=PRECISION)
        if SCALE:
            acc *= tl.load(scale_ptr + pair, mask=valid, other=0.0)[:, None]
        tl.store(
            out_ptr + pair[:, None] * stride_om + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=valid[:, None] & (offs_n[None, :] < N),
        )


def sort_pairs(
    ids: torch.Tensor, first: int, num_local: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, block_expert): the flat (token, slot) pair indices grouped by local expert, each
    expert's run padded to `block_m` with the sentinel `ids.numel()`, in a buffer of static size;
    and per BLOCK_M run its local expert (-1: padding past the last run). Pairs routed to experts
    outside [first, first + num_local) are left out."""
    flat = ids.reshape(-1) - first
    flat = torch.where((flat >= 0) & (flat < num_local), flat, num_local)  # num_local: not here
    n = flat.numel()
    capacity = -(-(n + num_local * (block_m - 1)) // block_m) * block_m
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    # not bincount: it syncs on CUDA
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    here = expert < num_local
    clamped = expert.clamp(max=num_local - 1)
    position = (
        padded_end[clamped] - padded[clamped] + torch.arange(n, device=ids.device) - start[expert]
    )
    # the pairs not here all land in one dropped slot
    position = torch.where(here, position, capacity)
    pairs = torch.full((capacity + 1,), n, dtype=torch.int64, device=ids.device)
    pairs.scatter_(0, position, order)
    block_start = torch.arange(0, capacity, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_local, block_expert, -1)
    return pairs[:capacity], block_expert


def default_block_m(pairs: int, num_experts: int) -> int:
    """Rows per program: twice the mean pairs per expert, a power of two in [16, 128]. A program reads
    its expert's weights once per row block, so an expert should mostly fit one block; the choice
    depends on shapes only (a CUDA graph keeps it)."""
    want = max(16, min(128, 2 * pairs // max(num_experts, 1)))
    return 1 << (want - 1).bit_length()


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first: int = 0,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8_block: int = 0,
) -> torch.Tensor:
    """sum over slots s of weights[t, s] * down_e(SiLU(gate_e(x_t)) * up_e(x_t)), e = ids[t, s], for
    the experts held here (w13 [E, 2I, H] gate then up, w2 [E, H, I], experts first .. first+E-1).
    FP8 weights come with `scales` (w13's and w2's, [E, rows, K blocks]) of `fp8_block` inputs."""
    tokens, top_k = ids.shape
    num_local, two_i, hidden = w13.shape
    n = tokens * top_k
    if n == 0:
        return torch.zeros_like(x)
    block_m = block_m or default_block_m(n, num_local)
    pairs, block_expert = sort_pairs(ids, first, num_local, block_m)
    gate_up = torch.empty(n, two_i, dtype=x.dtype, device=x.device)
    down = torch.zeros(n, hidden, dtype=x.dtype, device=x.device)
    scale = weights.reshape(-1).float().contiguous()
    if scales is not None and scales[0].shape[-1] > 1:
        block_k = min(block_k, fp8_block)  # one scale per K tile

    def launch(a, w, out, rows_per_token, use_scale, N, K, ws):
        fp8 = ws is not None
        ws = ws if fp8 else scale  # any tensor: not read
        group = (K if ws.shape[-1] == 1 else fp8_block) if fp8 else 1  # one column: per channel
        grid = (block_expert.numel(), triton.cdiv(N, block_n))
        _grouped_gemm[grid](
            a,
            w,
            out,
            pairs,
            block_expert,
            scale,
            ws,
            n,
            N,
            K,
            a.stride(0),
            w.stride(0),
            w.stride(1),
            w.stride(2),
            out.stride(0),
            ws.stride(0),
            ws.stride(1) if fp8 else 0,
            group,
            FP8=fp8,
            TOP_K=top_k,
            ROWS_PER_TOKEN=rows_per_token,
            SCALE=use_scale,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32 stays exact
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )

    ws13, ws2 = scales if scales is not None else (None, None)
    launch(x.contiguous(), w13, gate_up, True, False, two_i, hidden, ws13)
    gate, up = gate_up.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()
    launch(act, w2, down, False, True, hidden, two_i // 2, ws2)
    return down.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
