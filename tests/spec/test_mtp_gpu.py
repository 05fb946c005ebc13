"""On a GPU host: MTP speculation on CUDA (float32) gives the plain engine's greedy tokens and leaves
both pools accounted for. Checked on an H100 on 2026-11-22 (see the issue notes)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]
GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
CUDA = dict(device="cuda", dtype="float32", max_total_tokens=65536)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize(
    "steps,topk,naive", [(1, 1, False), (3, 1, False), (3, 4, False), (1, 1, True)]
)
def test_mtp_on_gpu_is_lossless(arch, steps, topk, naive, tiny_dir, make_engine):
    """Chains, draft trees (KV moves on the device) and the naive fused step."""
    path = tiny_dir(arch, mtp=True)
    prompts = random_prompts(3, 512, [5, 40, 130], seed=0)
    expected = make_engine(path, **CUDA).generate(input_ids=prompts, sampling_params=GREEDY)
    engine = make_engine(
        path,
        speculative_algorithm="mtp",
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_naive=naive,
        **CUDA,
    )
    got = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [g.output_ids for g in got] == [e.output_ids for e in expected]
    assert all(g.meta["spec_verify_ct"] >= 1 for g in got)
