"""On a GPU the logits stay on the device and the front moves only what it needs (`step/sampler.py`):
sampled rows still draw from each request's own generator, so a seed gives the same tokens whatever
else is in the batch (with penalties, top-k/top-p, and through speculative verification too), and
logprobs come back for the tokens chosen."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]
CUDA = dict(device="cuda", dtype="float32", max_total_tokens=8192)
SEEDED = {
    "temperature": 0.9,
    "top_k": 50,
    "top_p": 0.95,
    "seed": 7,
    "max_new_tokens": 16,
    "ignore_eos": True,
}
PENALTIES = {"repetition_penalty": 1.1, "frequency_penalty": 0.2}  # such requests do not draft
MTP = dict(speculative_algorithm="mtp", speculative_num_steps=2)


@pytest.mark.parametrize(
    "spec,extra", [({}, PENALTIES), (MTP, {})], ids=["plain-penalties", "mtp-verify"]
)
def test_seeded_sampling_ignores_the_rest_of_the_batch(spec, extra, tiny_dir, make_engine):
    engine = make_engine(tiny_dir("deepseek_v3", mtp=True), **CUDA, **spec)
    prompts, params = random_prompts(4, 512, [9, 30, 5, 17], seed=3), {**SEEDED, **extra}
    alone = engine.generate(input_ids=prompts[0], sampling_params=params)
    others = [{"temperature": 0.7, "max_new_tokens": 12, "ignore_eos": True}] * 3
    crowd = engine.generate(input_ids=prompts, sampling_params=[params] + others)
    assert crowd[0].output_ids == alone.output_ids and len(alone.output_ids) == 16
    if spec:
        assert alone.meta["spec_verify_ct"] > 0  # the sampled request verified drafts


def test_logprobs_of_the_chosen_tokens(tiny_dir, make_engine):
    engine = make_engine(tiny_dir("glm4_moe"), **CUDA)
    params = {"temperature": 0, "max_new_tokens": 8, "return_logprob": True, "top_logprobs_num": 3}
    result = engine.generate(
        input_ids=random_prompts(1, 512, [12], seed=4)[0], sampling_params=params
    )
    pairs, tops = result.meta["output_token_logprobs"], result.meta["output_top_logprobs"]
    assert [token for _, token in pairs] == result.output_ids and len(tops) == 8
    for (logprob, token), top in zip(pairs, tops):
        assert top[0][0] == token and top[0][1] == pytest.approx(logprob) and logprob <= 0
