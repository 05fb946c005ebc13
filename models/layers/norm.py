"""RMSNorm, computed in float32 and cast back, as the reference models do; on a GPU with the Triton
kernels selected (`attention_backend="triton"`), one fused kernel (`kernels/triton_norm.py`) that
also does the residual add before the norm and, where the norm's readers are FP8 linears
(`quant_group`, set by `models.quant.quantize_in_norms`), their activations' quantization after
it: the output then carries its FP8 form (`triton_fp8.attach_quantized`)."""

from __future__ import annotations

import torch
from torch import nn

from dserve.models.weights import attach_loader, replicated_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = attach_loader(
            nn.Parameter(torch.ones(hidden_size), requires_grad=False), replicated_loader
        )
        self.eps = eps
        self.use_kernel = False  # set by the model runner for the triton backend
        self.quant_group = 0  # with the kernel: also quantize the output in these groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._on_kernel(x):
            return self._kernel(x)[0]
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x)."""
        if self._on_kernel(x):
            return self._kernel(x, rows_of(residual))
        total = residual + x
        return self.forward(total), total

    def _on_kernel(self, x: torch.Tensor) -> bool:
        return self.use_kernel and x.is_cuda and x.dim() == 2

    def _kernel(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        from dserve.kernels.triton_fp8 import attach_quantized
        from dserve.kernels.triton_norm import rms_norm

        group = self.quant_group if x.dtype != torch.float32 else 0
        out, total, quantized = rms_norm(rows_of(x), self.weight, self.eps, residual, group)
        if quantized is not None:
            attach_quantized(out, quantized)
        return out, total


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """x with contiguous rows (a column slice of a wider matrix stays a view)."""
    return x if x.stride(-1) == 1 else x.contiguous()
