"""RMSNorm, computed in float32 and cast back, as the reference models do; on a GPU with the Triton
kernels selected (`attention_backend="triton"`), one fused kernel (`kernels/triton_norm.py`) that
also does the residual add before the norm."""

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
            return self._kernel(x, residual.contiguous())
        total = residual + x
        return self.forward(total), total

    def _on_kernel(self, x: torch.Tensor) -> bool:
        return self.use_kernel and x.is_cuda and x.dim() == 2

    def _kernel(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        from dserve.kernels.triton_norm import rms_norm

        return rms_norm(x.contiguous(), self.weight, self.eps, residual)
