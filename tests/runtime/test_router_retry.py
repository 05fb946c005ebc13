"""The router's retries, in a soak over real processes: one prefill (5% of its KV transfers fail
on purpose) and two decodes behind a router; one decode is killed mid-run. Every request that had
not received a token when its instance failed succeeds on the other pair, every token any client
received equals the colocated engine's greedy token, and the surviving instances hold no page
afterwards."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import random_prompts
from tests.servers import (
    assert_all_pages_free,
    get,
    metric_value,
    post,
    start_instance,
    start_router,
    stop_all,
    wait_for,
)

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
REQUESTS, KILL_AFTER = 60, 20


def stream_tokens(url: str, ids: list[int]) -> tuple[list[int], str | None]:
    """The tokens a streamed request received, and the error that ended it early, if any."""
    body = {"input_ids": ids, "sampling_params": GREEDY, "stream": True}
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    tokens = []
    try:
        with urllib.request.urlopen(req, timeout=90) as r:
            for line in r:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return tokens, event["error"]["message"]
                tokens = event["output_ids"]  # the whole output so far, as SGLang streams
    except urllib.error.HTTPError as e:
        return tokens, f"HTTP {e.code}: {e.read()[:300]!r}"
    except OSError as e:
        return tokens, f"{type(e).__name__}: {e}"
    return tokens, None


def test_a_dead_decode_and_failed_transfers_lose_no_request(tiny_dir, tmp_path, make_engine):
    model = tiny_dir("deepseek_v3")
    prompts = random_prompts(REQUESTS, 512, [5, 9, 17, 24], seed=11)
    expected = [
        r.output_ids for r in make_engine(model).generate(input_ids=prompts, sampling_params=GREEDY)
    ]
    fails = ["--transfer-fail-rate", "0.05", "--transfer-timeout-s", "5"]
    prefill = start_instance("prefill", model, tmp_path, *fails)
    decodes = [start_instance("decode", model, tmp_path, "--transfer-timeout-s", "5")]
    decodes.append(start_instance("decode", model, tmp_path, "--transfer-timeout-s", "5"))
    procs = [prefill, *decodes]
    try:
        for proc in procs:
            proc.wait_ready()
        router = start_router([prefill], decodes, tmp_path).wait_ready()
        procs.append(router)
        wait_for(lambda: get(router.url + "/health")[0] == 200, 30, "the router is ready")

        done = threading.Semaphore(0)

        def one(i: int):
            if i % 2:
                result = stream_tokens(router.url, prompts[i])
            else:
                status, body = post(
                    router.url + "/generate", {"input_ids": prompts[i], "sampling_params": GREEDY}
                )
                result = (body.get("output_ids", []), None if status == 200 else body)
            done.release()
            return result

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(one, i) for i in range(REQUESTS)]
            for _ in range(KILL_AFTER):
                done.acquire(timeout=120)
            decodes[1].kill()  # mid-run: requests in flight on it, more coming
            killed_at = time.monotonic()
            results = [f.result(timeout=120) for f in futures]
        assert time.monotonic() - killed_at < 100

        for i, (tokens, error) in enumerate(results):
            assert tokens == expected[i][: len(tokens)], f"request {i}: wrong tokens"
            if error is None:
                assert tokens == expected[i], f"request {i}"
            else:  # only a stream that had received tokens may fail
                assert i % 2 and tokens, f"request {i} failed before any token: {error}"
        retries = metric_value(get(router.url + "/metrics")[1], "dserve_router_retries_total")
        failed = get(prefill.url + "/metrics")[1]
        failed = metric_value(failed, "dserve_kv_transfer_failures_total")
        cut = sum(e is not None for _, e in results)
        print(
            f"{cut} streams cut after their first tokens, {retries:.0f} retries, "
            f"{failed:.0f} transfers failed (on purpose, or to the dead decode)"
        )
        # a failed transfer's request went to the other pair, unless it was a stream that had
        # tokens (cut). Rooms are random, so a run may inject no failure (0.95 ** 60: 5%) and
        # the kill find only such streams on the dead decode: then nothing was retried
        # (session 32 saw one such run); the checks above hold in every run
        assert retries > 0 or failed <= cut
        assert_all_pages_free(prefill, decodes[0], timeout=30)
    finally:
        stop_all(procs)
