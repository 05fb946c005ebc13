"""Model configuration: one typed view of a Hugging Face `config.json` for every architecture we serve.

Published checkpoints spell the same thing several ways (`rope_scaling` + `rope_theta` in older
files, `rope_parameters` in transformers 5; `n_routed_experts` or `num_experts`); this module
normalises them so the layers read one set of names.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: base, type (default or yarn), the rotated width and its layout."""

    theta: float = 10000.0
    rope_type: str = "default"
    rotary_dim: int = 64
    # DeepSeek: pairs (x0,x1),(x2,x3)...; GLM: rotate-half over the first rotary_dim
    interleaved: bool = False
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """The fields the layers need, with the architecture family decided once (`attention_kind`)."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    rope: RopeConfig
    attention_kind: str  # "mla" or "mha"
    attention_bias: bool = False
    # MLA (DeepSeek)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MHA/GQA (GLM)
    head_dim: int = 0
    use_qk_norm: bool = False
    # MoE
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    # "sigmoid" (V3, GLM) with e_score_correction_bias, "softmax" (V2)
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"  # "noaux_tc" (V3, GLM), "greedy" / "group_limited_greedy" (V2)
    num_nextn_predict_layers: int = 0
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the lightning indexer; 0: dense MLA
    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    indexer_types: tuple[str, ...] = ()
    """Per layer "full" (runs its indexer) or "shared" (reuses the previous full layer's
    selection; GLM-5)."""
    indexer_rope_interleaved: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_id >= self.first_k_dense_replace
            and layer_id % self.moe_layer_freq == 0
        )

    def has_indexer(self, layer_id: int) -> bool:
        """A sparse-attention layer with its own indexer; an MTP (NextN) layer, after the
        model's layers, always has one."""
        if not self.index_topk:
            return False
        return layer_id >= len(self.indexer_types) or self.indexer_types[layer_id] == "full"

    @property
    def softmax_scale(self) -> float:
        """Attention softmax scale, including DeepSeek YaRN's mscale^2 correction."""
        dim = self.qk_head_dim if self.attention_kind == "mla" else self.head_dim
        scale = dim**-0.5
        if (
            self.attention_kind == "mla"
            and self.rope.rope_type == "yarn"
            and self.rope.mscale_all_dim
        ):
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    import math

    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_config(raw: dict[str, Any], rotary_dim: int, interleaved: bool) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"rope type {rope_type!r} is not supported (default, yarn)")
    factor = params.get("factor")
    orig = params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 4096))
    if rope_type == "yarn" and factor is None:
        factor = raw["max_position_embeddings"] / orig
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        rotary_dim=rotary_dim,
        interleaved=interleaved,
        factor=float(factor or 1.0),
        original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=params.get("truncate", True),
    )


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _common(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    n_experts = raw.get("n_routed_experts", raw.get("num_experts")) or 0
    return dict(
        architecture=arch,
        model_type=raw.get("model_type", ""),
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        hidden_act=raw.get("hidden_act", "silu"),
        attention_bias=bool(raw.get("attention_bias", False)),
        n_routed_experts=n_experts,
        n_shared_experts=raw.get("n_shared_experts") or 0,
        moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
        num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
        first_k_dense_replace=raw.get("first_k_dense_replace") or 0,
        moe_layer_freq=raw.get("moe_layer_freq") or 1,
        n_group=raw.get("n_group") or 1,
        topk_group=raw.get("topk_group") or 1,
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        num_nextn_predict_layers=raw.get("num_nextn_predict_layers") or 0,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
        raw=raw,
    )


def parse_deepseek(raw: dict[str, Any], arch: str, **extra) -> ModelConfig:
    is_v2 = raw.get("model_type") == "deepseek_v2" or arch == "DeepseekV2ForCausalLM"
    rope = _rope_config(raw, raw["qk_rope_head_dim"], interleaved=raw.get("rope_interleave", True))
    topk_method = raw.get("topk_method", "greedy" if is_v2 else "noaux_tc")
    scoring = raw.get("scoring_func", "softmax" if is_v2 else "sigmoid")
    return ModelConfig(
        **_common(raw, arch),
        rope=rope,
        attention_kind="mla",
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=raw["kv_lora_rank"],
        qk_nope_head_dim=raw["qk_nope_head_dim"],
        qk_rope_head_dim=raw["qk_rope_head_dim"],
        v_head_dim=raw["v_head_dim"],
        scoring_func=scoring,
        topk_method=topk_method,
        **extra,
    )


def parse_dsa(raw: dict[str, Any], arch: str) -> ModelConfig:
    """DeepSeek-V3.2 and GLM-5: DeepSeek's MLA and MoE plus the lightning indexer. GLM-5 ropes
    the indexer's keys in interleaved pairs, V3.2 in halves (`indexer_rope_interleave`, else by
    architecture, as the reference implementations do)."""
    glm = arch == "GlmMoeDsaForCausalLM"
    return parse_deepseek(
        raw,
        arch,
        index_topk=raw["index_topk"],
        index_head_dim=raw["index_head_dim"],
        index_n_heads=raw["index_n_heads"],
        indexer_types=_indexer_types(raw),
        indexer_rope_interleaved=bool(raw.get("indexer_rope_interleave", glm)),
    )


def _indexer_types(raw: dict[str, Any]) -> tuple[str, ...]:
    """GLM-5's per-layer indexer modes as its config spells them (a list, a "FS.." pattern, or
    a frequency and offset); every layer "full" for V3.2."""
    n = raw["num_hidden_layers"]
    types = raw.get("indexer_types")
    pattern = raw.get("index_topk_pattern")
    if types is None and isinstance(pattern, str):
        types = [{"F": "full", "S": "shared"}[c] for c in pattern]
    elif types is None and pattern is not None:
        types = list(pattern)
    elif types is None:
        freq = max(raw.get("index_topk_freq", 1), 1)
        offset = raw.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(types) < n or types[0] != "full" or set(types) - {"full", "shared"}:
        raise ValueError(
            f"indexer_types {types}: one of 'full' / 'shared' per layer, the first 'full'"
        )
    return tuple(types[:n])


def parse_glm4_moe(raw: dict[str, Any], arch: str) -> ModelConfig:
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))
    rope = _rope_config(raw, int(head_dim * partial), interleaved=False)
    return ModelConfig(
        **_common(raw, arch),
        rope=rope,
        attention_kind="mha",
        head_dim=head_dim,
        use_qk_norm=bool(raw.get("use_qk_norm", False)),
        scoring_func="sigmoid",
        topk_method="noaux_tc",
    )


def load_raw_config(model_path: str) -> dict[str, Any]:
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no config.json in {model_path!r}: is it a Hugging Face checkpoint directory?"
        )
    with open(path) as f:
        return json.load(f)
