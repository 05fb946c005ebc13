"""On a GPU host with FlashInfer: the engine on `attention_backend="flashinfer"` gives the Triton
backend's greedy tokens (bf16), with and without MTP draft trees (the trees' verify passes run on the
Triton extend kernel inside the FlashInfer backend). The tiny checkpoints are the trained ones of
tests/spec, whose peaked next-token distributions keep greedy choices stable under bf16 rounding
differences between the two backends' kernels."""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
                                 reason="needs a GPU and flashinfer")]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
CUDA = dict(device="cuda", dtype="bfloat16", max_total_tokens=16384)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_flashinfer_engine_matches_triton(arch, trained_dir, make_engine):
    path, info = trained_dir(arch)
    prompts = info["prompts"][:3]
    want = make_engine(path, attention_backend="triton", **CUDA).generate(input_ids=prompts, sampling_params=GREEDY)
    for spec in ({}, dict(speculative_algorithm="mtp", speculative_num_steps=3, speculative_eagle_topk=4)):
        got = make_engine(path, attention_backend="flashinfer", **CUDA, **spec).generate(input_ids=prompts,
                                                                                         sampling_params=GREEDY)
        assert [g.output_ids for g in got] == [w.output_ids for w in want], spec
