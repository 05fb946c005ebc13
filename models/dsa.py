"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA whose queries attend only to the
`index_topk` context tokens a small "lightning indexer" selects.

The indexer, as the reference implementations compute it: queries from the shared q-LoRA latent
(`wq_b`), one key head per token from the hidden state (`wk`, then LayerNorm with bias), RoPE on
the first `qk_rope_head_dim` features (GLM-5: interleaved pairs, V3.2: halves), per-head scores
q.k x head_dim^-0.5 through a ReLU, summed with per-token head weights (`weights_proj`, float32,
x n_heads^-0.5); the top `index_topk` causal positions are the selection. Its keys live in the
backend's indexer pool (same page ids as the latent pool), one per token and indexer layer.

GLM-5's "shared" layers have no indexer and reuse the selection of the full layer before them:
the layers of a stage share one `Selection`, which each full layer overwrites.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from dserve.models.base import CausalLM
from dserve.models.config import ModelConfig
from dserve.models.deepseek import MLAttention
from dserve.models.layers.linear import ReplicatedLinear
from dserve.models.layers.rotary import RotaryEmbedding
from dserve.models.parallel import SINGLE, ParallelContext
from dserve.models.weights import attach_loader, replicated_loader


class Selection:
    """The context positions each token of the pass attends to, [T, index_topk] (-1: none), as
    the last full indexer layer chose them."""

    positions: torch.Tensor | None = None


class Indexer(nn.Module):
    """Replicated over attention-TP ranks (small: index_n_heads x index_head_dim), so every rank
    selects the same positions with no collective."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.topk = cfg.index_topk
        self.wq_b = ReplicatedLinear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = ReplicatedLinear(cfg.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        for p in self.k_norm.parameters():
            p.requires_grad_(False)
            attach_loader(p, replicated_loader)
        self.weights_proj = ReplicatedLinear(cfg.hidden_size, self.n_heads)
        rope = replace(cfg.rope, interleaved=cfg.indexer_rope_interleaved)
        self.rotary = RotaryEmbedding(rope)

    def forward(self, x, q_resid, cos_sin, backend, index_layer: int) -> torch.Tensor:
        """The selected context positions of every token, [T, topk]."""
        cos, sin = cos_sin
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        q = self.rotary.apply(q, cos, sin)
        k = self.k_norm(self.wk(x)).unsqueeze(1)
        k = self.rotary.apply(k, cos, sin).squeeze(1)
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        scale = self.head_dim**-0.5
        return backend.forward_indexer(index_layer, q, k, weights, scale, self.topk)

    def map_key(self, suffix: str) -> tuple[str, object] | None:
        names = (
            "wq_b.weight",
            "wk.weight",
            "k_norm.weight",
            "k_norm.bias",
            "weights_proj.weight",
        )
        return (suffix, None) if suffix in names else None


class DsaAttention(MLAttention):
    def __init__(self, cfg: ModelConfig, layer_id: int, ctx: ParallelContext):
        super().__init__(cfg, layer_id, ctx)
        if not cfg.q_lora_rank:
            raise ValueError("sparse attention reads the q-LoRA latent: q_lora_rank is required")
        self.indexer = Indexer(cfg) if cfg.has_indexer(layer_id) else None
        self.index_layer = -1  # its layer in the stage's indexer pool (set by the model)
        self.selection = Selection()  # shared by the stage's layers (set by the model)

    def forward(self, x: torch.Tensor, cos_sin, backend) -> torch.Tensor:
        q_latent, q_rope, latent, q_resid = self.project(x, cos_sin)
        if self.indexer is not None:
            chosen = self.indexer(x, q_resid, cos_sin, backend, self.index_layer)
            self.selection.positions = chosen
        o_latent = backend.forward_mla(
            self.layer_id, q_latent, q_rope, latent, self.scale, self.selection.positions
        )
        return self.output(o_latent)

    def map_key(self, suffix: str) -> tuple[str, object] | None:
        if suffix.startswith("indexer."):
            if self.indexer is None:
                return None
            inner = self.indexer.map_key(suffix[len("indexer.") :])
            return None if inner is None else ("indexer." + inner[0], inner[1])
        return super().map_key(suffix)


def number_indexers(model: nn.Module) -> int:
    """Give the sparse-attention layers of `model` that have an indexer their layers in its
    indexer pool (in order), and the others one `Selection` to share; returns how many."""
    selection, count = Selection(), 0
    for module in model.modules():
        if isinstance(module, DsaAttention):
            module.selection = selection
            if module.indexer is not None:
                module.index_layer = count
                count += 1
    return count


class DsaForCausalLM(CausalLM):
    attention_cls = DsaAttention

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext = SINGLE):
        super().__init__(cfg, ctx)
        first = self.layer_ids.start
        if not cfg.has_indexer(first):
            raise ValueError(
                f"pipeline stage starting at layer {first}: that layer reuses the selection of "
                f"the layer before it (indexer_types 'shared'), which another stage computes; "
                f"choose a partition whose stages start at 'full' indexer layers"
            )
        self.index_layers = index_layers = number_indexers(self)
        before = sum(cfg.has_indexer(i) for i in range(first))
        self.index_layer_range = range(before, before + index_layers)
        """The model's indexer layers this stage holds (indexer-pool layers, numbered over the
        whole model): what transfer pairs across pipeline partitions."""
        self.total_index_layers = sum(map(cfg.has_indexer, range(cfg.num_hidden_layers)))
