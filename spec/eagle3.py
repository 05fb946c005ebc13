"""The EAGLE-3 draft: a separate checkpoint with one Llama-style decoder layer over three target
hidden states, and its own small LM head over a reduced vocabulary.

The published layout (SpecForge, the EAGLE authors' and SGLang's checkpoints), config
`architectures: ["LlamaForCausalLMEagle3"]` with `draft_vocab_size`, optionally
`target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`:

    fc.weight                      [hidden, 3 * target_hidden]  the three target states -> one
    midlayer.input_layernorm       norm of the token embedding
    midlayer.hidden_norm           norm of the hidden state
    midlayer.self_attn.{q,k,v}_proj  over [input_layernorm(emb); hidden_norm(h)] (2 * hidden wide)
    midlayer.self_attn.o_proj, midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj
    norm.weight, lm_head.weight    [draft_vocab, hidden]
    d2t                            draft id i is target id i + d2t[i]
    t2d                            (unused: which target ids the draft vocabulary has)
    embed_tokens.weight            optional; the target's embedding otherwise

At position i it reads the target's hidden states after the aux layers at i and the embedding of
token i+1, and predicts token i+2. Its output before the final norm is the hidden state it feeds
itself for the next draft token (no `fc` then: it is already `hidden` wide). Its attention is
MHA/GQA whatever the target's is, so its KV pool has its own layout (MHA on an MLA target).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from dserve.attention.backend import AttentionBackend, ForwardBatch
from dserve.models.config import ModelConfig, load_raw_config, parse_glm4_moe
from dserve.models.glm4_moe import GQAttention
from dserve.models.layers.linear import ParallelLMHead, ReplicatedLinear, VocabParallelEmbedding
from dserve.models.layers.mlp import GatedMLP
from dserve.models.layers.norm import RMSNorm
from dserve.models.layers.rotary import RotaryEmbedding
from dserve.models.loader import build_on
from dserve.models.parallel import SINGLE, ParallelContext
from dserve.models.weights import (
    SKIP,
    attach_loader,
    fill_weights,
    iter_checkpoint,
    prefixed,
    replicated_loader,
)

ARCHITECTURE = "LlamaForCausalLMEagle3"
_LAYER_PREFIXES = ("midlayer.", "model.midlayer.", "layers.0.", "model.layers.0.")


@dataclass(frozen=True)
class Eagle3Config:
    """The draft layer's shapes (a Llama config read as full-rotary GQA) and the EAGLE-3 fields."""

    model: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    # target layers whose outputs feed `fc` (-1: the embedding)
    aux_layer_ids: tuple[int, ...] | None


def parse_eagle3_config(raw: dict) -> Eagle3Config:
    arch = (raw.get("architectures") or [""])[0]
    if arch != ARCHITECTURE:
        raise ValueError(
            f"an EAGLE-3 draft checkpoint has architectures [{ARCHITECTURE!r}], got {arch!r}"
        )
    llama = {
        **raw,
        "partial_rotary_factor": 1.0,
        "use_qk_norm": False,
        "n_routed_experts": 0,
        "num_experts": 0,
    }
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(
        parse_glm4_moe(llama, arch),
        int(raw.get("draft_vocab_size") or raw["vocab_size"]),
        int(raw.get("target_hidden_size") or raw["hidden_size"]),
        tuple(ids) if ids else None,
    )


def aux_layer_ids(cfg: Eagle3Config, target_layers: int) -> tuple[int, ...]:
    """The configured layers, else SGLang's default (outputs of layers 1, n/2 - 1, n - 4); each in
    [-1, n - 2], as SGLang captures them at the input of the next layer."""
    ids = cfg.aux_layer_ids or (1, target_layers // 2 - 1, target_layers - 4)
    if len(ids) != 3 or not all(-1 <= i <= target_layers - 2 for i in ids):
        raise ValueError(
            f"EAGLE-3 reads three target layers in [-1, {target_layers - 2}] for a "
            f"{target_layers}-layer target, got {list(ids)}; set eagle_config."
            f"eagle_aux_hidden_state_layer_ids in the draft's config.json"
        )
    return tuple(sorted(ids))


def target_aux_layers(draft_path: str | None, target_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 checkpoint reads, from its config alone."""
    if not draft_path or not os.path.isdir(draft_path):
        raise ValueError(
            f"speculative_algorithm='eagle3' needs speculative_draft_model_path, a directory with "
            f"the EAGLE-3 checkpoint; got {draft_path!r}"
        )
    return aux_layer_ids(parse_eagle3_config(load_raw_config(draft_path)), target_layers)


class Eagle3Draft(nn.Module):
    def __init__(
        self,
        cfg: Eagle3Config,
        target,
        ctx: ParallelContext = SINGLE,
        own_embedding: bool = False,
        embedding: nn.Module | None = None,
    ):
        super().__init__()
        m = cfg.model
        self.cfg, self.eagle, self.ctx = m, cfg, ctx
        h = m.hidden_size
        self.aux_layers = aux_layer_ids(cfg, target.cfg.num_hidden_layers)
        self.fc = ReplicatedLinear(3 * cfg.target_hidden_size, h)
        self.input_layernorm, self.hidden_norm = (
            RMSNorm(h, m.rms_norm_eps),
            RMSNorm(h, m.rms_norm_eps),
        )
        self.self_attn = GQAttention(m, 0, ctx, input_size=2 * h)
        self.rotary = RotaryEmbedding(m.rope)
        object.__setattr__(self.self_attn, "_rotary", self.rotary)
        self.post_attention_layernorm = RMSNorm(h, m.rms_norm_eps)
        # small and dense: split like attention
        self.mlp = GatedMLP(h, m.intermediate_size, ctx.attn)
        self.norm = RMSNorm(h, m.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.draft_vocab_size, h, ctx.attn)
        self.target_vocab = target.cfg.vocab_size
        self.register_buffer(
            "d2t",
            attach_loader(torch.zeros(cfg.draft_vocab_size, dtype=torch.long), replicated_loader),
        )
        if own_embedding:
            self.embed_tokens = VocabParallelEmbedding(target.cfg.vocab_size, h, ctx.attn)
        else:  # the target's (`embedding` where this stage lacks it), not a submodule
            object.__setattr__(
                self, "embed_tokens", embedding if embedding is not None else target.embed_tokens
            )

    def forward(
        self, batch: ForwardBatch, hidden: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """Hidden states before the final norm [T, hidden] for the batch's tokens (token i+1 at
        position i), given the target's aux states [T, 3 * target_hidden] or the draft's own."""
        backend.plan(batch)
        emb = self.embed_tokens(batch.input_ids)
        hidden = hidden.to(emb.dtype)
        if hidden.shape[-1] != emb.shape[-1]:
            hidden = self.fc(hidden)
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        residual = hidden + self.self_attn(
            x, self.rotary.cos_sin(batch.positions, x.dtype), backend
        )
        return residual + self.mlp(self.post_attention_layernorm(residual))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary: the draft's at their target ids, -inf elsewhere."""
        draft = self.lm_head(self.norm(hidden)).float()
        out = torch.full((hidden.shape[0], self.target_vocab), float("-inf"), device=draft.device)
        out[:, torch.arange(draft.shape[-1], device=draft.device) + self.d2t] = draft
        return out

    def map_checkpoint_key(self, key: str) -> tuple[str, object] | None:
        if key in ("t2d", "model.t2d"):
            return SKIP
        for prefix in _LAYER_PREFIXES:
            if key.startswith(prefix):
                suffix = key[len(prefix) :]
                if suffix in (
                    "input_layernorm.weight",
                    "hidden_norm.weight",
                    "post_attention_layernorm.weight",
                ):
                    return suffix, None
                for name in ("self_attn", "mlp"):
                    if suffix.startswith(name + "."):
                        return prefixed(
                            name + ".", getattr(self, name).map_key(suffix[len(name) + 1 :])
                        )
                return None
        key = key.removeprefix("model.")
        if key in ("fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t"):
            return key, None
        return None


def load_eagle3_draft(
    draft_path: str | None,
    target,
    device: torch.device,
    dtype: torch.dtype,
    ctx: ParallelContext = SINGLE,
    load_format: str = "auto",
    embedding: nn.Module | None = None,
) -> Eagle3Draft:
    """The EAGLE-3 checkpoint at `draft_path` on `device`, checked against the target (with
    load_format="dummy" its config.json alone, random weights, the identity vocabulary map)."""
    target_aux_layers(draft_path, target.cfg.num_hidden_layers)  # checks the path and layers
    cfg = parse_eagle3_config(load_raw_config(draft_path))
    if cfg.target_hidden_size != target.cfg.hidden_size:
        raise ValueError(
            f"the EAGLE-3 draft at {draft_path!r} was made for a target of hidden size "
            f"{cfg.target_hidden_size}; this target's is {target.cfg.hidden_size}"
        )
    own_embedding = load_format != "dummy" and any(
        src.name.removeprefix("model.") == "embed_tokens.weight"
        for src in iter_checkpoint(draft_path)
    )
    draft = build_on(device, dtype, lambda: Eagle3Draft(cfg, target, ctx, own_embedding, embedding))
    fill_weights(draft, draft_path, draft.map_checkpoint_key, load_format, progress=False)
    return draft.eval()
