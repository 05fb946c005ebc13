"""SGLang's native API on a colocated instance: `/generate` with a batch and `n`, incremental
streaming (`--incremental-streaming-output`; the cumulative default is in test_http_api), its
sampling fields, prompt logprobs, and the admin routes."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from tests.servers import Proc, assert_all_pages_free, get, post, start_instance, stream

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("pages_back")]
GREEDY = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    model = tiny_dir("deepseek_v3")
    log_dir = tmp_path_factory.mktemp("sglang")
    proc = start_instance("serve", model, log_dir, "--incremental-streaming-output")
    proc.wait_ready()
    proc.model = model
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def engine(server):
    from dserve.runtime import Engine

    with Engine(server.model, device="cpu", load_progress=False) as engine:
        yield engine


def test_batch_and_n(server: Proc, engine):
    """A list of prompts with n choices each: a list of len * n answers, choice j of prompt i at
    i * n + j, greedy ones equal to the engine's; a seeded choice draws from seed + j."""
    prompts = ["hello there", "the quick brown fox"]
    want = [r.output_ids for r in engine.generate(prompts, sampling_params=GREEDY)]
    params = dict(GREEDY, n=2)
    status, body = post(server.url + "/generate", {"text": prompts, "sampling_params": params})
    assert status == 200, body
    assert [b["output_ids"] for b in body] == [want[0], want[0], want[1], want[1]]
    assert len({b["meta_info"]["id"] for b in body}) == 4
    sampled = dict(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=7)
    status, body = post(
        server.url + "/generate", {"text": "hi", "sampling_params": dict(sampled, n=2)}
    )
    assert status == 200 and isinstance(body, list) and len(body) == 2
    for j, answer in enumerate(body):
        alone = engine.generate("hi", sampling_params=dict(sampled, seed=7 + j))
        assert answer["output_ids"] == alone.output_ids
    status, one = post(server.url + "/generate", {"text": "hi", "sampling_params": GREEDY})
    assert isinstance(one, dict)  # one prompt, n = 1: an object, not a list
    assert_all_pages_free(server)


def test_incremental_stream_of_a_batch(server: Proc, engine):
    ids = [[11, 12, 13, 14], [21, 22, 23]]
    want = [r.output_ids for r in engine.generate(input_ids=ids, sampling_params=GREEDY)]
    events = stream(server.url + "/generate", {"input_ids": ids, "sampling_params": GREEDY})
    for i in (0, 1):
        mine = [e for e in events if e["index"] == i]
        assert [t for e in mine for t in e["output_ids"]] == want[i]
        assert len(mine) > 1 and mine[-1]["meta_info"]["finish_reason"] == "length"
        assert all(e["meta_info"]["finish_reason"] is None for e in mine[:-1])
    assert_all_pages_free(server)


def test_sampling_fields_and_logprobs(server: Proc, engine):
    """min_new_tokens against a bias towards EOS, no_stop_trim, stop_token_ids, prompt logprobs
    from logprob_start_len with the tokens' texts."""
    eos = engine.tokenizer.eos_token_id
    params = {"max_new_tokens": 9, "logit_bias": {str(eos): 100}, "min_new_tokens": 2}
    status, body = post(server.url + "/generate", {"text": "hi", "sampling_params": params})
    assert status == 200 and body["output_ids"][2] == eos and len(body["output_ids"]) == 3
    first = engine.generate("hi", sampling_params=GREEDY).output_ids
    params = dict(GREEDY, stop_token_ids=[first[2]])
    status, body = post(server.url + "/generate", {"text": "hi", "sampling_params": params})
    assert body["output_ids"] == first[:3] and body["meta_info"]["matched_stop"] == first[2]
    ids = [30, 31, 32, 33, 34, 35]
    body = {
        "input_ids": ids,
        "sampling_params": GREEDY,
        "return_logprob": True,
        "logprob_start_len": 2,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    status, answer = post(server.url + "/generate", body)
    assert status == 200, answer
    meta = answer["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids[2:]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == answer["output_ids"]
    decode = engine.tokenizer.decode
    assert all(text == decode([t]) for _, t, text in meta["output_token_logprobs"])
    assert all(len(top) == 2 for top in meta["input_top_logprobs"])
    assert_all_pages_free(server)


def test_no_stop_trim(server: Proc, engine):
    text = engine.generate("tell me", sampling_params=dict(GREEDY, max_new_tokens=10)).text
    stop = text[4:6]
    for trim in (False, True):
        params = dict(GREEDY, max_new_tokens=10, stop=stop, no_stop_trim=trim)
        status, body = post(
            server.url + "/generate", {"text": "tell me", "sampling_params": params}
        )
        assert status == 200 and body["text"].endswith(stop) == trim
        assert text.startswith(body["text"])


def test_admin_routes(server: Proc):
    status, info = get(server.url + "/get_model_info")
    assert status == 200 and info["model_path"] == server.model and info["is_generation"]
    assert get(server.url + "/health_generate")[0] == 200
    prompt = list(range(40, 80))  # more than two pages
    for _ in range(2):
        status, body = post(
            server.url + "/generate", {"input_ids": prompt, "sampling_params": GREEDY}
        )
    assert body["meta_info"]["cached_tokens"] > 0
    assert get(server.url + "/flush_cache")[0] == 200
    status, body = post(server.url + "/generate", {"input_ids": prompt, "sampling_params": GREEDY})
    assert body["meta_info"]["cached_tokens"] == 0
    assert_all_pages_free(server)


def test_abort_request(server: Proc):
    """A request aborted by rid ends at once (its stream gets an error event), a batch by its
    base rid, and every page comes back."""
    long = {"temperature": 0, "max_new_tokens": 900, "ignore_eos": True}
    answers = {}

    def run(rid, body):
        answers[rid] = stream(server.url + "/generate", {**body, "rid": rid})

    threads = [
        threading.Thread(target=run, args=("one", {"text": "a", "sampling_params": long})),
        threading.Thread(target=run, args=("many", {"text": ["b", "c"], "sampling_params": long})),
    ]
    for t in threads:
        t.start()
    time.sleep(1.0)
    status, body = post(server.url + "/abort_request", {"rid": "one"})
    assert status == 200 and body["aborted"] == ["one"]
    status, body = post(server.url + "/abort_request", {"rid": "many"})
    assert sorted(body["aborted"]) == ["many-0", "many-1"]
    for t in threads:
        t.join(30)
    for rid in ("one", "many"):
        assert "aborted" in answers[rid][-1]["error"]["message"]
    status, body = post(server.url + "/abort_request", {"abort_all": "yes"})
    assert status == 400 and "abort_all" in body["error"]["message"]
    assert_all_pages_free(server)


def test_regex_and_json_schema(server: Proc):
    from tests.runtime.test_structured_output import REGEX, SCHEMA, check_json

    params = {"max_new_tokens": 60, "temperature": 0.9, "seed": 4, "regex": REGEX}
    status, body = post(server.url + "/generate", {"text": "x", "sampling_params": params})
    assert status == 200 and re.fullmatch(REGEX, body["text"])
    params = {
        "max_new_tokens": 80,
        "temperature": 0.9,
        "seed": 4,
        "json_schema": json.dumps(SCHEMA),
    }
    status, body = post(server.url + "/generate", {"text": "x", "sampling_params": params})
    assert status == 200, body
    check_json(body["text"])
    bad = {"max_new_tokens": 5, "regex": "(oops"}
    status, body = post(server.url + "/generate", {"text": "x", "sampling_params": bad})
    assert status == 400 and "regex" in body["error"]["message"]
