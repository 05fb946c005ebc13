"""`load_format="dummy"`: a model from config.json alone with random weights made on the device, as
vLLM and SGLang offer, so real shapes can be timed without a checkpoint on disk."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture
def config_only(tiny_dir, tmp_path):
    out = tmp_path / "config-only"
    out.mkdir()
    shutil.copy(os.path.join(tiny_dir("deepseek_v3"), "config.json"), out)
    return str(out)


def test_config_alone_serves_input_ids(config_only, make_engine):
    engine = make_engine(config_only, load_format="dummy")
    model = engine.executor.runner.model
    assert model.norm.weight.eq(1).all()  # norms start at one, projections at random
    assert model.layers[0].self_attn.kv_b_proj.weight.std() > 0.01
    result = engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params=GREEDY)[0]
    assert len(result.output_ids) == 8 and result.text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.generate("a text prompt", sampling_params=GREEDY)


def test_dummy_weights_ignore_the_checkpoint(tiny_dir, make_engine):
    path = tiny_dir("deepseek_v3")
    loaded = make_engine(path).executor.runner.model.embed_tokens.weight
    dummy = make_engine(path, load_format="dummy").executor.runner.model.embed_tokens.weight
    assert not torch.allclose(loaded, dummy)


def test_dummy_target_and_draft_speculate_losslessly(config_only, make_engine):
    """Same seed, same random target: MTP drafting with a random draft leaves the output as is."""
    ids = [[3, 1, 4, 1, 5, 9, 2, 6]]
    plain = make_engine(config_only, load_format="dummy").generate(
        input_ids=ids, sampling_params=GREEDY
    )
    spec = make_engine(
        config_only, load_format="dummy", speculative_algorithm="mtp", speculative_num_steps=2
    )
    assert spec.generate(input_ids=ids, sampling_params=GREEDY)[0].output_ids == plain[0].output_ids


def test_unknown_load_format_is_refused():
    from dserve.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="load_format must be auto or dummy"):
        EngineConfig("x", load_format="pt")
