"""On a host with 2 GPUs: prefill on GPU 0, decode on GPU 1, KV over UCX between the GPUs (CUDA IPC /
NVLink); greedy float32 output equals the colocated engine's on the GPU."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_prompts
from tests.servers import assert_all_pages_free, post, start_cluster

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
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
    try:
        for ids, local in zip(prompts, expected):
            status, body = post(
                cluster.url + "/generate", {"input_ids": ids, "sampling_params": GREEDY}
            )
            assert status == 200, body
            assert body["output_ids"] == local.output_ids
        assert_all_pages_free(cluster.prefill, cluster.decode)
    finally:
        cluster.stop()
