"""On a GPU host with FlashInfer: the engine on `attention_backend="flashinfer"` gives the Triton
backend's greedy tokens (bf16), with and without MTP draft trees (the trees' verify passes run on the
Triton extend kernel inside the FlashInfer backend). The tiny checkpoints are trained on the phrase
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
    for spec in (
        {},
        dict(speculative_algorithm="mtp", speculative_num_steps=3, speculative_eagle_topk=4),
    ):
        got = make_engine(path, attention_backend="flashinfer", **CUDA, **spec).generate(
            input_ids=prompts, sampling_params=GREEDY
        )
        assert [g.output_ids for g in got] == [w.output_ids for w in want], spec
