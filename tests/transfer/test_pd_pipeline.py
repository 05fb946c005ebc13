"""Disaggregation with pipeline parallelism on either side, through real processes, HTTP and UCX:
each decode rank receives exactly the layers it holds from the prefill ranks holding them, whatever
the two sides' stage partitions. Greedy tokens are transformers'; no page stays used on either
side. The last shape's decode instance spans two emulated hosts (one stage on each)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import random_prompts
from tests.reference import hf_greedy
from tests.servers import assert_all_pages_free, free_port, post, start_cluster, start_instance

pytestmark = pytest.mark.slow
NEW_TOKENS = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
TWO_HOSTS = "two-hosts"

SHAPES = {  # id: (arch, prefill flags, decode flags)
    # prefill tp 2 -> decode pp 2: tests/spec/test_spec_pipeline.py (with MTP drafts)
    "p-pp2-d-tp2": ("glm4_moe", ["--pp-size", "2"], ["--tp", "2"]),
    "p-pp2-d-pp2xtp2-dp2": (
        "deepseek_v3",
        ["--pp-size", "2", "--pp-layer-partition", "1,2"],
        ["--pp-size", "2", "--tp", "2", "--dp", "2", "--pp-layer-partition", "2,1"],
    ),
    "p-pp2-d-pp2-two-hosts": ("glm4_moe", ["--pp-size", "2"], ["--pp-size", "2", TWO_HOSTS]),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_pipelined_pair_gives_the_reference_tokens(shape, tiny_dir, tmp_path):
    arch, prefill_args, decode_args = SHAPES[shape]
    model = tiny_dir(arch)
    other_host = None
    if TWO_HOSTS in decode_args:
        decode_args = [a for a in decode_args if a != TWO_HOSTS]
        nodes = ["--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
        other_host = start_instance(
            "decode", model, tmp_path, *decode_args, *nodes, "--node-rank", "1"
        )
        decode_args += [*nodes, "--node-rank", "0"]
    prompts = random_prompts(4, 512, [7, 20, 40, 33], seed=8)
    try:
        cluster = start_cluster(model, tmp_path, prefill_args, decode_args)
        try:
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda ids: ask(cluster.url, ids), prompts))
            for (status, body), prompt in zip(answers, prompts):
                assert status == 200, body
                assert body["output_ids"] == hf_greedy(model, prompt, NEW_TOKENS)
            assert_all_pages_free(cluster.prefill, cluster.decode)
        finally:
            cluster.stop()
    finally:
        if other_host is not None:
            other_host.stop()


def ask(url: str, ids: list[int]) -> tuple[int, dict]:
    return post(url + "/generate", {"input_ids": ids, "sampling_params": GREEDY})
