"""`dserve router` over real instances (two prefills and two decodes, real processes, KV over UCX
on loopback): the cache_aware policy keeps a prompt prefix on one prefill, power_of_two spreads
requests over the decodes, 4xx answers do not trip the circuit breaker while a prefill that
answers 5xx has its requests retried and its circuit opened, `/metrics` has its per-endpoint
latency histograms filled; and a router checks every body, so bad input is its 400 with every
instance up (the check runs once the first try's requests have left) or down."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.runtime.stubs import StubInstance, served_in_thread
from tests.servers import (
    assert_all_pages_free,
    free_port,
    generate,
    get,
    metric_value,
    post,
    start_instance,
    start_router,
    stop_all,
    stream,
    wait_for,
)

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def instances(tiny_dir, tmp_path_factory):
    model, logs = tiny_dir("deepseek_v3"), tmp_path_factory.mktemp("router")
    procs = [start_instance(role, model, logs) for role in ("prefill",) * 2 + ("decode",) * 2]
    try:
        for proc in procs:
            proc.wait_ready()
        yield procs[:2], procs[2:], logs
    finally:
        stop_all(procs)


def router(instances, *flags: str):
    prefills, decodes, logs = instances
    proc = start_router(prefills, decodes, logs, *flags).wait_ready()
    wait_for(lambda: get(proc.url + "/health")[0] == 200, 30, "the router sees its instances")
    return proc


def tries(proc, role: str) -> dict[str, float]:
    """Tries the router sent to each instance of `role`, from its /metrics."""
    text = get(proc.url + "/metrics")[1]
    counts = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "dserve_router_backend_requests_total" and s.labels["role"] == role:
                counts[s.labels["url"]] = s.value
    return counts


def ask(url: str, ids: list[int], **params) -> tuple[int, dict]:
    return generate(url, ids, **{**GREEDY, **params})


def test_cache_aware_keeps_a_prefix_on_one_prefill(instances):
    proc = router(instances, "--policy", "cache_aware")
    try:
        a, b = [11] * 48, [12] * 48  # three blocks each; a request adds a different tail
        for i in range(3):
            for prefix in (a, b):
                status, body = ask(proc.url, prefix + [20 + i])
                assert status == 200, body
            counts = tries(proc, "prefill")
            assert sorted(counts.values()) == [i + 1, i + 1], counts  # one prefix on each
        # each prefill saw its prefix three times: the last two were prefix-cache hits
        for prefill in instances[0]:
            hits = metric_value(get(prefill.url + "/metrics")[1], "dserve_cached_tokens_total")
            assert hits == 2 * 48, prefill.url
    finally:
        proc.stop()


def test_power_of_two_spreads_the_load(instances):
    proc = router(instances, "--policy", "power_of_two")
    try:
        long = {"max_new_tokens": 40}
        with ThreadPoolExecutor(4) as pool:  # in flight together: each pick sees the others
            answers = list(pool.map(lambda i: ask(proc.url, [30 + i] * 5, **long), range(4)))
        assert all(status == 200 for status, _ in answers), answers
        assert sorted(tries(proc, "decode").values()) == [2, 2]
        assert_all_pages_free(*instances[0], *instances[1])
    finally:
        proc.stop()


def test_client_errors_do_not_trip_the_breaker_and_metrics_fill(instances):
    proc = router(instances, "--cb-failure-threshold", "2")
    try:
        for _ in range(4):  # fits the router's checks, refused by the instances (context)
            status, body = ask(proc.url, [7] * 5000)
            assert status == 400 and "context" in body["error"]["message"], body
        text = get(proc.url + "/metrics")[1]
        assert metric_value(text, "dserve_router_backend_circuit_open") == 0
        assert metric_value(text, "dserve_router_backend_healthy") == 4
        assert ask(proc.url, [1, 2, 3])[0] == 200
        usage = {"include_usage": True}  # for the stream; the prefill's whole answer goes without
        body = {"prompt": [4, 5], "max_tokens": 3, "temperature": 0, "stream_options": usage}
        events = stream(proc.url + "/v1/completions", body)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
        # a streamed answer counts once the decode's stream has ended, which may be just after
        # the client read its last event
        latency = "dserve_router_request_latency_seconds"

        def streamed() -> bool:
            page = get(proc.url + "/metrics")[1]
            samples = [s for f in text_string_to_metric_families(page) for s in f.samples]
            count = f"{latency}_count"
            return any(s.name == count and s.labels["endpoint"] == "completions" for s in samples)

        wait_for(streamed, 5, "the streamed answer in the router's metrics")
        text = get(proc.url + "/metrics")[1]
        value = lambda name, **labels: metric_value(text, name, **labels)
        assert value("dserve_router_requests_total", endpoint="generate", outcome="ok") == 1
        assert value("dserve_router_requests_total", outcome="bad_request") == 4
        for endpoint, answers in (("generate", 5), ("completions", 1)):  # errors too
            assert value(f"{latency}_count", endpoint=endpoint) == answers
            assert value(f"{latency}_sum", endpoint=endpoint) > 0
            ttft = "dserve_router_time_to_first_token_seconds"  # of the answers that succeeded
            assert value(f"{ttft}_count", endpoint=endpoint) == 1
            assert value(f"{ttft}_sum", endpoint=endpoint) > 0
        assert value("process_cpu_seconds_total") > 0
    finally:
        proc.stop()


BAD = [
    (b"{not json", "JSON object"),
    (b'{"text": "\xff"}', "JSON object"),  # not UTF-8
    ({"text": 5}, "text must be a string"),
    ({"text": "a", "stream": "yes"}, "stream"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"temprature": 0.5}}, "unknown sampling parameter"),
]


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_bad_input_is_the_routers_400_with_instances_up(instances, policy):
    """Checked after the requests left (round robin) or before the pick (cache aware, which
    reads the prompt): either way the router's 400, no try counted, no page held."""
    proc = router(instances, "--policy", policy)
    try:
        streamed = [
            ({**body, "stream": True}, message)
            for body, message in BAD[2:]
            if isinstance(body, dict) and "stream" not in body
        ]
        for body, message in BAD + streamed:
            status, answer = post(proc.url + "/generate", body)
            assert status == 400 and message in answer["error"]["message"], (body, answer)
        assert sum(tries(proc, "prefill").values()) == 0
        assert ask(proc.url, [1, 2, 3])[0] == 200  # still serving
        assert_all_pages_free(*instances[0], *instances[1])
    finally:
        proc.stop()


def test_bad_input_is_400_with_every_instance_down(tmp_path):
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    port = free_port()
    from tests.servers import Proc

    args = ["router", "--port", str(port), "--prefill", dead[0], "--decode", dead[1]]
    proc = Proc(args, str(tmp_path / "router.log"), port)
    try:
        wait_for(lambda: get(proc.url + "/health")[0] == 503, 30, "the router answers")
        for body, message in BAD:
            status, answer = post(proc.url + "/generate", body)
            assert status == 400 and message in answer["error"]["message"], (body, answer)
        chat = {"messages": "hi", "model": "m"}
        status, answer = post(proc.url + "/v1/chat/completions", chat)
        assert status == 400 and "messages" in answer["error"]["message"], answer
        status, answer = post(proc.url + "/generate", {"text": "fine"})
        assert status == 503 and "no healthy" in answer["error"]["message"], answer
    finally:
        proc.stop()


async def fail(_):
    """Every generation request to a broken prefill: HTTP 500."""
    return web.json_response({"error": {"message": "broken on purpose"}}, status=500)


def test_a_failing_prefill_is_retried_and_its_circuit_opens(instances):
    """A prefill that answers 500 to every request: each request still succeeds (on the real
    prefill), and after two failures in a row the broken one's circuit opens."""
    with served_in_thread(StubInstance(generate=fail)) as broken:
        check_broken_prefill(broken, *instances)


def check_broken_prefill(broken, prefills, decodes, logs):
    flags = ["--cb-failure-threshold", "2", "--cb-timeout-s", "600"]
    proc = start_router([broken, prefills[0]], decodes, logs, *flags).wait_ready()
    try:
        wait_for(lambda: get(proc.url + "/health")[0] == 200, 30, "the router is ready")
        for i in range(6):
            status, body = ask(proc.url, [40 + i] * 6)
            assert status == 200, body
        text = get(proc.url + "/metrics")[1]
        assert tries(proc, "prefill")[broken.url] == 2
        assert metric_value(text, "dserve_router_retries_total") == 2
        assert metric_value(text, "dserve_router_backend_circuit_open", url=broken.url) == 1
        assert metric_value(text, "dserve_router_backend_circuit_open", url=prefills[0].url) == 0
        assert_all_pages_free(*prefills, *decodes)
    finally:
        proc.stop()
