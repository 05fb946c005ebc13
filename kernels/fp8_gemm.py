"""FP8 GEMMs for FP8 checkpoints: y = x @ w.T with w in float8_e4m3fn and its scales.

Activations are quantized on the fly per token and per group of the weight's scale block along K
(128 for DeepSeek's block FP8), or per token over all of K for per-channel weights
(compressed-tensors): `triton_fp8.quantize_activations`, or, for the output of a norm that
quantized it already, its attached FP8 form (`triton_fp8.quantized_form`). Then one of two
GEMMs:

- `cublas`: torch's `scaled_mm` (cuBLASLt 12.9+): blockwise 1x128 scales on both operands
  (Hopper only; the weight's scales per row and block as held in memory, row-major or
  column-major: `models/quant.finish_fp8` stores them column-major, as cuBLAS reads them), or
  row-wise scales for per-channel weights;
- `triton`: our kernel (`triton_fp8.triton_matmul`), for any scale block of 32 to 128 and on
  GPUs cuBLAS does not serve.

Which one, and the Triton kernel's launch parameters, come from a table keyed by (N, K) and a
bucket of M that `bench.fp8_gemm --sweep` measures and writes (`fp8_gemm_configs.json` beside this
file); shapes the table lacks take cuBLAS where it runs them, else the Triton defaults below.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from dserve.kernels import launch_table
from dserve.kernels.triton_fp8 import (
    QuantizedRows,
    padded_rows,
    quantize_activations,
    triton_matmul,
)

CONFIGS = os.path.join(os.path.dirname(__file__), "fp8_gemm_configs.json")
CUBLAS = {"backend": "cublas"}
TRITON_DEFAULTS = {  # M bucket -> launch parameters (BLOCK_K is the scale block)
    16: dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4),
    64: dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4),
    256: dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=3),
    1 << 30: dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3),
}
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 1 << 30)


def m_bucket(m: int) -> int:
    return next(b for b in M_BUCKETS if m <= b)


def supported(block_k: int, scale_columns: int) -> bool:
    """Weights the Triton kernel takes: per channel (one scale column), or scale blocks of 32 to
    128 input features, a power of two (one K tile per block; tensor-core FP8 needs K tiles of
    32 at least)."""
    if scale_columns == 1:
        return True
    return 32 <= block_k <= 128 and block_k & (block_k - 1) == 0


def cublas_takes(n: int, k: int, block_k: int, per_channel: bool, device) -> bool:
    """Whether cuBLAS's scaled GEMM runs this weight here: 1x128 blocks on Hopper or per-channel
    scales on FP8 GPUs, N and K multiples of 16, and a probe GEMM that ran."""
    if n % 16 or k % 16 or (not per_channel and block_k != 128):
        return False
    return _cublas_runs(torch.device(device), per_channel)


@functools.lru_cache(maxsize=None)
def _cublas_runs(device: torch.device, per_channel: bool) -> bool:
    major, minor = torch.cuda.get_device_capability(device)
    if not hasattr(F, "scaled_mm") or (major, minor) < (8, 9):
        return False
    if not per_channel and major != 9:
        return False
    k = 128 if per_channel else 256
    w = torch.zeros(128, k, dtype=torch.float8_e4m3fn, device=device)
    x = torch.zeros(4, k, dtype=torch.bfloat16, device=device)
    scale = torch.ones(128, k // 128, device=device)
    try:
        fp8_matmul(x, w, scale, 128, CUBLAS)
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return True


def launch_config(m: int, n: int, k: int, cublas: bool) -> dict:
    """The table's choice for this shape and M bucket, else cuBLAS where it runs, else the
    Triton defaults."""
    found = launch_table.read(CONFIGS).get(f"{n}x{k}", {}).get(str(m_bucket(m)))
    if found is not None and (cublas or found.get("backend") != "cublas"):
        return dict(found)
    if cublas:
        return dict(CUBLAS)
    return dict(next(cfg for bound, cfg in TRITON_DEFAULTS.items() if m <= bound))


def quantize_for(
    x: torch.Tensor, w_scale: torch.Tensor, block_k: int, gated: bool = False
) -> QuantizedRows:
    """x [M, K] quantized for a weight with these scales: per token over all of K for one
    scale column (per channel), else per `block_k` inputs; rows padded to a multiple of 4.
    `gated`: x is [M, 2K] (gate then up) and SiLU(gate) * up is what is quantized."""
    m, k = x.shape
    k = k // 2 if gated else k
    group = k if w_scale.shape[-1] == 1 else block_k
    q, s = quantize_activations(x.contiguous(), group, padded_rows(m), gated)
    return QuantizedRows(q, s, min(group, k))


def cublas_matmul(
    x: QuantizedRows, m: int, dtype: torch.dtype, w: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """The first m rows of x @ w.T in `dtype` through `scaled_mm` (x's rows padded to a
    multiple of 4: cuBLAS's scale layout)."""
    q, s = x.q, x.scales
    if w_scale.shape[1] == 1:
        recipe = F.ScalingType.RowWise
        s, w_scale = s.contiguous(), w_scale.reshape(1, -1)
    else:
        recipe = F.ScalingType.BlockWise1x128
        if w_scale.stride(0) != 1:
            w_scale = w_scale.t().contiguous().t()
    y = F.scaled_mm(q, w.t(), s, recipe, w_scale, recipe, output_dtype=dtype)
    return y[:m]


def fp8_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block_k: int,
    config: dict | None = None,
    quantized: QuantizedRows | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16) @ w.T with w [N, K] FP8 and w_scale [N, ceil(K / block_k)] float32;
    per-channel weights have one scale column (block_k >= K). `config`: the table's entry to
    use instead of the table's own; `quantized`: x's FP8 form in this weight's groups where a
    norm made it, else x is quantized here."""
    if quantized is None and x.shape[0]:
        quantized = quantize_for(x, w_scale, block_k)
    return quantized_matmul(quantized, x.shape[0], x.dtype, w, w_scale, block_k, config)


def quantized_matmul(
    x: QuantizedRows | None,
    m: int,
    dtype: torch.dtype,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block_k: int,
    config: dict | None = None,
) -> torch.Tensor:
    """The first m rows of x @ w.T in `dtype`, for x already in FP8 (`fp8_matmul`)."""
    n, k = w.shape
    if m == 0:
        return torch.empty((0, n), dtype=dtype, device=w.device)
    per_channel = w_scale.shape[1] == 1
    if config is None:
        cublas = cublas_takes(n, k, block_k, per_channel, w.device)
        config = launch_config(m, n, k, cublas)
    if config.get("backend") == "cublas":
        return cublas_matmul(x, m, dtype, w, w_scale)
    out = torch.empty((m, n), dtype=dtype, device=w.device)
    group = k if per_channel else block_k
    return triton_matmul(x.q, x.scales, m, w, w_scale, group, out, config)
