"""The HTTP API of a colocated instance (`dserve serve`): answers, streaming, and bad input that gets
HTTP 400 with a message while the server keeps serving."""

from __future__ import annotations

import pytest

from tests.servers import Proc, assert_all_pages_free, get, post, start_instance, stream

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    model = tiny_dir("deepseek_v3")
    proc = start_instance(
        "serve", model, tmp_path_factory.mktemp("serve"), "--max-request-bytes", "65536"
    )
    proc.wait_ready()
    proc.model = model
    yield proc
    proc.stop()


def test_generate_and_stream_match_engine(server: Proc, make_engine):
    expected = make_engine(server.model).generate("hello there", sampling_params=GREEDY)
    status, body = post(
        server.url + "/generate", {"text": "hello there", "sampling_params": GREEDY}
    )
    assert status == 200
    assert body["output_ids"] == expected.output_ids and body["text"] == expected.text
    assert body["meta_info"]["prompt_tokens"] == expected.meta["prompt_tokens"]
    events = stream(server.url + "/generate", {"text": "hello there", "sampling_params": GREEDY})
    # SGLang streams the whole output so far in each event
    assert events[-1]["output_ids"] == expected.output_ids
    assert events[-1]["text"] == expected.text
    assert all(e["output_ids"] == expected.output_ids[: len(e["output_ids"])] for e in events)


def test_models_health_metrics(server: Proc):
    assert get(server.url + "/health") == (200, {"status": "ok"})
    status, models = get(server.url + "/v1/models")
    assert status == 200 and models["data"][0]["id"]
    post(server.url + "/generate", {"input_ids": [5, 6, 7], "sampling_params": GREEDY})
    status, text = get(server.url + "/metrics")
    for name in (
        "dserve_requests_total",
        "dserve_time_to_first_token_seconds_bucket",
        "dserve_kv_pages_used",
        "dserve_num_running_requests",
        "dserve_inter_token_latency_seconds_count",
    ):
        assert name in text


BOOT = {"text": "a", "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 1}
BAD = [
    (b"{not json", "not valid JSON"),
    (b'{"text": "\xff"}', "not valid JSON"),  # not UTF-8
    (b'{"text": "a", "sampling_params": {"temperature": NaN}}', "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    ({"text": 5}, "text must be a string"),
    ({"text": "a", "input_ids": [1]}, "exactly one"),
    ({"input_ids": [1, "x"]}, "prompt must be"),
    ({"input_ids": [10**9]}, "unknown token ids"),
    ({"text": "a", "sampling_params": {"temprature": 0.5}}, "unknown sampling parameter"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 2}}, "top_p"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
    ({"text": "a", "stream": "yes"}, "stream"),
    ({"text": "a", "colour": "blue"}, "unknown field"),
    ({"input_ids": [7] * 5000}, "context"),
    (
        {"text": "a", "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 1},
        "serves alone",
    ),
    ({"text": "a", "shared_stream": {"id": "x", "created": 1}}, "needs the bootstrap fields"),
    ({**BOOT, "shared_stream": {"id": "x", "created": 1}}, "needs stream: true"),
    ({**BOOT, "stream": True, "shared_stream": {"id": "x y", "created": 1}}, "alphanumeric"),
    ({**BOOT, "stream": True, "shared_stream": {"id": "x"}}, "object of id and created"),
]


@pytest.mark.parametrize("body,message", BAD, ids=[m for _, m in BAD])
def test_bad_generate_input_is_400(server: Proc, body, message):
    status, answer = post(server.url + "/generate", body)
    assert status == 400, answer
    assert message in answer["error"]["message"]


def test_bad_openai_input_and_oversized_body(server: Proc):
    status, answer = post(server.url + "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and "messages" in answer["error"]["message"]
    status, answer = post(server.url + "/v1/completions", {"prompt": "a", "n": 2, "best_of": 3})
    assert status == 400 and "best_of" in answer["error"]["message"]
    status, answer = post(server.url + "/v1/completions", {"prompt": "a" * 100_000})
    assert status in (400, 413)
    # after all that, it still serves and holds nothing
    assert post(server.url + "/v1/completions", {"prompt": "ok", "max_tokens": 2})[0] == 200
    assert_all_pages_free(server)
