"""What every served model shares: decoder layer, causal LM skeleton and checkpoint key mapping.

A family supplies only its attention module (`attention_cls`); the rest (norms, dense MLP or MoE
per layer, embedding, final norm, LM head) is common to DeepSeek-V2/V3 and GLM-4.5.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from dserve.attention.backend import AttentionBackend, ForwardBatch
from dserve.models.config import ModelConfig
from dserve.models.layers.linear import ParallelLMHead, VocabParallelEmbedding
from dserve.models.layers.mlp import GatedMLP
from dserve.models.layers.moe import MoE
from dserve.models.layers.norm import RMSNorm
from dserve.models.layers.rotary import RotaryEmbedding
from dserve.models.parallel import SINGLE, ParallelContext
from dserve.models.weights import SKIP, prefixed

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, attention_cls: type, ctx: ParallelContext):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention_cls(cfg, layer_id, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ctx = ctx
        self.mlp = (
            MoE(cfg, ctx)
            if cfg.is_moe_layer(layer_id)
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx.mlp)
        )

    def forward(
        self, hidden: torch.Tensor, cos_sin, backend: AttentionBackend, batch: ForwardBatch
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), cos_sin, backend)
        normed, residual = self.post_attention_layernorm.add_and_norm(attn, hidden)
        # MLP/MoE span every rank: with DP attention, gather all groups' tokens, keep ours after
        counts = batch.dp_num_tokens
        mlp_in = self.ctx.gather_tokens(normed, counts)
        if isinstance(self.mlp, MoE):
            out = self.mlp(mlp_in, batch.moe_real_tokens)
        else:
            out = self.mlp(mlp_in)
        return residual + self.ctx.own_tokens(out, counts)

    def map_key(self, suffix: str) -> tuple[str, object] | None:
        if suffix in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return suffix, None
        for name in ("self_attn", "mlp"):
            if suffix.startswith(name + "."):
                return prefixed(name + ".", getattr(self, name).map_key(suffix[len(name) + 1 :]))
        return None


class CausalLM(nn.Module):
    """The model, or with pipeline parallelism one stage of it: its decoder layers
    (`layer_ids`), the embedding on the first stage, the final norm and LM head on the last (a
    tied LM head is the embedding, which the last stage then holds too)."""

    attention_cls: type = None

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext = SINGLE):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        stage = ctx.stage
        self.layer_ids = stage.layer_range(cfg.num_hidden_layers)
        self.embed_tokens = None
        if stage.first or (stage.last and cfg.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.attn)
        self.rotary = RotaryEmbedding(cfg.rope)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.attention_cls, ctx) for i in self.layer_ids
        )
        for local, layer in enumerate(self.layers):
            # one rotary table shared by every attention layer, not a submodule of each
            object.__setattr__(layer.self_attn, "_rotary", self.rotary)
            layer.self_attn.layer_id = local  # its layer in this stage's KV pool
        self.norm = self.lm_head = None
        if stage.last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            if not cfg.tie_word_embeddings:
                self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx.attn)

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """Hidden states after the final norm for every new token of the batch, [T, hidden]."""
        return self.run_layers(batch, backend, ())[0]

    def run_layers(
        self,
        batch: ForwardBatch,
        backend: AttentionBackend,
        aux_layers: tuple[int, ...],
        hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """This model's (or pipeline stage's) layers: the final hidden states (a stage before the
        last: its last layer's output, for the next stage), and by id the outputs of the layers
        of `aux_layers` it holds (-1, the embedding, on the first stage). A stage after the first
        starts from `hidden`, the previous stage's output."""
        backend.plan(batch)
        batch = self.ctx.moe_mask(batch)
        outputs = {}
        if self.ctx.stage.first:
            hidden = self.embed_tokens(batch.input_ids)
            outputs[-1] = hidden
        cos_sin = self.rotary.cos_sin(batch.positions, hidden.dtype)
        for i, layer in zip(self.layer_ids, self.layers):
            hidden = layer(hidden, cos_sin, backend, batch)
            if i in aux_layers:
                outputs[i] = hidden
        outputs = {i: outputs[i] for i in aux_layers if i in outputs}
        return (self.norm(hidden) if self.norm is not None else hidden), outputs

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        return ParallelLMHead.forward(head, hidden).float()

    def map_checkpoint_key(self, key: str) -> tuple[str, object] | None:
        if key.endswith("rotary_emb.inv_freq"):
            return SKIP
        if key == "model.embed_tokens.weight":
            return ("embed_tokens.weight", None) if self.embed_tokens is not None else SKIP
        if key == "model.norm.weight":
            return ("norm.weight", None) if self.norm is not None else SKIP
        if key == "lm_head.weight":
            return ("lm_head.weight", None) if self.lm_head is not None else SKIP
        match = _LAYER_KEY.match(key)
        if match:
            layer_id = int(match.group(1))
            if layer_id not in self.layer_ids:
                return SKIP  # another stage's, or the MTP (NextN) layer the draft loads
            local = layer_id - self.layer_ids.start
            return prefixed(f"layers.{local}.", self.layers[local].map_key(match.group(2)))
        return None
