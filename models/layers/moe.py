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
from dserve.models.weights import TensorSource, attach_loader, copy_checked, replicated_loader


def route(logits: torch.Tensor, bias: torch.Tensor | None, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
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
    """Routed experts' weights stacked: w13 [E, 2*I, H] (gate then up), w2 [E, H, I]; I split over TP."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext = SINGLE):
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        size = cfg.moe_intermediate_size
        self.i_start, self.i_end = ctx.shard_range(size, "moe_intermediate_size")
        local = self.i_end - self.i_start
        self.w13 = attach_loader(nn.Parameter(torch.empty(self.num_experts, 2 * local, cfg.hidden_size),
                                              requires_grad=False), self._load)
        self.w2 = attach_loader(nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size, local),
                                             requires_grad=False), self._load)
        self.w13.expected_shards = [(e, p) for e in range(self.num_experts) for p in ("gate", "up")]
        self.w2.expected_shards = [(e, "down") for e in range(self.num_experts)]

    def _load(self, param: torch.Tensor, source: TensorSource, shard: tuple[int, str]) -> None:
        expert, part = shard
        local = self.i_end - self.i_start
        if part == "down":
            copy_checked(param.data[expert], source.read(1, self.i_start, self.i_end), source)
        else:
            offset = 0 if part == "gate" else local
            copy_checked(param.data[expert, offset:offset + local], source.read(0, self.i_start, self.i_end), source)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            token_idx, slot = torch.where(ids == expert)
            gate, up = F.linear(x[token_idx], self.w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[expert]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext = SINGLE):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.gate_weight = attach_loader(nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size),
                                                      requires_grad=False), replicated_loader)
        self.correction_bias = None
        if cfg.scoring_func == "sigmoid":
            bias = torch.zeros(cfg.n_routed_experts, dtype=torch.float32)
            self.correction_bias = attach_loader(nn.Parameter(bias, requires_grad=False), replicated_loader)
        self.experts = Experts(cfg, ctx)
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                           ctx, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate_weight.float())
        weights, ids = route(logits, self.correction_bias, self.cfg)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.ctx.all_reduce(out)

    def map_key(self, suffix: str) -> tuple[str, object] | None:
        """Checkpoint suffix under `mlp.` -> (parameter suffix, shard id)."""
        if suffix == "gate.weight":
            return "gate_weight", None
        if suffix == "gate.e_score_correction_bias":
            return "correction_bias", None
        if suffix.startswith("shared_experts."):
            mapped = GatedMLP.map_key(suffix[len("shared_experts."):])
            return (f"shared_experts.{mapped[0]}", mapped[1]) if mapped else None
        if suffix.startswith("experts."):
            expert, name = suffix[len("experts."):].split(".", 1)
            part = {"gate_proj.weight": "gate", "up_proj.weight": "up", "down_proj.weight": "down"}.get(name)
            if part is None:
                return None
            return ("experts.w2" if part == "down" else "experts.w13"), (int(expert), part)
        return None
