"""Triton attention for MLA prefill in its expanded form (`mla_expanded.py`): the spans' queries
over their contexts' decompressed per-head keys and values, causally (each span's tokens are the
last of its context).

A head's key is 128 no-RoPE dims of its own and the 64-dim RoPE key every head shares, so the
kernel takes them apart: `k_nope` [S, H, N], `k_rope` [S, P] (one a position, read by every
head's program from the cache), values [S, H, V], the spans' contexts one after another, dense
(not paged), span i's from `starts[i]`. Scores are two products summed (192 is no power of two).

A program takes one head and up to `rows` consecutive query tokens of one span (an `ExtendPlan`
block, as `triton_extend`'s MHA kernel with one head a program) and walks the span's context in
blocks of `block_n` keys with an online softmax in float32: the blocks every row sees whole run
unmasked, only those across the diagonal masked. The grid runs a head's blocks together (they
read the same keys and values, which then come from L2), the furthest-reaching first, so that
the shortest fill the end. Checked against PyTorch's
attention (`tests/attention/test_triton_expanded.py`), under `TRITON_INTERPRET=1` on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dserve.attention.triton_extend import (
    ExtendPlan,
    _block_rows,
    _seen_by_all,
    _visible,
    plan_extend,
    stages,
)
from dserve.attention.triton_mla import _dot, _online_softmax_step


def plan_blocks(q_lens, seq_lens, spans: list[int], rows: int, device) -> ExtendPlan:
    """The work blocks of `spans` (causal), the furthest-reaching first."""
    plan = plan_extend(q_lens, seq_lens, None, rows, device, only=set(spans))
    reach = plan.ctx_lens[plan.blocks[:, 2].long() - 1]
    plan.blocks = plan.blocks[reach.argsort(descending=True)].contiguous()
    return plan


@triton.jit
def _load_rows(ptr, offsets, rmask, DIM: tl.constexpr, PAD: tl.constexpr):
    """[rows, PAD] from `ptr` + row `offsets`: zeros on masked rows and past `DIM` columns
    (padding to a power of two)."""
    cols = tl.arange(0, PAD)
    if DIM == PAD:
        mask = rmask[:, None]
    else:
        mask = rmask[:, None] & (cols[None, :] < DIM)
    return tl.load(ptr + offsets[:, None] + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _expanded_kernel(
    QN,
    QR,
    KN,
    KR,
    V,
    Out,
    Starts,
    Blocks,
    CtxLens,
    s_qn_t,
    s_qn_h,
    s_qr_t,
    s_qr_h,
    s_kn_t,
    s_kn_h,
    s_kr_t,
    s_v_t,
    s_v_h,
    s_o_t,
    s_o_h,
    scale,
    N: tl.constexpr,
    P: tl.constexpr,
    DV: tl.constexpr,
    N_PAD: tl.constexpr,
    P_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    span, toks, _, tmask, ctx, _ = _block_rows(Blocks, CtxLens, CtxLens, BLOCK_M, 1)
    head = tl.program_id(1)
    t64 = toks.to(tl.int64)
    qn = _load_rows(QN + head * s_qn_h, t64 * s_qn_t, tmask, N, N_PAD)
    qr = _load_rows(QR + head * s_qr_h, t64 * s_qr_t, tmask, P, P_PAD)
    first = tl.load(Starts + span).to(tl.int64)  # the span's context in K/V
    kn_head, v_head = KN + head * s_kn_h, V + head * s_v_h
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    end = tl.max(ctx, 0)  # the furthest position any row sees
    seen = _seen_by_all(tmask, ctx, end, BLOCK_N, False)
    for phase in tl.static_range(2):  # blocks [0, seen) unmasked, then [seen, end) masked
        lo, hi = seen * phase, seen + (end - seen) * phase
        for n0 in range(lo, hi, BLOCK_N):
            kv = n0 + tl.arange(0, BLOCK_N)
            kmask, pos = kv < end, first + kv
            kn = _load_rows(kn_head, pos * s_kn_t, kmask, N, N_PAD)
            kr = _load_rows(KR, pos * s_kr_t, kmask, P, P_PAD)
            v = _load_rows(v_head, pos * s_v_t, kmask, DV, DV_PAD)
            s = _dot(qn, tl.trans(kn), IEEE) + _dot(qr, tl.trans(kr), IEEE)
            vis = _visible(CtxLens, 0, toks, tmask, ctx, ctx, kv, False, phase)
            m, l, acc = _online_softmax_step(s * scale, vis, v, m, l, acc, IEEE)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    dv = tl.arange(0, DV_PAD)
    omask = tmask[:, None] & (dv[None, :] < DV)
    ptrs = Out + t64[:, None] * s_o_t + head * s_o_h + dv[None, :]
    tl.store(ptrs, out.to(Out.dtype.element_ty), mask=omask)


def expanded_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor,
    plan: ExtendPlan,
    scale: float,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int | None = None,
) -> torch.Tensor:
    """q_nope [T, H, N], q_rope [T, H, P] (the pass's tokens, span after span); k_nope
    [S, H, N], k_rope [S, P], values [S, H, V]: the contexts, span i's from `starts[i]`
    (int32 [B]). Returns [T, H, V], written on the rows of the plan's blocks (`plan_blocks`)."""
    tokens, heads, nope = q_nope.shape
    rope, v_dim = q_rope.shape[-1], values.shape[-1]
    out = q_nope.new_empty(tokens, heads, v_dim)
    parts = (q_nope, q_rope, k_nope, k_rope, values)
    assert all(t.stride(-1) == 1 for t in parts)
    if not plan.blocks.shape[0]:
        return out

    def pad(dim: int) -> int:  # tensor-core products need 16 columns at least
        return max(16, triton.next_power_of_2(dim))

    _expanded_kernel[(plan.blocks.shape[0], heads)](
        q_nope, q_rope, k_nope, k_rope, values, out,
        starts, plan.blocks, plan.ctx_lens,
        q_nope.stride(0), q_nope.stride(1),
        q_rope.stride(0), q_rope.stride(1),
        k_nope.stride(0), k_nope.stride(1),
        k_rope.stride(0),
        values.stride(0), values.stride(1),
        out.stride(0), out.stride(1),
        scale,
        N=nope, P=rope, DV=v_dim,
        N_PAD=pad(nope), P_PAD=pad(rope), DV_PAD=pad(v_dim),
        BLOCK_M=plan.block_m,
        BLOCK_N=block_n,
        IEEE=q_nope.dtype == torch.float32,
        num_warps=num_warps,
        **stages(num_stages),
    )  # fmt: skip
    return out
