"""The MTP (NextN) draft shipped inside DeepSeek-V3/R1 and GLM-4.5 checkpoints.

Published as one more layer after the target's, `model.layers.{num_hidden_layers}.*`: `enorm`,
`hnorm`, `eh_proj`, a full decoder layer of the target's family (MLA or GQA attention, MoE), and
`shared_head.norm` / `shared_head.head`; DeepSeek also stores a copy of the embedding there. At
position i it reads the target's hidden state h_i and the embedding of token i+1 and predicts token
i+2:

    x = eh_proj([enorm(embed(token_{i+1})); hnorm(h_i)])  ->  decoder layer  ->  shared_head.norm
    logits = shared_head.head(that)

A multi-step draft feeds its own output hidden state back in place of the target's. The draft layer
has its own KV pool of one layer (pool layer 0), in the layout of the target's attention.
"""

from __future__ import annotations

import torch
from torch import nn

from dserve.attention.backend import AttentionBackend, ForwardBatch
from dserve.models.base import CausalLM, DecoderLayer
from dserve.models.config import ModelConfig
from dserve.models.layers.linear import ParallelLMHead, ReplicatedLinear, VocabParallelEmbedding
from dserve.models.layers.norm import RMSNorm
from dserve.models.loader import build_on
from dserve.models.parallel import SINGLE, ParallelContext
from dserve.models.weights import SKIP, fill_weights, iter_checkpoint, prefixed

_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


class MTPDraft(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        target: CausalLM,
        ctx: ParallelContext = SINGLE,
        own_embedding: bool = True,
        embedding: nn.Module | None = None,
    ):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.layer_index = cfg.num_hidden_layers  # where the checkpoint stores it
        h = cfg.hidden_size
        self.enorm, self.hnorm = RMSNorm(h, cfg.rms_norm_eps), RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * h, h)
        self.layer = DecoderLayer(cfg, self.layer_index, target.attention_cls, ctx)
        self.layer.self_attn.layer_id = 0  # the draft pool holds this one layer
        if cfg.index_topk:  # sparse attention: its own indexer, layer 0 of its indexer pool
            from dserve.models.dsa import number_indexers

            self.index_layers = number_indexers(self.layer)
        object.__setattr__(self.layer.self_attn, "_rotary", target.rotary)
        self.rotary = target.rotary
        self.final_norm = RMSNorm(h, cfg.rms_norm_eps)  # shared_head.norm
        if own_embedding:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, ctx.attn)
        else:  # the target's (`embedding` where this stage lacks it), not a submodule
            object.__setattr__(
                self, "embed_tokens", embedding if embedding is not None else target.embed_tokens
            )
        self.head = ParallelLMHead(cfg.vocab_size, h, ctx.attn)  # shared_head.head

    def forward(
        self, batch: ForwardBatch, hidden: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """Draft hidden states [T, hidden] for the batch's tokens (token i+1 at position i) given the
        hidden states `hidden` [T, hidden] of position i (the target's, or the draft's own)."""
        backend.plan(batch)
        batch = self.ctx.moe_mask(batch)
        emb = self.embed_tokens(batch.input_ids)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden.to(emb.dtype))], dim=-1))
        x = self.layer(x, self.rotary.cos_sin(batch.positions, x.dtype), backend, batch)
        return self.final_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    def map_checkpoint_key(self, key: str) -> tuple[str, object] | None:
        prefix = f"model.layers.{self.layer_index}."
        if not key.startswith(prefix):
            return SKIP  # the target's tensors
        suffix = key[len(prefix) :]
        if suffix in _OWN:
            return suffix.replace("shared_head.norm", "final_norm"), None
        if suffix == "shared_head.head.weight":
            return "head.weight", None
        if suffix == "embed_tokens.weight":
            return "embed_tokens.weight", None
        return prefixed("layer.", self.layer.map_key(suffix))


def load_mtp_draft(
    model_path: str,
    cfg: ModelConfig,
    target: CausalLM,
    device: torch.device,
    dtype: torch.dtype,
    ctx: ParallelContext = SINGLE,
    load_format: str = "auto",
    embedding: nn.Module | None = None,
) -> MTPDraft:
    """The checkpoint's NextN layer on `device` (random with load_format="dummy", on the target's
    embedding, or `embedding` where given); a clear error when the checkpoint has none."""
    dummy = load_format == "dummy"
    names = set() if dummy else {src.name for src in iter_checkpoint(model_path)}
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    if not dummy and not any(n.startswith(prefix) for n in names):
        raise ValueError(
            f"speculative_algorithm='mtp' needs the checkpoint's MTP (NextN) layer, but {model_path!r} "
            f"has no {prefix}* tensors"
        )
    own_embedding = prefix + "embed_tokens.weight" in names
    draft = build_on(device, dtype, lambda: MTPDraft(cfg, target, ctx, own_embedding, embedding))
    fill_weights(draft, model_path, draft.map_checkpoint_key, load_format, progress=False)
    return draft.eval()
