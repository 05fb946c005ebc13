"""Prefill and decode with different TP / DP: MLA takes the latent from one prefill rank per decode rank,
MHA slices KV heads between ranks. Each shape must give the colocated engine's greedy tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import random_prompts
from tests.servers import assert_all_pages_free, post, start_cluster

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}

SHAPES = [  # (arch, prefill flags, decode flags)
    ("deepseek_v3", ["--tp", "2"], ["--tp", "1"]),
    # tp 1 -> 2: as tp 2 -> tp 2 x dp 2 below, each decode rank takes the latent from one rank
    ("deepseek_v3", ["--tp", "2"], ["--tp", "2", "--dp", "2"]),
    # 2 KV heads, one per prefill rank, both to one decode rank: tests/transfer/test_agent.py
    # moves exactly those bytes (mha 2 -> 1); end to end, the EAGLE-3 draft's MHA pool of
    # test_pd_spec's DeepSeek 2 -> 1 pair takes the same route
    # each decode rank takes its head from the one prefill rank
    (
        "glm4_moe",
        ["--tp", "1"],
        ["--tp", "2"],
    ),
    ("glm4_moe", ["--tp", "2"], ["--tp", "4", "--dp", "2"]),  # attention TP 2 per DP group
]


@pytest.mark.parametrize(
    "arch,prefill_args,decode_args",
    SHAPES,
    ids=[f"{a}-p{'x'.join(p[1::2])}-d{'x'.join(d[1::2])}" for a, p, d in SHAPES],
)
def test_remapped_pair_matches_colocated(
    arch, prefill_args, decode_args, tiny_dir, tmp_path, make_engine
):
    model = tiny_dir(arch)
    prompts = random_prompts(4, 512, [7, 20, 40, 33], seed=5)
    expected = make_engine(model).generate(input_ids=prompts, sampling_params=GREEDY)
    cluster = start_cluster(model, tmp_path, prefill_args, decode_args)
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(
                pool.map(
                    lambda ids: post(
                        cluster.url + "/generate", {"input_ids": ids, "sampling_params": GREEDY}
                    ),
                    prompts,
                )
            )
        for (status, body), local in zip(answers, expected):
            assert status == 200, body
            assert body["output_ids"] == local.output_ids
        assert_all_pages_free(cluster.prefill, cluster.decode)
    finally:
        cluster.stop()
