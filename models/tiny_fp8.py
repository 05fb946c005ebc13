"""Tiny FP8 checkpoints in the published layouts, and the float32 checkpoint they stand for.

`quantize_checkpoint(dir, kind, block)` rewrites a tiny checkpoint (`models/tiny.py`) in place:
every projection inside the decoder layers (attention, dense MLP, experts, shared experts; the
MTP layer's decoder layer too) becomes FP8 with its scale, as DeepSeek-V3 (`block`:
`weight_scale_inv` per block, `quant_method: fp8`) or GLM-4.5-FP8 (`channel`: compressed-tensors
`weight_scale` per output channel) publish them. The embedding, LM head, norms, router gate and
its bias, and the MTP layer's own projections stay as they are. `dequantized_copy` writes the
same weights dequantized exactly (w = q x s, in float32) without a quantization config: what
transformers runs as the reference.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from dserve.models.quant import Fp8Scheme, dequantize_checkpoint, quantize

QUANTIZED = re.compile(r"model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")
KEPT = ("eh_proj.weight",)


def _shards(path: str) -> list[str]:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def _rewrite(path: str, convert) -> None:
    """Apply `convert(tensors) -> tensors` to every shard of the checkpoint in `path` and keep
    the index in step."""
    from safetensors.torch import load_file, save_file

    weight_map = {}
    for shard in _shards(path):
        tensors = convert(load_file(os.path.join(path, shard)))
        save_file(tensors, os.path.join(path, shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in tensors})
    index_path = os.path.join(path, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"] = weight_map
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)


def _update_config(path: str, update) -> None:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    update(config)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def quantize_checkpoint(path: str, kind: str, block: tuple[int, int] = (32, 32)) -> str:
    """Rewrite the checkpoint in `path` as FP8 `kind` ("block" or "channel"); returns `path`."""
    scheme = Fp8Scheme("block", tuple(block)) if kind == "block" else Fp8Scheme("channel")
    scale_suffix = "_scale_inv" if kind == "block" else "_scale"

    def convert(tensors: dict) -> dict:
        out = {}
        for name, t in tensors.items():
            if QUANTIZED.search(name) and not name.endswith(KEPT) and t.dim() == 2:
                q, scale = quantize(t, scheme)
                out[name], out[name + scale_suffix] = q, scale.contiguous()
            else:
                out[name] = t
        return out

    _rewrite(path, convert)
    _update_config(path, lambda c: c.update(quantization_config=_config(scheme)))
    return path


def _config(scheme: Fp8Scheme) -> dict:
    if scheme.kind == "block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(scheme.block),
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "type": "float",
                    "num_bits": 8,
                    "strategy": "channel",
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": {
                    "type": "float",
                    "num_bits": 8,
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                },
            }
        },
    }


def dequantized_copy(path: str, out: str) -> str:
    """The FP8 checkpoint in `path` as float32 weights w = q x s, in `out` (the reference)."""
    from dserve.models.quant import read_scheme

    scheme = read_scheme(path)
    shutil.copytree(path, out, dirs_exist_ok=True)

    def convert(tensors: dict) -> dict:
        out = {}
        for name, t in tensors.items():
            if name.endswith(("_scale_inv", "_scale")):
                continue
            scale = tensors.get(name + "_scale_inv", tensors.get(name + "_scale"))
            out[name] = t if scale is None else dequantize_checkpoint(t, scale, scheme)
        return out

    _rewrite(out, convert)
    _update_config(out, lambda c: c.pop("quantization_config"))
    return out
