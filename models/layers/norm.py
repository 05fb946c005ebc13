"""RMSNorm, computed in float32 and cast back, as the reference models do."""
from __future__ import annotations

import torch
from torch import nn

from dserve.models.weights import attach_loader, replicated_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = attach_loader(nn.Parameter(torch.ones(hidden_size), requires_grad=False), replicated_loader)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
