"""Triton rotary embedding: one launch rotates a [tokens, heads, dim] tensor where the torch code
(`models.layers.rotary.RotaryEmbedding.apply`) takes about eight small kernels.

Same arithmetic as the torch code, rounding for rounding, in bf16: each product (x1 * cos, ...) is
rounded to bf16 before the sum, as torch's elementwise ops do, so greedy tokens do not move. Left to
itself the GPU compiler contracts a product and the sum into one FMA (rounded once); in bf16 the
rounding is inline PTX, which it cannot fuse. In float32 results differ from torch's in the last
bit, so the model keeps float32 (and fp16) on the torch code. DeepSeek's interleaved pairs
(x[0::2], x[1::2]) come out de-interleaved, and features past `rotary_dim` (GLM's partial rotary)
are copied, both as the torch code does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rounded(x, dt: tl.constexpr, ASM: tl.constexpr):
    """float32 x rounded to bf16 precision (nearest even), kept in float32. On a GPU through inline
    PTX, which the compiler can neither fold away nor fuse into an FMA with the product before it."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 t; cvt.rn.bf16.f32 t, $1; cvt.f32.bf16 $0, t; }",
            "=r,r",
            [x],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    return x.to(dt).to(tl.float32)


@triton.jit
def _rotary_kernel(
    X,
    Out,
    Cos,
    Sin,
    s_x_t,
    s_x_h,
    s_o_t,
    s_o_h,
    s_c_t,
    heads,
    dim,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
    ASM: tl.constexpr,
):
    t, hb = tl.program_id(0), tl.program_id(1)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < heads
    i = tl.arange(0, HALF)
    cos = tl.load(Cos + t * s_c_t + i).to(tl.float32)[None, :]
    sin = tl.load(Sin + t * s_c_t + i).to(tl.float32)[None, :]
    src = X + t * s_x_t + h[:, None] * s_x_h
    dst = Out + t * s_o_t + h[:, None] * s_o_h
    first, second = (2 * i, 2 * i + 1) if INTERLEAVED else (i, i + HALF)
    x1 = tl.load(src + first[None, :], mask=hmask[:, None], other=0.0)
    x2 = tl.load(src + second[None, :], mask=hmask[:, None], other=0.0)
    dt = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    o1 = _rounded(a * cos, dt, ASM) - _rounded(b * sin, dt, ASM)
    o2 = _rounded(b * cos, dt, ASM) + _rounded(a * sin, dt, ASM)
    tl.store(dst + i[None, :], o1.to(dt), mask=hmask[:, None])
    tl.store(dst + HALF + i[None, :], o2.to(dt), mask=hmask[:, None])
    rest = 2 * HALF + tl.arange(0, BLOCK_P)  # features past the rotary ones pass through
    keep = hmask[:, None] & (rest[None, :] < dim)
    tl.store(dst + rest[None, :], tl.load(src + rest[None, :], mask=keep, other=0.0), mask=keep)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """x [tokens, heads, dim] (any token and head strides), cos/sin [tokens, rotary_dim // 2]; returns a
    new contiguous tensor."""
    tokens, heads, dim = x.shape
    half = cos.shape[-1]
    assert x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride() == cos.stride()
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if not tokens:
        return out
    block_h = min(16, triton.next_power_of_2(heads))
    _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
        x,
        out,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0),
        heads,
        dim,
        HALF=half,
        INTERLEAVED=interleaved,
        BLOCK_H=block_h,
        BLOCK_P=triton.next_power_of_2(max(dim - 2 * half, 1)),
        ASM=x.is_cuda and x.dtype == torch.bfloat16,
    )
    return out
