"""On a GPU host with FlashInfer: the engine on `attention_backend="flashinfer"` gives the Triton
backend's greedy tokens (bf16), with and without MTP draft trees (the trees' verify passes run on the
Triton extend kernel inside the FlashInfer backend), its decode steps and draft chains replaying CUDA
graphs (a wrapper planned again before each replay; with MTP chains the verifies of 4 tokens too)
or, with graphs disabled, run eagerly. The tiny checkpoints are trained on the phrase
corpus of tests/spec (`bench.train_mtp`), whose peaked next-token distributions keep greedy choices
stable under bf16 rounding differences between the two backends' kernels, with attention shapes
FlashInfer's SM90 kernels take: an MLA latent of 128 + 64 (16 heads), GQA heads of 64."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
        reason="needs a GPU and flashinfer",
    ),
]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
CUDA = dict(device="cuda", dtype="bfloat16", max_total_tokens=16384)


FLASHINFER_SHAPES = {
    "deepseek_v3": dict(
        kv_lora_rank=128,
        qk_rope_head_dim=64,
        head_dim=64,
        num_attention_heads=16,
        num_key_value_heads=16,
    ),
    "glm4_moe": dict(head_dim=64),
}


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_flashinfer_engine_matches_triton(arch, tmp_path, make_engine):
    from tests.drafts import train

    path = str(tmp_path)
    info = train(arch, path, steps=120, log=lambda *_: None, shapes=FLASHINFER_SHAPES[arch])
    prompts = info["prompts"][:3]
    want = make_engine(path, attention_backend="triton", **CUDA).generate(
        input_ids=prompts, sampling_params=GREEDY
    )
    mtp = dict(speculative_algorithm="mtp", speculative_num_steps=3)
    for spec, replayed in (
        ({}, True),
        (dict(disable_cuda_graph=True), False),
        ({**mtp, "speculative_eagle_topk": 1}, True),  # chains: verifies of 4 tokens replay
        ({**mtp, "speculative_eagle_topk": 4}, False),  # trees run eagerly
    ):
        engine = make_engine(path, attention_backend="flashinfer", **CUDA, **spec)
        runner = engine.executor.runner
        got = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [g.output_ids for g in got] == [w.output_ids for w in want], spec
        if spec.get("disable_cuda_graph"):
            assert not runner.statics and not runner.static_passes
        if replayed:  # the target's graphs, each with its wrapper planned before each replay
            assert runner.static_passes and runner.statics[0].graphs, spec
            graphs = runner.backend.graphs.values()
            assert graphs and all(g.wrapper is not None for g in graphs), spec
