"""Triton RMSNorm, optionally fused with the residual add before it, one program per token row.

Same arithmetic as `models.layers.norm.RMSNorm`: the sum (when fused) is rounded to the input dtype
first, as `residual + x` would be; the norm runs in float32; the normalised row is rounded to the
input dtype and then multiplied by the weight, rounding again. Only the order of the float32
reduction differs from torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_sum,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(x + residual) * weight, x + residual) for x [T, H] (the sum only when `residual` is
    given); the output has the weight's dtype where it is wider, as torch's promotion gives."""
    assert x.dim() == 2 and x.stride(-1) == 1, "rows of contiguous hidden states"
    rows, cols = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    total = torch.empty_like(x) if residual is not None else None
    if rows:
        _rms_norm_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            total if total is not None else out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            total.stride(0) if total is not None else 0,
            cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(cols),
            num_warps=8 if cols >= 4096 else 4,
        )
    return out, total
