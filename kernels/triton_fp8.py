"""Triton kernels for the FP8 GEMMs (`kernels/fp8_gemm.py` picks them or cuBLAS).

`quantize_activations` quantizes a matrix per token and per group of K (the weight's scale block,
128 for DeepSeek's block FP8; all of K for per-channel weights) into e4m3 with a float32 scale per
(token, group). The scales are token-major ([rows, groups] with strides (1, rows)), the layout
cuBLAS's blockwise FP8 GEMM reads; `rows` may pad the token count (cuBLAS wants a multiple of 4),
the padding rows quantized as zeros.

`triton_matmul` multiplies FP8 tiles on the tensor cores with float32 accumulation and applies the
two scales per K block: a token's group scale and the weight's scale of that output row and block
(weights hold their scales per row and K block, any strides: `models/quant.py`), optionally
splitting K over several programs per output tile. Per-channel weights have one K block: the
scales are applied once, at the end. Measured slower on an H100 and so not done: quantizing the
inputs in the GEMM's own program instead of in a launch before it (it stalls the pipelined
loads), and W8A16 for a few tokens (bf16 inputs times the weights widened from e4m3: slower
than cuBLAS's W8A8 at every shape, M = 1 to 16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


def padded_rows(m: int) -> int:
    """m rounded up to a multiple of 4: the FP8 rows cuBLAS's scale layout wants."""
    return -(-m // 4) * 4


@dataclass(frozen=True)
class QuantizedRows:
    """A matrix's FP8 form, made where it was computed (`triton_norm.rms_norm`): q [>= M, K]
    e4m3 and its float32 scales per token and `group` columns, token-major (strides
    (1, q rows)). Rows past the matrix's own are zeros."""

    q: torch.Tensor
    scales: torch.Tensor
    group: int

    @staticmethod
    def empty(rows: int, cols: int, group: int, device) -> QuantizedRows:
        padded, group = padded_rows(rows), min(group, cols)
        groups = -(-cols // group)
        q = torch.empty((padded, cols), dtype=torch.float8_e4m3fn, device=device)
        scales = torch.empty((groups, padded), dtype=torch.float32, device=device)
        return QuantizedRows(q, scales.t(), group)

    def serves(self, group: int) -> bool:
        """Whether these are the values a quantization in groups of `group` gives."""
        return min(group, self.q.shape[1]) == self.group


def attach_quantized(x: torch.Tensor, quantized: QuantizedRows) -> torch.Tensor:
    """x, carrying its FP8 form to the FP8 GEMMs that read it (`quantized_form`). Only a
    kernel that wrote both attaches one, and x is not changed in place afterwards: the
    attribute lives on this tensor object (views, copies and slices do not carry it)."""
    x.fp8_form = quantized
    return x


def quantized_form(x: torch.Tensor, group: int) -> QuantizedRows | None:
    """The FP8 form attached to x if it has one in groups of `group`, else None."""
    found = getattr(x, "fp8_form", None)
    if found is None or not found.serves(group):
        return None
    return found


@triton.jit
def _load_input(x_ptr, row, offs, K, mask, GATED: tl.constexpr):
    """Inputs offs of a row in float32; GATED: SiLU(x[:K]) * x[K:] of a row of 2K."""
    if GATED:
        gate = tl.load(x_ptr + row * 2 * K + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * K + K + offs, mask=mask, other=0.0).to(tl.float32)
        return gate / (1.0 + tl.exp(-gate)) * up
    return tl.load(x_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def e4m3_scale(amax):
    """A scale group's scale from its absolute maximum: the one rule every
    FP8 activation quantization here follows (a zero group gets 1e-10 / 448)."""
    return tl.maximum(amax, 1e-10) / 448.0


@triton.jit
def e4m3_values(x, scale):
    """x over its group's scale, clamped to e4m3's range (still float32)."""
    return tl.clamp(x / scale, -448.0, 448.0)


@triton.jit(do_not_specialize=["M"])
def _quantize_rows(
    x_ptr, q_ptr, s_ptr, M, K, GROUP: tl.constexpr, CHUNK: tl.constexpr, GATED: tl.constexpr
):
    """One program per (row, group): the group's absolute maximum, then its FP8 values; rows
    from M on (padding) read as zeros. Scales go token-major: s[g * rows + row]."""
    row, g = tl.program_id(0), tl.program_id(1)
    rows = tl.num_programs(0)
    start = g * GROUP
    live = row < M
    amax = tl.zeros((CHUNK,), dtype=tl.float32)
    for c in range(0, GROUP, CHUNK):
        offs = start + c + tl.arange(0, CHUNK)
        mask = (c + tl.arange(0, CHUNK) < GROUP) & (offs < K) & live
        amax = tl.maximum(amax, tl.abs(_load_input(x_ptr, row, offs, K, mask, GATED)))
    scale = e4m3_scale(tl.max(amax, axis=0))
    for c in range(0, GROUP, CHUNK):
        offs = start + c + tl.arange(0, CHUNK)
        in_group = (c + tl.arange(0, CHUNK) < GROUP) & (offs < K)
        x = _load_input(x_ptr, row, offs, K, in_group & live, GATED)
        q = e4m3_values(x, scale)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=in_group)
    tl.store(s_ptr + g * rows + row, scale)


def quantize_activations(
    x: torch.Tensor, group: int, rows: int | None = None, gated: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 x [rows, K], float32 scales [rows, ceil(K / group)] token-major) for a contiguous
    x [M, K]; `rows` >= M pads with zero rows (default: M). `gated`: x is [M, 2K] (gate then
    up) and what is quantized is SiLU(gate) * up, computed in float32."""
    m, k = x.shape
    k = k // 2 if gated else k
    rows = m if rows is None else rows
    groups = -(-k // group)
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((groups, rows), dtype=torch.float32, device=x.device).t()
    if rows:
        chunk = min(triton.next_power_of_2(group), 1024)
        grid = (rows, groups)
        _quantize_rows[grid](x, q, s, m, k, GROUP=group, CHUNK=chunk, GATED=gated)
    return q, s


@triton.jit(do_not_specialize=["M", "stride_asg"])
def _fp8_gemm(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_asm,
    stride_asg,
    stride_bsn,
    stride_bsg,
    group_k,
    stride_cm,
    PER_CHANNEL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid, split = tl.program_id(0), tl.program_id(1)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    rows = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows
    # this split's share of K, whole K tiles
    k_share = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = split * k_share
    k_end = min(K, k_start + k_share)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * K + k_start + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * K + k_start + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = k0 + offs_k < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if PER_CHANNEL:
            acc += tl.dot(a, b)
        else:
            g = k0 // group_k
            a_s = tl.load(as_ptr + offs_m * stride_asm + g * stride_asg, mask=m_ok, other=0.0)
            b_s = tl.load(bs_ptr + offs_n * stride_bsn + g * stride_bsg, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if PER_CHANNEL:
        a_s = tl.load(as_ptr + offs_m * stride_asm, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptr + offs_n * stride_bsn, mask=n_ok, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:  # float32 partial sums [SPLIT_K, M, N], summed by `_sum_splits`
        c_ptrs = c_ptr + (split * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(c_ptrs, acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _sum_splits(p_ptr, c_ptr, M, N, stride_cm, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out = the sum of the split-K partial products, in split order (deterministic)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(p_ptr + s * M * N + offs, mask=ok, other=0.0)
    row, col = offs // N, offs % N
    tl.store(c_ptr + row * stride_cm + col, acc.to(c_ptr.dtype.element_ty), mask=ok)


def triton_matmul(
    q: torch.Tensor,
    s: torch.Tensor,
    m: int,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    group: int,
    out: torch.Tensor,
    config: dict,
) -> torch.Tensor:
    """out[:m] = (q x s)[:m] @ (w x w_scale).T: q [>= m, K] FP8 with its scales per token and
    `group` inputs (from `quantize_activations`), w [N, K] FP8 with w_scale [N, K blocks] (one
    column: per channel). `config["SPLIT_K"]` > 1 splits K over that many programs per output
    tile and sums their float32 partials in a second launch (for narrow N at small M, where the
    output tiles alone leave SMs idle)."""
    n, k = w.shape
    per_channel = w_scale.shape[1] == 1
    config = dict(config)
    split_k = config.pop("SPLIT_K", 1)
    target = out
    if split_k > 1:
        target = torch.empty((split_k, m, n), dtype=torch.float32, device=q.device)
    tiles = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
    _fp8_gemm[(tiles, split_k)](
        q,
        s,
        w,
        w_scale,
        target,
        m,
        n,
        k,
        s.stride(0),
        s.stride(1),
        w_scale.stride(0),
        w_scale.stride(1),
        group,
        out.stride(0),
        PER_CHANNEL=per_channel,
        SPLIT_K=split_k,
        BLOCK_K=128 if per_channel else group,
        **config,
    )
    if split_k > 1:
        block = 1024
        grid = (triton.cdiv(m * n, block),)
        _sum_splits[grid](target, out, m, n, out.stride(0), SPLIT_K=split_k, BLOCK=block)
    return out
