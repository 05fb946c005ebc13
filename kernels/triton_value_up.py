"""MLA's value up-projection for an FP8 o_proj, with o_proj's input quantization in it.

In absorbed MLA the attention output leaves latent space per head through W_UV:
out[t, h] = o_latent[t, h] @ W_UV[h].T, then o_proj reads out flattened to [T, H * V]. With an
FP8 o_proj that input is quantized per token and per scale group of o_proj's K blocks (128 for
DeepSeek's block FP8, one head's V = 128 values). Here one program per head and block of
tokens computes the head's product on the tensor cores, rounds it to the model's dtype (as
torch's bmm does) and quantizes it in the same program, so no quantization launch runs
before o_proj. The values are those `triton_fp8.quantize_activations` gives on that rounded
output: e4m3 with a float32 scale per (token, group), token-major, rows padded to a multiple
of 4 with zeros (`QuantizedRows`). A group must lie inside one head (it divides V).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dserve.kernels.triton_fp8 import (
    QuantizedRows,
    attach_quantized,
    e4m3_scale,
    e4m3_values,
)


@triton.jit(do_not_specialize=["tokens", "padded"])
def _value_up_kernel(
    O,
    W,
    Out,
    Q,
    S,
    tokens,
    padded,
    s_o_t,
    s_o_h,
    s_w_h,
    s_w_v,
    R: tl.constexpr,
    V: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Head h, tokens t: Out[t, h*V:(h+1)*V] = O[t, h] @ W[h].T, then its e4m3 form in Q and
    the scales S[g * padded + t] of groups g = h * V / GROUP ...; rows from `tokens` on read
    as zeros, and rows from `padded` on are not written."""
    h, tb = tl.program_id(0), tl.program_id(1)
    width = tl.num_programs(0) * V
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    v = tl.arange(0, V)
    live = t < tokens
    acc = tl.zeros([BLOCK_T, V], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        o_ptrs = O + t[:, None] * s_o_t + h * s_o_h + r[None, :]
        o = tl.load(o_ptrs, mask=live[:, None], other=0.0)
        w = tl.load(W + h * s_w_h + v[:, None] * s_w_v + r[None, :])
        if IEEE:  # float32 exactly (not TF32)
            acc += tl.dot(o, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(o, tl.trans(w))
    y = acc.to(Out.dtype.element_ty)
    cols = h * V + v
    out_ptrs = Out + t[:, None] * width + cols[None, :]
    tl.store(out_ptrs, y, mask=live[:, None])
    groups: tl.constexpr = V // GROUP
    blocks = tl.reshape(y.to(tl.float32), [BLOCK_T, groups, GROUP])
    scale = e4m3_scale(tl.max(tl.abs(blocks), 2))
    q = e4m3_values(blocks, scale[:, :, None])
    q = tl.reshape(q, [BLOCK_T, V]).to(Q.dtype.element_ty)
    rows = t < padded
    tl.store(Q + t[:, None] * width + cols[None, :], q, mask=rows[:, None])
    g = h * groups + tl.arange(0, groups)
    tl.store(S + g[None, :] * padded + t[:, None], scale, mask=rows[:, None])


def takes(rank: int, v_dim: int, group: int) -> bool:
    """Shapes the kernel serves: R and V powers of two of 16 or more, and scale groups of a
    power of two that divide V (each group inside one head)."""

    def power(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0

    return power(rank) and power(v_dim) and 0 < group <= v_dim and v_dim % group == 0


def value_up_quantized(o_latent: torch.Tensor, w_uv: torch.Tensor, group: int) -> torch.Tensor:
    """o_latent [T, H, R] through w_uv [H, V, R] (any strides but the last): [T, H * V] in
    o_latent's dtype, carrying its FP8 form in groups of `group` (`attach_quantized`)."""
    tokens, heads, rank = o_latent.shape
    v_dim = w_uv.shape[1]
    assert takes(rank, v_dim, group), (rank, v_dim, group)
    assert o_latent.stride(-1) == 1 and w_uv.stride(-1) == 1
    out = torch.empty(tokens, heads * v_dim, dtype=o_latent.dtype, device=o_latent.device)
    quantized = QuantizedRows.empty(tokens, heads * v_dim, group, o_latent.device)
    padded = quantized.q.shape[0]
    block_t = 16 if padded <= 16 else 64
    grid = (heads, triton.cdiv(padded, block_t))
    _value_up_kernel[grid](
        o_latent,
        w_uv,
        out,
        quantized.q,
        quantized.scales,
        tokens,
        padded,
        o_latent.stride(0),
        o_latent.stride(1),
        w_uv.stride(0),
        w_uv.stride(1),
        R=rank,
        V=v_dim,
        GROUP=group,
        BLOCK_T=block_t,
        BLOCK_R=min(64, rank),
        IEEE=o_latent.dtype == torch.float32,
        num_warps=4,
        num_stages=3,
    )
    return attach_quantized(out, quantized)
