"""Triton RMSNorm, optionally fused with the residual add before it and with the FP8 quantization
of its output after it, one program per token row.

Same arithmetic as `models.layers.norm.RMSNorm`: the sum (when fused) is rounded to the input dtype
first, as `residual + x` would be; the norm runs in float32; the normalised row is rounded to the
input dtype and then multiplied by the weight, rounding again. Only the order of the float32
reduction differs from torch's.

With `quant_group`, each program also writes its output row in e4m3 with a float32 scale per
`quant_group` columns: the values `triton_fp8.quantize_activations` would give for the rounded
output (the same maximum, scale and division), so the FP8 GEMMs that read this norm's output
need no quantization launch of their own. The FP8 rows are padded to a multiple of 4 (cuBLAS's
scale layout) with zero rows, and the scales are token-major, as `quantize_activations` lays
them out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dserve.kernels.triton_fp8 import (
    QuantizedRows,
    e4m3_scale,
    e4m3_values,
    padded_rows,
)


@triton.jit
def _store_quantized(
    y, cols, row, q_ptr, s_ptr, rows, n_cols, GROUP: tl.constexpr, BLOCK: tl.constexpr
):
    """Row `row` of y [BLOCK] (zeros past n_cols) in e4m3, one scale per GROUP columns."""
    groups: tl.constexpr = BLOCK // GROUP
    amax = tl.max(tl.reshape(tl.abs(y), (groups, GROUP)), axis=1)
    scale = e4m3_scale(amax)
    wide = tl.broadcast_to(scale[:, None], (groups, GROUP))
    q = e4m3_values(y, tl.reshape(wide, (BLOCK,)))
    dest = q_ptr + row * n_cols + cols
    tl.store(dest, q.to(q_ptr.dtype.element_ty), mask=cols < n_cols)
    g = tl.arange(0, groups)
    tl.store(s_ptr + g * rows + row, scale, mask=g * GROUP < n_cols)


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    q_ptr,
    s_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_sum,
    n_rows,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANT_GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    # padding rows (row >= n_rows, quantized only) read and write nothing but zeros
    mask = cols < tl.where(row < n_rows, n_cols, 0)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)
    if QUANT_GROUP:
        rows = tl.num_programs(0)
        y = y.to(tl.float32)
        _store_quantized(y, cols, row, q_ptr, s_ptr, rows, n_cols, QUANT_GROUP, BLOCK)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quant_group: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, QuantizedRows | None]:
    """(norm(x + residual) * weight, x + residual, the output in FP8) for x [T, H] with
    contiguous rows: the sum only when `residual` is given, the FP8 form only with
    `quant_group` (a power of two, or >= H: one scale per row). The output has the weight's
    dtype where it is wider, as torch's promotion gives."""
    assert x.dim() == 2 and x.stride(-1) == 1, "rows of hidden states"
    rows, cols = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    total = torch.empty_like(x) if residual is not None else None
    block = triton.next_power_of_2(cols)
    group = block if quant_group >= cols else quant_group
    quantized = QuantizedRows.empty(rows, cols, quant_group, x.device) if group else None
    programs = padded_rows(rows) if group else rows
    if programs:
        _rms_norm_kernel[(programs,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            total if total is not None else out,
            quantized.q if group else out,
            quantized.scales if group else out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            total.stride(0) if total is not None else 0,
            rows,
            cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            QUANT_GROUP=group,
            BLOCK=block,
            num_warps=8 if cols >= 4096 else 4,
        )
    return out, total, quantized
