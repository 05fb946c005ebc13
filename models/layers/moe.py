"""Mixture of experts as DeepSeek-V2/V3 and GLM-4.5 route it, with shared experts.

Routing: sigmoid scores plus `e_score_correction_bias` for choice with group-limited top-k
(`n_group`, `topk_group`, groups ranked by their two best scores) for V3/GLM; softmax scores with
greedy or group-limited (group max) top-k for V2. Weights are the unbiased scores of the chosen
experts, optionally renormalised (`norm_topk_prob`), times `routed_scaling_factor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dserve.models.config import ModelConfig
from dserve.models.layers.mlp import GatedMLP
from dserve.models.parallel import SINGLE, ParallelContext
from dserve.models.quant import FP8, weight_of
from dserve.models.weights import (
    SKIP,
    TensorSource,
    attach_loader,
    copy_checked,
    prefixed,
    replicated_loader,
)


def route(
    logits: torch.Tensor, bias: torch.Tensor | None, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [tokens, experts] (float32) -> (weights, expert ids), each [tokens, top_k]."""
    n_tok, n_exp = logits.shape
    group_size = n_exp // cfg.n_group
    if cfg.scoring_func == "sigmoid":
        scores = logits.sigmoid()
        choice = scores + bias if bias is not None else scores
        group_scores = choice.view(n_tok, cfg.n_group, group_size).topk(2, dim=-1)[0].sum(dim=-1)
        fill = float("-inf")
    elif cfg.scoring_func == "softmax":
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        choice = scores
        group_scores = scores.view(n_tok, cfg.n_group, group_size).max(dim=-1).values
        fill = 0.0
    else:
        raise ValueError(f"scoring_func {cfg.scoring_func!r} is not supported")
    if cfg.topk_method != "greedy":
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(-1, -1, group_size).reshape(n_tok, n_exp).bool()
        choice = choice.masked_fill(~keep, fill)
    ids = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


class Experts(nn.Module):
    """This rank's routed experts stacked: w13 [E_local, 2*I, H] (gate then up), w2 [E_local, H, I].
    Experts [first, first + E_local) live here (expert parallelism); I is split over the ranks that
    share them (`ctx.moe_tp`)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext = SINGLE):
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        if self.num_experts % ctx.ep_size:
            raise ValueError(
                f"n_routed_experts = {self.num_experts} does not divide by ep_size = {ctx.ep_size}"
            )
        self.num_local = self.num_experts // ctx.ep_size
        self.first = ctx.ep_rank * self.num_local
        self.i_start, self.i_end = ctx.moe_tp.shard_range(
            cfg.moe_intermediate_size, "moe_intermediate_size"
        )
        local = self.i_end - self.i_start
        self.w13 = attach_loader(
            nn.Parameter(
                torch.empty(self.num_local, 2 * local, cfg.hidden_size), requires_grad=False
            ),
            self._load,
        )
        self.w2 = attach_loader(
            nn.Parameter(torch.empty(self.num_local, cfg.hidden_size, local), requires_grad=False),
            self._load,
        )
        self.use_kernel = False  # set by the model runner for the triton backend
        mine = range(self.first, self.first + self.num_local)
        self.w13.expected_shards = [(e, p) for e in mine for p in ("gate", "up")]
        self.w2.expected_shards = [(e, "down") for e in mine]

    def owns(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.num_local

    def _load(self, param: torch.Tensor, source: TensorSource, shard: tuple[int, str]) -> None:
        expert, part = shard
        expert -= self.first
        local = self.i_end - self.i_start
        if part == "down":
            copy_checked(param.data[expert], source.read(1, self.i_start, self.i_end), source)
        else:
            offset = 0 if part == "gate" else local
            copy_checked(
                param.data[expert, offset : offset + local],
                source.read(0, self.i_start, self.i_end),
                source,
            )

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.use_kernel and x.is_cuda:  # the triton backend: grouped GEMMs, no host sync
            from dserve.kernels.triton_fp8 import quantized_form
            from dserve.kernels.triton_moe import fused_experts

            fp8 = self.w13.dtype == FP8
            group = self.w13_scale.block if fp8 else 0
            return fused_experts(
                x,
                self.w13,
                self.w2,
                weights,
                ids,
                self.first,
                scales=(self.w13_scale, self.w2_scale) if fp8 else None,
                fp8_block=group,
                quantized=quantized_form(x, group) if fp8 else None,
            )
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            if not self.owns(expert):
                continue
            token_idx, slot = torch.where(ids == expert)
            local = expert - self.first
            w13 = weight_of(self, "w13", x.dtype, local)
            w2 = weight_of(self, "w2", x.dtype, local)
            gate, up = F.linear(x[token_idx], w13).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext = SINGLE):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.gate_weight = attach_loader(
            nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size), requires_grad=False),
            replicated_loader,
        )
        self.correction_bias = None
        if cfg.scoring_func == "sigmoid":
            bias = torch.zeros(cfg.n_routed_experts, dtype=torch.float32)
            self.correction_bias = attach_loader(
                nn.Parameter(bias, requires_grad=False), replicated_loader
            )
        self.experts = Experts(cfg, ctx)
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = GatedMLP(
                cfg.hidden_size,
                cfg.moe_intermediate_size * cfg.n_shared_experts,
                ctx.mlp,
                reduce=False,
            )

    def forward(self, x: torch.Tensor, real_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """`real_tokens` (nonzero per real row) marks a padded step's padding rows: routed nowhere, they
        pull in no expert's weights."""
        logits = self.router_logits(x)
        bias = self.correction_bias
        if self.experts.use_kernel and x.is_cuda:  # one launch, padding rows included
            from dserve.kernels import triton_routing

            weights, ids = triton_routing.route(logits, bias, self.cfg, real_tokens)
        else:
            weights, ids = route(logits, bias, self.cfg)
            if real_tokens is not None:
                ids = torch.where(real_tokens[:, None] != 0, ids, -1)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.ctx.mlp.all_reduce(out)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, experts] in float32, as the reference computes them. On a GPU from the
        model's dtype with float32 output (each product of two bf16 values is exact in float32;
        only the order of the sum differs), with no float32 copy of the weight per step."""
        w = self.gate_weight
        if x.is_cuda and x.dtype == w.dtype and x.dtype != torch.float32:
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        return F.linear(x.float(), w.float())

    def map_key(self, suffix: str) -> tuple[str, object] | None:
        """Checkpoint suffix under `mlp.` -> (parameter suffix, shard id)."""
        if suffix == "gate.weight":
            return "gate_weight", None
        if suffix == "gate.e_score_correction_bias":
            return "correction_bias", None
        if suffix.startswith("shared_experts."):
            return prefixed("shared_experts.", GatedMLP.map_key(suffix[len("shared_experts.") :]))
        if suffix.startswith("experts."):
            expert, name = suffix[len("experts.") :].split(".", 1)
            part = {
                "gate_proj.weight": "gate",
                "up_proj.weight": "up",
                "down_proj.weight": "down",
            }.get(name)
            if part is None:
                return None
            if not self.experts.owns(int(expert)):
                return SKIP  # another expert-parallel rank's expert
            return ("experts.w2" if part == "down" else "experts.w13"), (int(expert), part)
        return None
