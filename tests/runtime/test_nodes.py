"""An instance over two hosts, emulated on one: two `dserve serve` launches with `--nnodes 2` on
127.0.0.1, each its own process tree. Node 0 runs the front and rank 0, node 1 rank 1, joined
through the rendezvous store; TP across the nodes, or one pipeline stage on each. Tokens are the
single-host engine's; killing node 1 fails the request in flight with the dead rank named within
seconds, and node 0 stays up to say so."""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import random_prompts
from tests.servers import free_port, get, post, start_instance, stop_all

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.mark.parametrize("shape", [["--tp", "2"], ["--pp-size", "2"]], ids=["tp", "pp"])
def test_two_hosts_give_the_tokens_of_one(shape, tiny_dir, tmp_path, make_engine):
    path = tiny_dir("glm4_moe")
    nodes = ["--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    other = start_instance("serve", path, tmp_path, *shape, *nodes, "--node-rank", "1")
    front = start_instance("serve", path, tmp_path, *shape, *nodes, "--node-rank", "0")
    try:
        front.wait_ready()
        prompts = random_prompts(3, 512, [7, 19, 30], seed=6)
        want = make_engine(path).generate(input_ids=prompts, sampling_params=GREEDY)
        for prompt, expected in zip(prompts, want):
            status, body = post(
                front.url + "/generate", {"input_ids": prompt, "sampling_params": GREEDY}
            )
            assert status == 200, body
            assert body["output_ids"] == expected.output_ids
        long = {"temperature": 0, "max_new_tokens": 900, "ignore_eos": True}
        answer = {}
        thread = threading.Thread(
            target=lambda: answer.update(
                reply=post(
                    front.url + "/generate", {"input_ids": prompts[0], "sampling_params": long}
                )
            )
        )
        thread.start()
        time.sleep(1.0)  # the request decodes on both nodes
        killed = time.monotonic()
        other.kill()
        thread.join(timeout=30)
        assert time.monotonic() - killed < 15
        status, body = answer["reply"]
        assert status == 500 and "rank 1 on node 1" in body["error"]["message"], body
        status, health = get(front.url + "/health")
        assert status == 503 and "rank 1 on node 1" in health["error"]
    finally:
        stop_all([front, other])


def test_a_node_that_never_joins_fails_the_start_naming_it(tiny_dir):
    from dserve.runtime import Engine

    start = time.monotonic()
    with pytest.raises(ValueError, match=r"node\(s\) \[1\] did not join within 2s"):
        Engine(
            tiny_dir("deepseek_v3"),
            device="cpu",
            load_progress=False,
            tp_size=2,
            nnodes=2,
            dist_init_addr=f"127.0.0.1:{free_port()}",
            node_join_timeout_s=2,
        )
    assert time.monotonic() - start < 15
