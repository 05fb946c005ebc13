"""Triton FP8 GEMMs for FP8 checkpoints: y = x @ w.T with w in float8_e4m3fn.

Activations are quantized on the fly (`quantize_activations`): per token and per group of the
weight's scale block along K (128 for DeepSeek's block FP8), or per token over all of K for
per-channel weights (compressed-tensors). The GEMM (`fp8_matmul`) multiplies FP8 tiles on the
tensor cores with float32 accumulation and applies the two scales per K block: a token's group
scale and the weight's scale of that output row and block (weights hold their scales per row and
K block: `models/quant.py`). Per-channel weights have one K block: the scales are applied once, at
the end.

Launch parameters come from a table keyed by (N, K) and a bucket of M that `bench.fp8_gemm`
sweeps and writes (`fp8_gemm_configs.json` beside this file); shapes the table lacks use the
defaults below.
"""

from __future__ import annotations

import functools
import json
import os

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
CONFIGS = os.path.join(os.path.dirname(__file__), "fp8_gemm_configs.json")


@triton.jit
def _quantize_rows(x_ptr, q_ptr, s_ptr, K, num_groups, GROUP: tl.constexpr, CHUNK: tl.constexpr):
    """One program per (token, group): the group's absolute maximum, then its FP8 values."""
    row, g = tl.program_id(0), tl.program_id(1)
    start = g * GROUP
    amax = tl.zeros((CHUNK,), dtype=tl.float32)
    for c in range(0, GROUP, CHUNK):
        offs = start + c + tl.arange(0, CHUNK)
        mask = (c + tl.arange(0, CHUNK) < GROUP) & (offs < K)
        x = tl.load(x_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-10) / 448.0
    for c in range(0, GROUP, CHUNK):
        offs = start + c + tl.arange(0, CHUNK)
        mask = (c + tl.arange(0, CHUNK) < GROUP) & (offs < K)
        x = tl.load(x_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * num_groups + g, scale)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 x [M, K], float32 scales [M, ceil(K / group)]) for a contiguous x."""
    m, k = x.shape
    groups = -(-k // group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        chunk = min(triton.next_power_of_2(group), 1024)
        _quantize_rows[(m, groups)](x, q, s, k, groups, GROUP=group, CHUNK=chunk)
    return q, s


@triton.jit
def _fp8_gemm(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    M,
    N,
    K,
    num_groups,
    group_k,
    stride_cm,
    PER_CHANNEL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    rows = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * K + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if PER_CHANNEL:
            acc += tl.dot(a, b)
        else:
            g = k0 // group_k
            a_s = tl.load(as_ptr + offs_m * num_groups + g, mask=m_ok, other=0.0)
            b_s = tl.load(bs_ptr + offs_n * num_groups + g, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if PER_CHANNEL:
        a_s = tl.load(as_ptr + offs_m, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptr + offs_n, mask=n_ok, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


DEFAULTS = {  # M bucket -> launch parameters (BLOCK_K is the scale block, at most 128)
    16: dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4),
    64: dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4),
    256: dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=3),
    1 << 30: dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3),
}


def m_bucket(m: int) -> int:
    return next(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 1 << 30) if m <= b)


@functools.lru_cache(maxsize=1)
def tuned() -> dict:
    if not os.path.isfile(CONFIGS):
        return {}
    with open(CONFIGS) as f:
        return json.load(f)


def launch_config(m: int, n: int, k: int) -> dict:
    """The table's parameters for this shape and M bucket, else the defaults."""
    found = tuned().get(f"{n}x{k}", {}).get(str(m_bucket(m)))
    if found is not None:
        return dict(found)
    return dict(next(cfg for bound, cfg in DEFAULTS.items() if m <= bound))


def supported(block_k: int, scale_columns: int) -> bool:
    """Weights the kernel takes: per channel (one scale column), or scale blocks of 32 to 128
    input features, a power of two (one K tile per block; tensor-core FP8 needs K tiles of 32
    at least)."""
    if scale_columns == 1:
        return True
    return 32 <= block_k <= 128 and block_k & (block_k - 1) == 0


def fp8_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block_k: int,
    config: dict | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16) @ w.T with w [N, K] FP8 and w_scale [N, ceil(K / block_k)] float32;
    per-channel weights have one scale column (block_k >= K)."""
    m, k = x.shape
    n = w.shape[0]
    per_channel = w_scale.shape[1] == 1
    group = k if per_channel else block_k
    q, s = quantize_activations(x.contiguous(), group)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or launch_config(m, n, k)
    block_k_tile = 128 if per_channel else block_k
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _fp8_gemm[grid](
        q,
        s,
        w,
        w_scale,
        out,
        m,
        n,
        k,
        w_scale.shape[1],
        group,
        out.stride(0),
        PER_CHANNEL=per_channel,
        BLOCK_K=block_k_tile,
        **cfg,
    )
    return out
