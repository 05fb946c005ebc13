"""Rotary position embedding: default and YaRN frequencies, DeepSeek's interleaved pairs, GLM's partial rotary.
On a GPU with the Triton kernels selected, `apply` is one launch (`kernels/triton_rotary.py`).

cos/sin are computed per batch from the positions exactly as the reference does (float32 positions
times inverse frequencies, scaled by YaRN's attention factor), so cached and fresh tokens agree bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dserve.models.config import RopeConfig, yarn_get_mscale


def yarn_inv_freq(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp between (beta_fast/beta_slow)."""
    dim, base = rope.rotary_dim, rope.theta

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    if rope.attention_factor is not None:
        factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        factor = yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(
            rope.factor, rope.mscale_all_dim
        )
    else:
        factor = yarn_get_mscale(rope.factor)
    return inv_freq, factor


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig):
        super().__init__()
        self.rope = rope
        if rope.rope_type == "yarn":
            inv_freq, self.attention_scaling = yarn_inv_freq(rope)
        else:
            inv_freq = 1.0 / (
                rope.theta
                ** (torch.arange(0, rope.rotary_dim, 2, dtype=torch.float32) / rope.rotary_dim)
            )
            self.attention_scaling = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.use_kernel = False  # set by the model runner for the triton backend

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape [tokens, rotary_dim // 2]."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        return cos, sin

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape [tokens, heads, dim]; only the first rotary_dim features turn."""
        r = self.rope.rotary_dim
        # one Triton launch with the same rounding in bf16 (in float32 the GPU compiler's FMAs round
        # differently, so other dtypes stay on the torch code)
        if (
            self.use_kernel
            and x.is_cuda
            and x.dtype == torch.bfloat16
            and (r // 2) & (r // 2 - 1) == 0
        ):
            from dserve.kernels.triton_rotary import apply_rotary

            return apply_rotary(x, cos.contiguous(), sin.contiguous(), self.rope.interleaved)
        cos, sin = cos[:, None, :], sin[:, None, :]
        rot = x[..., :r]
        if self.rope.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        else:
            x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)
