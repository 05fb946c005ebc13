"""What a disaggregated pair does when things go wrong: every case ends in a clear error for the
client, both instances get every page back (in-flight and quarantined ones included), and the pair
still serves new requests."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.servers import (
    GREEDY,
    assert_all_pages_free,
    free_port,
    generate,
    get,
    metric_value,
    post,
    start_cluster,
    start_instance,
    start_router,
    stop_all,
    wait_for,
)

pytestmark = pytest.mark.slow


def test_injected_transfer_failures(tiny_dir, tmp_path):
    """Half the rooms fail on the prefill's side: with the router's retries and circuit breaker
    off, those requests get HTTP 500 naming the failure, the others succeed, and no page stays
    held on either side."""
    cluster = start_cluster(
        tiny_dir("deepseek_v3"),
        tmp_path,
        ["--transfer-fail-rate", "0.5"],
        router_args=["--retry-max-retries", "0", "--cb-failure-threshold", "100"],
    )
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: generate(cluster.url, [10 + i] * (5 + i)), range(16)))
        failed = [b for s, b in answers if s != 200]
        assert all(s in (200, 500, 502) for s, _ in answers)  # 502: the prefill's error, relayed
        assert 0 < len(failed) < 16
        assert all("injected" in b["error"]["message"] for b in failed), failed
        assert_all_pages_free(cluster.prefill, cluster.decode)
        _, metrics = get(cluster.prefill.url + "/metrics")
        assert metric_value(metrics, "dserve_kv_transfer_failures_total") == len(failed)
    finally:
        cluster.stop()


def test_push_report_never_back_fails_the_room_at_its_deadline(tiny_dir, tmp_path, make_engine):
    """The prefill's agent holds the first room unsent and reports it only long after (a wedged
    agent, `--transfer-stall-rooms`): the prefill fails the room at transfer timeout + report
    margin naming the agent whose report is missing, the router drops the decode's request (it
    never decodes), both instances get every page back, the late report is ignored, and the
    pair serves the next request with the colocated engine's tokens."""
    timeout, margin = 2, 2  # the agent reports the stalled room after 2 * (timeout + margin)
    model = tiny_dir("deepseek_v3")
    prompt = [3 + i % 11 for i in range(40)]  # over a chunk: parts leave before the final push
    expected = make_engine(model).generate(input_ids=[prompt], sampling_params=GREEDY)[0]
    prefill_args = ["--transfer-timeout-s", str(timeout), "--transfer-report-margin-s"]
    prefill_args += [str(margin), "--transfer-stall-rooms", "1"]
    cluster = start_cluster(model, tmp_path, prefill_args, router_args=["--retry-max-retries", "0"])
    try:
        start = time.monotonic()
        status, answer = generate(cluster.url, prompt)
        waited = time.monotonic() - start
        message = answer["error"]["message"]
        assert status == 502 and "no report from transfer agent(s) 0-0-0" in message, answer
        assert timeout + margin - 0.1 < waited < timeout + margin + 5, waited
        assert_all_pages_free(cluster.prefill, cluster.decode)

        status, answer = generate(cluster.url, prompt)
        assert status == 200 and answer["output_ids"] == expected.output_ids, answer
        _, metrics = get(cluster.decode.url + "/metrics")
        generated = metric_value(metrics, "dserve_generation_tokens_total")
        assert generated == len(expected.output_ids)  # the failed room never decoded
        _, metrics = get(cluster.prefill.url + "/metrics")
        assert metric_value(metrics, "dserve_kv_transfer_failures_total") == 1
        wait_for(
            lambda: "late report of agent 0-0-0 (room given up), ignored" in cluster.prefill.tail(),
            2 * (timeout + margin) + 10,
            "the prefill logs the stalled room's late report",
        )
        assert generate(cluster.url, prompt)[0] == 200
        assert_all_pages_free(cluster.prefill, cluster.decode)
    finally:
        cluster.stop()


TREE = ["--speculative-algorithm", "mtp", "--speculative-num-steps", "3"]
TREE += ["--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "6"]
DISCONNECTS = {  # id: (MTP layer, prefill flags, decode flags)
    "plain": (False, [], []),
    # an untrained draft: most nodes are rejected, and the client leaves mid-verify
    "mtp-tree-decode-pp2": (True, TREE, [*TREE, "--pp-size", "2"]),
}


@pytest.mark.parametrize("case", list(DISCONNECTS))
def test_client_disconnect_mid_stream(case, tiny_dir, tmp_path):
    mtp, prefill, decode = DISCONNECTS[case]
    cluster = start_cluster(tiny_dir("deepseek_v3", mtp=mtp), tmp_path, prefill, decode)
    try:
        body = {
            "input_ids": [7] * 20,
            "stream": True,
            "sampling_params": {**GREEDY, "max_new_tokens": 100000},
        }
        req = urllib.request.Request(
            cluster.url + "/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: "):
                    break  # the first tokens arrived; now hang up
        wait_for(
            lambda: get(cluster.decode.url + "/debug/kv")[1]["requests"] == 0,
            15,
            "the decode drops the request of the client that left",
        )
        assert_all_pages_free(cluster.prefill, cluster.decode)
        assert generate(cluster.url, [5, 6, 7])[0] == 200
    finally:
        cluster.stop()


def test_decode_killed_in_flight(tiny_dir, tmp_path):
    """SIGKILL the decode while requests are mid-way: clients get errors promptly (no hang), the
    prefill frees everything, and a new decode instance brings the pair back."""
    model = tiny_dir("deepseek_v3")
    prefill = start_instance("prefill", model, tmp_path, "--transfer-timeout-s", "10").wait_ready()
    decode = start_instance("decode", model, tmp_path).wait_ready()
    router = start_router([prefill], [decode], tmp_path).wait_ready()
    procs = [router, prefill, decode]
    try:
        wait_for(lambda: get(router.url + "/health")[0] == 200, 30, "router ready")
        long = {**GREEDY, "max_new_tokens": 400}
        with ThreadPoolExecutor(8) as pool:
            futures = [
                pool.submit(generate, router.url, [20 + i] * (30 + i), **long) for i in range(8)
            ]
            time.sleep(1.0)
            decode.kill()
            start = time.monotonic()
            answers = [f.result(timeout=60) for f in futures]
        assert time.monotonic() - start < 45
        assert any(s >= 500 for s, _ in answers)
        for status, body in answers:
            assert status == 200 or body["error"]["message"], body
        assert_all_pages_free(prefill, timeout=30)
        wait_for(
            lambda: get(router.url + "/health")[0] == 503, 15, "router takes the dead decode out"
        )
        assert generate(router.url, [1, 2, 3])[0] == 503
        # a new decode on the same port comes back into rotation
        port = decode.port
        decode = start_instance("decode", model, tmp_path, port=port)
        procs.append(decode)
        decode.wait_ready()
        wait_for(
            lambda: get(router.url + "/health")[0] == 200,
            30,
            "router puts the new decode in rotation",
        )
        assert generate(router.url, [1, 2, 3])[0] == 200
        assert_all_pages_free(prefill, decode)
    finally:
        stop_all(procs)


def test_bootstrap_and_transfer_timeouts(tiny_dir, tmp_path):
    """A prefill whose decode never registers ends the request at its bootstrap timeout; a decode whose
    KV never comes ends it at its transfer timeout; an unreachable prefill is a 502 at once."""
    model = tiny_dir("deepseek_v3")
    prefill = start_instance("prefill", model, tmp_path, "--bootstrap-timeout-s", "2")
    decode = start_instance("decode", model, tmp_path, "--transfer-timeout-s", "2")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        boot_port = int(prefill.args[prefill.args.index("--bootstrap-port") + 1])
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": boot_port}
        body = {"input_ids": [3] * 12, "sampling_params": GREEDY}

        start = time.monotonic()
        status, answer = post(prefill.url + "/generate", {**body, **room, "bootstrap_room": 11})
        assert status == 500 and "bootstrap timeout" in answer["error"]["message"]
        assert time.monotonic() - start < 15

        status, answer = post(decode.url + "/generate", {**body, **room, "bootstrap_room": 12})
        assert status == 500 and "did not arrive within 2s" in answer["error"]["message"], answer

        status, answer = post(
            decode.url + "/generate",
            {**body, **room, "bootstrap_port": free_port(), "bootstrap_room": 13},
        )
        assert status == 502 and "unreachable" in answer["error"]["message"]

        status, answer = post(decode.url + "/generate", body)
        assert status == 400 and "router" in answer["error"]["message"]
        assert_all_pages_free(prefill, decode)
    finally:
        stop_all([prefill, decode])


def test_incompatible_pair_is_refused_with_the_difference(tiny_dir, tmp_path):
    """The decode refuses the prefill at its first contact (400 naming the difference); the router drops
    the prefill's request, whose pages come back at once (its bootstrap timeout is far away)."""
    cluster = start_cluster(
        tiny_dir("deepseek_v3"),
        tmp_path,
        ["--page-size", "16", "--bootstrap-timeout-s", "120"],
        ["--page-size", "8"],
    )
    try:
        status, answer = generate(cluster.url, [4, 5, 6])
        assert status == 400
        assert "page_size differs (decode: 8, prefill: 16)" in answer["error"]["message"]
        assert_all_pages_free(cluster.prefill, cluster.decode)
    finally:
        cluster.stop()
