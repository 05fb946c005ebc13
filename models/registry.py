"""Architecture registry: `architectures[0]` of config.json -> config parser and model class (lazy imports)."""

from __future__ import annotations

import importlib
from typing import Any

from dserve.models.config import (
    ModelConfig,
    load_raw_config,
    parse_deepseek,
    parse_dsa,
    parse_glm4_moe,
)

_ARCHITECTURES: dict[str, tuple[Any, str]] = {
    "DeepseekV3ForCausalLM": (parse_deepseek, "dserve.models.deepseek:DeepseekForCausalLM"),
    "DeepseekV2ForCausalLM": (parse_deepseek, "dserve.models.deepseek:DeepseekForCausalLM"),
    "Glm4MoeForCausalLM": (parse_glm4_moe, "dserve.models.glm4_moe:Glm4MoeForCausalLM"),
    "DeepseekV32ForCausalLM": (parse_dsa, "dserve.models.dsa:DsaForCausalLM"),
    "GlmMoeDsaForCausalLM": (parse_dsa, "dserve.models.dsa:DsaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve(model_path: str) -> tuple[ModelConfig, type]:
    raw = load_raw_config(model_path)
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in _ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unknown architecture {archs or '(none given)'} in {model_path}/config.json; "
            f"supported: {', '.join(supported_architectures())}"
        )
    parse, target = _ARCHITECTURES[arch]
    module, cls = target.split(":")
    return parse(raw, arch), getattr(importlib.import_module(module), cls)
