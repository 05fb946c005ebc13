"""On a host with 2 GPUs: prefill on GPU 0, decode on GPU 1, KV over UCX between the GPUs (CUDA
IPC / NVLink), GLM-5's indexer keys too; greedy float32 output equals the colocated engine's on the
GPU. And speculation in a pipelined decode instance: prefill TP 2 over GPUs 0-1, decode pp 2 over
GPUs 2-3 (over the same two where there are only two) with MTP (the draft on the last stage), the
tokens of the colocated engine without speculation."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_prompts
from tests.servers import check_and_stop, start_cluster

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "glm_moe_dsa"])
def test_pair_across_gpus_matches_colocated(arch, tiny_dir, tmp_path, make_engine):
    model = tiny_dir(arch)
    prompts = random_prompts(4, 512, [9, 70, 130, 200], seed=7)
    flags = ["--device", "cuda", "--dtype", "float32", "--max-total-tokens", "8192"]
    engine = make_engine(model, device="cuda", dtype="float32", max_total_tokens=8192)
    expected = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    cluster = start_cluster(
        model,
        tmp_path,
        flags,
        flags,
        prefill_env={"CUDA_VISIBLE_DEVICES": "0"},
        decode_env={"CUDA_VISIBLE_DEVICES": "1"},
    )
    check_and_stop(cluster, prompts, [r.output_ids for r in expected], GREEDY)


def test_prefill_tp2_to_decode_pp2_with_mtp(tiny_dir, tmp_path, make_engine):
    model = tiny_dir("deepseek_v3", mtp=True)
    prompts = random_prompts(4, 512, [9, 70, 130, 200], seed=8)
    flags = ["--device", "cuda", "--dtype", "float32", "--max-total-tokens", "8192"]
    engine = make_engine(model, device="cuda", dtype="float32", max_total_tokens=8192)
    expected = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    mtp = ["--speculative-algorithm", "mtp", "--speculative-num-steps", "2"]
    # four GPUs: each instance on its own pair, as deployed; two: both share them
    apart = torch.cuda.device_count() >= 4
    cluster = start_cluster(
        model,
        tmp_path,
        [*flags, *mtp, "--tp", "2"],  # the prefill computes the draft's KV too
        [*flags, *mtp, "--pp-size", "2"],
        prefill_env={"CUDA_VISIBLE_DEVICES": "0,1"},
        decode_env={"CUDA_VISIBLE_DEVICES": "2,3" if apart else "0,1"},
    )
    answers = check_and_stop(cluster, prompts, [r.output_ids for r in expected], GREEDY)
    assert all(meta["spec_accept_length"] >= 1.0 for meta in answers), answers
