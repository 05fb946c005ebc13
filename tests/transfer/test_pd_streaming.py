"""KV streaming: a prefill sends a prompt's pages chunk by chunk while the rest of it is computed
(every prefill the test servers start has 16-token chunks, so prompts of more stream). Greedy
tokens stay exact; a room whose last part (the final push) fails never starts decoding; a
prefill that preempts a streaming request, or a client that leaves while one streams, leaves
no page held on either side."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import random_prompts
from tests.reference import hf_greedy
from tests.servers import (
    GREEDY,
    assert_all_pages_free,
    generate,
    get,
    metric_value,
    start_cluster,
    wait_for,
)

pytestmark = pytest.mark.slow


# MHA heads, MLA latents; the default pairs (conftest.py): GLM's from test_pd_serving's last
# tests, DeepSeek's on to test_client_leaves_while_the_prompt_streams
@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
def test_streamed_prompts_keep_the_exact_tokens(arch, default_pair):
    cluster = default_pair(arch)
    prompts = random_prompts(3, 512, [70, 300, 600], seed=5)
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda ids: generate(cluster.url, ids), prompts))
    streamed = []
    for ids, (status, body) in zip(prompts, answers):
        assert status == 200, body
        assert body["output_ids"] == hf_greedy(cluster.model, ids, 6)
        streamed.append(body["meta_info"]["kv_transfer"]["streamed_pages"])
    # how many pages leave early depends on when the decode's registration comes (on a
    # loaded host, late): some must have
    assert sum(streamed) > 0, streamed
    assert_all_pages_free(cluster.prefill, cluster.decode)


def test_client_leaves_while_the_prompt_streams(default_pair):
    """The client hangs up while its long prompt is computed and streamed: the prefill gives
    the room up with a final push carrying the error, the decode stops waiting, no page is
    held, and the pair serves the next request."""
    cluster = default_pair("deepseek_v3")
    ids = random_prompts(1, 512, [900], seed=8)[0]
    body = {"input_ids": ids, "stream": True, "sampling_params": GREEDY}
    request = urllib.request.Request(
        cluster.url + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    response = urllib.request.urlopen(request, timeout=60)
    time.sleep(0.5)  # some chunks computed and streamed
    response.close()
    wait_for(
        lambda: get(cluster.decode.url + "/debug/kv")[1]["requests"] == 0,
        20,
        "the decode drops the request of the client that left",
    )
    assert_all_pages_free(cluster.prefill, cluster.decode, timeout=30)
    assert generate(cluster.url, random_prompts(1, 512, [40], seed=9)[0])[0] == 200


def test_a_room_whose_final_push_fails_never_decodes(tiny_dir, tmp_path):
    """Every room fails at its final push, after its parts went out (the prefill's metrics
    count their bytes): each request gets the prefill's error, the decode generates nothing
    from the partial KV, and every page comes back."""
    fail = ["--transfer-fail-rate", "1.0"]
    no_retries = ["--retry-max-retries", "0", "--cb-failure-threshold", "100"]  # one room each
    cluster = start_cluster(tiny_dir("deepseek_v3"), tmp_path, fail, router_args=no_retries)
    try:
        prompts = random_prompts(3, 512, [400, 500, 600], seed=6)  # long: parts go first
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda ids: generate(cluster.url, ids), prompts))
        for status, body in answers:
            assert status in (500, 502), body
            assert "injected" in body["error"]["message"], body
        _, metrics = get(cluster.prefill.url + "/metrics")
        sent = metric_value(metrics, "dserve_kv_transfer_bytes_total")
        assert sent > 0, "the rooms' parts were sent before their final push failed"
        assert metric_value(metrics, "dserve_kv_transfer_failures_total") == 3
        assert_all_pages_free(cluster.prefill, cluster.decode)
    finally:
        cluster.stop()


def test_preempted_while_streaming(tiny_dir, tmp_path):
    """A prefill pool too small for the prompts in flight preempts requests whose first
    pages already left: those pages stay held until their rooms end, the recomputed prompts
    send the rest, and the tokens are exact."""
    model = tiny_dir("deepseek_v3")
    small = ["--max-total-tokens", "256", "--max-running-requests", "4"]
    cluster = start_cluster(model, tmp_path, small)
    try:
        prompts = random_prompts(4, 512, [150, 170, 190, 210], seed=7)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda ids: generate(cluster.url, ids), prompts))
        for ids, (status, body) in zip(prompts, answers):
            assert status == 200, body
            assert body["output_ids"] == hf_greedy(model, ids, 6)
        preempted = get(cluster.prefill.url + "/debug/kv")[1]["preempted"]
        assert preempted > 0, "no preemption happened"
        assert_all_pages_free(cluster.prefill, cluster.decode)
    finally:
        cluster.stop()
