"""DeepSeek-V2/V3 (and R1): multi-head latent attention in absorbed form over a latent KV cache.

The cache holds per token the normalised compressed KV `c_kv` (kv_lora_rank) and the roped shared
key `k_pe` (qk_rope_head_dim). Queries are absorbed into latent space through kv_b_proj's key half,
and the attention output leaves it through the value half, so no per-head K/V is ever materialised.
"""

from __future__ import annotations

import torch
from torch import nn

from dserve.models.base import CausalLM
from dserve.models.config import ModelConfig
from dserve.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnLinear,
    Part,
    ReplicatedLinear,
    RowParallelLinear,
)
from dserve.models.layers.norm import RMSNorm
from dserve.models.parallel import ParallelContext
from dserve.models.quant import value_up


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ctx: ParallelContext):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        tp = ctx.attn
        h0, h1 = tp.shard_range(cfg.num_attention_heads, "num_attention_heads")
        self.num_heads = h1 - h0
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        qk = cfg.qk_head_dim
        if cfg.q_lora_rank:
            # q_a_proj and kv_a_proj_with_mqa both read the hidden state: one replicated matmul.
            self.fused_qkv_a_proj = MergedColumnLinear(
                cfg.hidden_size,
                [
                    Part("q_a", 0, cfg.q_lora_rank, 0, cfg.q_lora_rank),
                    Part("kv_a", cfg.q_lora_rank, latent, 0, latent),
                ],
                bias=cfg.attention_bias,
            )
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = ColumnParallelLinear(
                cfg.q_lora_rank, cfg.num_attention_heads * qk, tp=tp
            )
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_attention_heads * qk, tp=tp)
            self.kv_a_proj_with_mqa = ReplicatedLinear(
                cfg.hidden_size, latent, bias=cfg.attention_bias
            )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = ColumnParallelLinear(
            cfg.kv_lora_rank,
            cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            tp=tp,
        )
        self.kv_b_proj.keep_dense = (
            True  # its absorbed halves are read as matrices (FP8: dequantized)
        )
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.v_head_dim,
            cfg.hidden_size,
            bias=cfg.attention_bias,
            tp=tp,
        )
        self.scale = cfg.softmax_scale

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(
            self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank
        )
        return w[:, : cfg.qk_nope_head_dim], w[
            :, cfg.qk_nope_head_dim :
        ]  # W_UK [H,N,R], W_UV [H,V,R]

    def forward(self, x: torch.Tensor, cos_sin, backend) -> torch.Tensor:
        if backend.expand_mla:  # a prompt-sized pass: per-head keys and values, as prefills
            q_nope, q_rope, latent, _ = self.queries(x, cos_sin)
            w_uk, w_uv = self._absorbed_weights()
            out = backend.forward_mla_expanded(
                self.layer_id, q_nope, q_rope, latent, w_uk, w_uv, self.scale
            )
            return self.o_proj(out.flatten(1))
        q_latent, q_rope, latent, _ = self.project(x, cos_sin)
        o_latent = backend.forward_mla(self.layer_id, q_latent, q_rope, latent, self.scale)
        return self.output(o_latent)

    def project(self, x: torch.Tensor, cos_sin):
        """(q_latent [T, H, R], q_rope [T, H, P], the tokens' latents [T, R + P], and the
        normalised q-LoRA latent [T, q_lora_rank] or None)."""
        q_nope, q_rope, latent, q_resid = self.queries(x, cos_sin)
        w_uk, _ = self._absorbed_weights()
        # per head [T, N] @ [N, R], read and written in place through strides (no copies of q)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        return q_latent, q_rope, latent, q_resid

    def queries(self, x: torch.Tensor, cos_sin):
        """(q_nope [T, H, N], q_rope [T, H, P] roped, the tokens' latents [T, R + P], and the
        normalised q-LoRA latent [T, q_lora_rank] or None)."""
        cfg, rotary = self.cfg, self._rotary
        q_resid = None
        if cfg.q_lora_rank:
            q_a, kv_a = self.fused_qkv_a_proj(x).split(
                [cfg.q_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim], -1
            )
            q_resid = self.q_a_layernorm(q_a)
            q = self.q_b_proj(q_resid)
        else:
            q, kv_a = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        q = q.view(-1, self.num_heads, cfg.qk_head_dim)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        c_kv, k_rope = kv_a.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        cos, sin = cos_sin
        q_rope = rotary.apply(q_rope, cos, sin)
        k_rope = rotary.apply(k_rope.unsqueeze(1), cos, sin).squeeze(1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_rope], dim=-1)
        return q_nope, q_rope, latent, q_resid

    def output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """The attention-weighted latents [T, H, R] out through W_UV and o_proj."""
        _, w_uv = self._absorbed_weights()
        return self.o_proj(value_up(o_latent, w_uv, self.o_proj))

    def map_key(self, suffix: str) -> tuple[str, object] | None:
        if self.cfg.q_lora_rank:
            for name, shard in (("q_a_proj", "q_a"), ("kv_a_proj_with_mqa", "kv_a")):
                if suffix.startswith(name + "."):
                    return "fused_qkv_a_proj." + suffix[len(name) + 1 :], shard
            names = ("q_a_layernorm.weight", "q_b_proj.weight")
        else:
            names = ("q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias")
        if suffix in names + (
            "kv_a_layernorm.weight",
            "kv_b_proj.weight",
            "o_proj.weight",
            "o_proj.bias",
        ):
            return suffix, None
        return None


class DeepseekForCausalLM(CausalLM):
    attention_cls = MLAttention
