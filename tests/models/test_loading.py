"""Checkpoint loading: sharded safetensors as published, clear errors naming the tensor and file,
and the MTP layer of `make-tiny --mtp` in the public key layout."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dserve.models.loader import load_model
from dserve.models.weights import WeightLoadError, checkpoint_files


def _copy(src: str, dst) -> str:
    out = str(dst / "ckpt")
    shutil.copytree(src, out)
    return out


def _edit_shard_with(path: str, key: str, edit) -> str:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shard = json.load(f)["weight_map"][key]
    file = os.path.join(path, shard)
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return shard


def test_checkpoint_is_sharded_like_a_published_one(tiny_dir):
    path = tiny_dir("deepseek_v3")
    assert len(checkpoint_files(path)) > 1
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        keys = json.load(f)["weight_map"]
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in keys
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in keys


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    path = _copy(tiny_dir("deepseek_v3"), tmp_path)
    key = "model.layers.2.mlp.experts.3.up_proj.weight"
    _edit_shard_with(path, key, lambda t: t.pop(key))
    with pytest.raises(WeightLoadError, match=r"missing tensors for: layers\.2\.mlp\.experts\.w13"):
        load_model(path, progress=False)


def test_unexpected_tensor_is_named_with_its_file(tiny_dir, tmp_path):
    path = _copy(tiny_dir("glm4_moe"), tmp_path)
    key = "model.layers.0.self_attn.q_proj.weight"
    shard = _edit_shard_with(
        path, key, lambda t: t.update({"model.layers.0.self_attn.bogus.weight": torch.ones(2)})
    )
    with pytest.raises(
        WeightLoadError, match=rf"model\.layers\.0\.self_attn\.bogus\.weight in {shard}: unexpected"
    ):
        load_model(path, progress=False)


def test_wrong_shape_is_named_with_its_file(tiny_dir, tmp_path):
    path = _copy(tiny_dir("deepseek_v2"), tmp_path)
    key = "model.layers.1.self_attn.kv_b_proj.weight"
    shard = _edit_shard_with(path, key, lambda t: t.update({key: t[key][:, :-1].contiguous()}))
    with pytest.raises(WeightLoadError, match=rf"{key} in {shard}: shape"):
        load_model(path, progress=False)


def test_mtp_layer_in_public_layout_is_skipped_by_the_target(tiny_dir):
    path = tiny_dir("deepseek_v3", mtp=True)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    n = config["num_hidden_layers"]
    assert config["num_nextn_predict_layers"] == 1
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        keys = set(json.load(f)["weight_map"])
    for suffix in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "embed_tokens.weight",
        "self_attn.kv_b_proj.weight",
        "mlp.experts.0.gate_proj.weight",
        "mlp.gate.e_score_correction_bias",
        "input_layernorm.weight",
    ):
        assert f"model.layers.{n}.{suffix}" in keys
    cfg, model = load_model(path, progress=False)
    assert len(model.layers) == n
    _, plain = load_model(tiny_dir("deepseek_v3"), progress=False)
    for (name, a), (_, b) in zip(model.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name  # same seed, same target weights; the MTP layer is extra


def test_make_tiny_cli(tmp_path):
    from dserve.runtime.cli import main

    out = tmp_path / "glm"
    main(["make-tiny", "--arch", "glm4_moe", "--out", str(out), "--mtp"])
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
