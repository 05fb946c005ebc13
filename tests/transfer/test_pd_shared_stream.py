"""A stream the pair shares (`SharedStream`): through the router, the prefill sends the client the
first token's events (each request's: a batch, n choices) and the decode the rest. What the
client reads adds up to a colocated instance's stream on every route (text held back at a stop
string's start, logprobs, echo, usage, a request that ends at its first token, several
choices), under one id; a KV transfer that fails after
the first token went out ends the stream with an error event (no retry); a client that leaves
at its first token (while its KV may be on its way) leaves no page held past a few seconds."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import random_prompts
from tests.reference import hf_greedy
from tests.servers import (
    assert_all_pages_free,
    get,
    metric_value,
    post,
    start_cluster,
    start_instance,
    stop_all,
    stream,
    wait_for,
)

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Say hello."}]
GREEDY = {"temperature": 0, "ignore_eos": True}
RETRIES = "dserve_router_retries_total"
CASES = {
    "completions-logprobs-echo": (
        "/v1/completions",
        {
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "logprobs": 2,
            "echo": True,
            "stream_options": {"include_usage": True},
            **GREEDY,
        },
    ),
    "completions-one-token": ("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 1}),
    "chat-logprobs": (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 8,
            "logprobs": True,
            "top_logprobs": 2,
            "stream_options": {"include_usage": True},
            **GREEDY,
        },
    ),
    "chat-one-token": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, **GREEDY}),
    "completions-n2-usage": (
        "/v1/completions",
        {
            "prompt": [[5, 6, 7, 8], [9, 10, 11]],
            "n": 2,
            "max_tokens": 5,
            "logprobs": 1,
            "stream_options": {"include_usage": True},
            **GREEDY,
        },
    ),
    "chat-n2": ("/v1/chat/completions", {"messages": CHAT, "n": 2, "max_tokens": 4, **GREEDY}),
    "generate-batch": (
        "/generate",
        {
            "input_ids": [[3, 4, 5], [6, 7, 8, 9]],
            "sampling_params": {"max_new_tokens": 5, **GREEDY},
        },
    ),
    "generate-stop-logprobs": (
        "/generate",
        {
            "input_ids": [9, 8, 7, 6, 5, 4, 3],
            "sampling_params": {"max_new_tokens": 10, **GREEDY},
            "return_logprob": True,
        },
    ),
}


@pytest.fixture(scope="module")
def colocated(tiny_dir, tmp_path_factory):
    proc = start_instance("serve", tiny_dir("deepseek_v3"), tmp_path_factory.mktemp("serve"))
    yield proc.wait_ready()
    stop_all([proc])


@pytest.mark.parametrize("case", list(CASES))
def test_the_shared_stream_adds_up_to_the_colocated_one(case, default_pair, colocated):
    pair = default_pair("deepseek_v3")
    path, body = CASES[case]
    if "stop" in case:  # two characters from the middle of the answer: held back, then cut
        status, whole = post(colocated.url + path, body)
        assert status == 200 and len(whole["text"]) >= 6, whole
        body = {**body, "sampling_params": {**body["sampling_params"], "stop": whole["text"][3:5]}}
    shared = stream(pair.url + path, body)
    alone = stream(colocated.url + path, body)
    assert_same(client_view(path, shared), client_view(path, alone))
    if path != "/generate":  # one answer: one id and creation time on every event
        assert len({e["id"] for e in shared}) == 1 and len({e["created"] for e in shared}) == 1
    assert_all_pages_free(pair.prefill, pair.decode)


def client_view(path: str, events: list[dict]) -> dict:
    """What a client makes of a stream, per choice (by index): the text, tokens, logprobs and
    finish reason; and the usage."""
    assert events and not any("error" in e for e in events), events
    if path == "/generate":  # each event holds a choice's whole output so far
        last = {e.get("index", 0): e for e in events}
        return {i: _generate_view(e) for i, e in sorted(last.items())}
    usage = [e["usage"] for e in events if e.get("usage")]
    for u in usage:
        u.pop("prompt_tokens_details", None)  # cached tokens: the instance's own prefix cache
    choices = [c for e in events for c in e["choices"]]
    indices = sorted({c["index"] for c in choices})
    mine = lambda i: [c for c in choices if c["index"] == i]  # noqa: E731
    return {"usage": usage, **{i: _choice_view(path, mine(i)) for i in indices}}


def _generate_view(event: dict) -> dict:
    meta = event["meta_info"]
    lps = [[lp, t] for lp, t, _ in meta.get("output_token_logprobs", [])]
    return {"text": event["text"], "ids": event["output_ids"], "lps": lps, **_finish(meta)}


def _choice_view(path: str, choices: list[dict]) -> dict:
    view = {"finish": [c["finish_reason"] for c in choices if c["finish_reason"]]}
    if path == "/v1/completions":
        view["text"] = "".join(c["text"] for c in choices)
        lps = [c["logprobs"] for c in choices if c["logprobs"]]
        view["tokens"] = [t for lp in lps for t in lp["tokens"]]
        view["lps"] = [x for lp in lps for x in lp["token_logprobs"]]
        view["top"] = [x for lp in lps for x in lp["top_logprobs"]]
        return view
    deltas = [c["delta"] for c in choices]
    view["role"] = [d["role"] for d in deltas if "role" in d]
    view["text"] = "".join(d.get("content") or "" for d in deltas)
    entries = [x for c in choices if c["logprobs"] for x in c["logprobs"]["content"]]
    view["lps"] = [(x["token"], x["logprob"], x["top_logprobs"]) for x in entries]
    return view


def assert_same(got, want, where: str = "") -> None:
    """Equal, floats (logprobs) within 1e-4: a batch of other shape sums in another order."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-4), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, got, want)
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), (where, got, want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def _finish(meta: dict) -> dict:
    return {"finish": meta["finish_reason"], "matched": meta.get("matched_stop")}


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "whole"])
def test_a_transfer_that_fails_after_the_first_token_ends_the_stream(shared, tiny_dir, tmp_path):
    """Every KV transfer fails (on purpose, at the prefill). A shared stream still gets its
    first token (it came from the prefill), then an error event naming the failure; the router
    does not try it again (the client has a token). With `--no-shared-streams` the stream
    waits for the decode: no token, the router tries again, and the client gets the failure as
    an HTTP error. A whole answer is tried again and fails as a whole. Neither instance holds
    a page afterwards."""
    cluster = start_cluster(
        tiny_dir("deepseek_v3"),
        tmp_path,
        ["--transfer-fail-rate", "1", "--log-level", "error"],
        router_args=[] if shared else ["--no-shared-streams"],
    )
    try:
        body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "logprobs": 0, **GREEDY}
        retries = lambda: metric_value(get(cluster.url + "/metrics")[1], RETRIES)  # noqa: E731
        if shared:
            events = stream(cluster.url + "/v1/completions", body)
            assert len(events) == 2, events
            assert len(events[0]["choices"][0]["logprobs"]["tokens"]) == 1  # the first token
            assert "injected" in events[-1]["error"]["message"], events[-1]
            assert retries() == 0
        else:
            with pytest.raises(urllib.error.HTTPError) as failed:
                stream(cluster.url + "/v1/completions", body)
            assert failed.value.code >= 500 and b"injected" in failed.value.read()
            assert retries() > 0
        status, answer = post(cluster.url + "/v1/completions", body)
        assert status >= 500 and "injected" in answer["error"]["message"], answer
        assert retries() > 0
        assert_all_pages_free(cluster.prefill, cluster.decode)
    finally:
        cluster.stop()


def test_clients_that_leave_at_the_first_token_leave_no_page_held(default_pair):
    """Each client hangs up at its first event, which the prefill sent just before it pushed
    the KV: the decode keeps its receives posted a moment (ABANDONED), so the prefill's sends
    complete and both sides free the pages within seconds, far below the transfer timeout
    (60 s) that a prefill's sends to cancelled receives would wait for."""
    pair = default_pair("deepseek_v3")
    for ids in random_prompts(6, 512, [120, 200, 90, 160, 240, 64], seed=5):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 50, **GREEDY}}
        req = urllib.request.Request(
            pair.url + "/generate",
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert next(line for line in r if line.startswith(b"data: "))
    assert_all_pages_free(pair.prefill, pair.decode, timeout=8)


def test_a_prefill_asked_directly_gives_its_room_up_when_the_client_leaves(default_pair):
    """`bench.pd_overhead --direct-prefill`'s request: the pair's prefill asked with its
    router's fields, no decode registering the room. Its first event holds transformers'
    first greedy token; the client leaves there, the prefill frees the room's pages within
    seconds, and the pair serves the next request."""
    pair = default_pair("deepseek_v3")
    port = get(pair.prefill.url + "/server_info")[1]["bootstrap_port"]
    ids = random_prompts(1, 512, [150], seed=11)[0]
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": 4, **GREEDY},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
        "bootstrap_room": 123456789,
        "shared_stream": {"id": "direct0123456789abcdef01", "created": 1},
    }
    req = urllib.request.Request(
        pair.prefill.url + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        first = json.loads(next(line for line in r if line.startswith(b"data: "))[6:])
    assert first["output_ids"] == hf_greedy(pair.model, ids, 1)
    assert_all_pages_free(pair.prefill, pair.decode, timeout=8)
    again = random_prompts(1, 512, [60], seed=12)[0]
    status, answer = post(
        pair.url + "/generate",
        {"input_ids": again, "sampling_params": {"max_new_tokens": 4, **GREEDY}},
    )
    assert status == 200 and answer["output_ids"] == hf_greedy(pair.model, again, 4), answer


def test_a_decode_killed_after_the_first_token_ends_the_stream_at_once(tiny_dir, tmp_path):
    """The client has its first token (from the prefill) when its decode dies: the stream ends
    with an error event naming the decode within seconds, the prefill frees the room's pages,
    and the router takes the decode out of rotation."""
    cluster = start_cluster(
        tiny_dir("deepseek_v3"), tmp_path, ["--transfer-timeout-s", "5", "--log-level", "error"]
    )
    try:
        body = {"input_ids": [7] * 40, "sampling_params": {"max_new_tokens": 100000, **GREEDY}}
        req = urllib.request.Request(
            cluster.url + "/generate",
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        events = []
        with urllib.request.urlopen(req, timeout=60) as r:
            lines = (line for line in r if line.startswith(b"data: "))
            events.append(json.loads(next(lines)[6:]))  # the first token
            cluster.decode.kill()
            killed = time.monotonic()
            for line in lines:
                if line.strip() == b"data: [DONE]":
                    break
                events.append(json.loads(line[6:]))
        assert time.monotonic() - killed < 10
        assert len(events[0]["output_ids"]) == 1
        assert "decode" in events[-1]["error"]["message"], events[-1]
        assert_all_pages_free(cluster.prefill, timeout=20)
        health = lambda: get(cluster.url + "/health")[0] == 503  # noqa: E731
        wait_for(health, 15, "the router takes the dead decode out of rotation")
    finally:
        cluster.stop()
