"""GLM-4.5 MoE: grouped-query attention with q/k/v bias, optional per-head QK RMSNorm and partial
rotary (rotate-half over the first `partial_rotary_factor` of each head), K/V paged per KV head."""

from __future__ import annotations

import torch
from torch import nn

from dserve.models.base import CausalLM
from dserve.models.config import ModelConfig
from dserve.models.layers.linear import MergedColumnLinear, RowParallelLinear, qkv_parts
from dserve.models.layers.norm import RMSNorm
from dserve.models.parallel import ParallelContext


class GQAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, ctx: ParallelContext, input_size: int | None = None
    ):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        parts = qkv_parts(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, ctx.attn)
        self.qkv_proj = MergedColumnLinear(
            input_size or cfg.hidden_size, parts, bias=cfg.attention_bias
        )
        self.q_size, self.kv_size = parts[0].local_size, parts[1].local_size
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, tp=ctx.attn
        )
        self.scale = cfg.softmax_scale

    def forward(self, x: torch.Tensor, cos_sin, backend) -> torch.Tensor:
        d = self.cfg.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = (
            q.view(-1, self.q_size // d, d),
            k.view(-1, self.kv_size // d, d),
            v.view(-1, self.kv_size // d, d),
        )
        if self.cfg.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = self._rotary.apply(q, cos, sin), self._rotary.apply(k, cos, sin)
        out = backend.forward_mha(self.layer_id, q, k, v, self.scale)
        return self.o_proj(out.flatten(1))

    def map_key(self, suffix: str) -> tuple[str, object] | None:
        for name in ("q", "k", "v"):
            if suffix.startswith(f"{name}_proj."):
                return "qkv_proj." + suffix[len(name) + 6 :], name
        if suffix in ("q_norm.weight", "k_norm.weight", "o_proj.weight"):
            return suffix, None
        return None


class Glm4MoeForCausalLM(CausalLM):
    attention_cls = GQAttention
