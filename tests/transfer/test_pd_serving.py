"""Disaggregated serving end to end: router + prefill + decode as real processes, real HTTP, KV over
real UCX on loopback. Greedy output must equal the colocated engine's and transformers'."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import random_prompts
from tests.reference import hf_greedy
from tests.servers import assert_all_pages_free, get, post, stream

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def cluster(request, default_pair):
    return default_pair(request.param)


@pytest.fixture(scope="module")
def prompts(cluster):
    return random_prompts(4, 512, [5, 17, 33, 48], seed=3)


def test_generate_matches_colocated_and_transformers(cluster, prompts, make_engine):
    with ThreadPoolExecutor(4) as pool:  # concurrently: several rooms in flight at once
        answers = list(
            pool.map(
                lambda ids: post(
                    cluster.url + "/generate", {"input_ids": ids, "sampling_params": GREEDY}
                ),
                prompts,
            )
        )
    colocated = make_engine(cluster.model).generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, (status, body), local in zip(prompts, answers, colocated):
        assert status == 200, body
        assert body["output_ids"] == local.output_ids == hf_greedy(cluster.model, ids, 12)
        assert body["meta_info"]["kv_transfer"]["bytes"] > 0
        assert body["meta_info"]["completion_tokens"] == 12
    assert_all_pages_free(cluster.prefill, cluster.decode)


def test_generate_stream_matches(cluster, prompts, make_engine):
    events = stream(cluster.url + "/generate", {"input_ids": prompts[2], "sampling_params": GREEDY})
    tokens = events[-1]["output_ids"]  # each event has the whole output so far
    assert (
        tokens
        == make_engine(cluster.model)
        .generate(input_ids=prompts[2], sampling_params=GREEDY)
        .output_ids
    )
    assert events[-1]["meta_info"]["finish_reason"] == "length"
    assert len(events) > 2  # tokens arrived incrementally, not in one piece
    # the first token's way, in order (one host: one clock), up to its write to the client
    line = events[-1]["meta_info"]["pd_timeline_ms"]
    way = ["prefill_computed", "prefill_push", "pages_arrived", "received", "joined"]
    way += ["published", "sent"]
    assert [line[k] for k in way] == sorted(line[k] for k in way), line
    assert line["registered"] > 0 and "prefill_registered" in line


def test_seeded_sampling_matches_colocated(cluster, prompts, make_engine):
    """A seeded draw depends on the seed and the token's position only: the decode goes on where
    the prefill's first token left off, and the pair draws exactly the colocated engine's tokens."""
    params = {
        "temperature": 0.9,
        "top_k": 40,
        "seed": 1234,
        "max_new_tokens": 12,
        "ignore_eos": True,
    }
    status, body = post(
        cluster.url + "/generate", {"input_ids": prompts[1], "sampling_params": params}
    )
    assert status == 200, body
    assert (
        body["output_ids"]
        == make_engine(cluster.model)
        .generate(input_ids=prompts[1], sampling_params=params)
        .output_ids
    )


def test_openai_client_against_router(cluster, make_engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    engine = make_engine(cluster.model)
    prompt = "The capital of France is"
    expected = engine.generate(prompt, sampling_params=GREEDY)
    done = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].text == expected.text
    assert done.usage.completion_tokens == 12
    pieces = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(p.choices[0].text for p in pieces) == expected.text

    messages = [{"role": "user", "content": "Say hello."}]
    ids = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    chat_expected = engine.generate(input_ids=list(ids), sampling_params=GREEDY)
    chat = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == chat_expected.text
    chunks = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_expected.text
    assert_all_pages_free(cluster.prefill, cluster.decode)


def test_batch_n_and_logprobs_through_the_pair(cluster, prompts, make_engine):
    """A batch with n choices each (a room per engine request) and logprobs of the prompt and
    the output (the prompt's ride in the room's control record): as colocated."""
    engine = make_engine(cluster.model)
    params = dict(GREEDY, max_new_tokens=4, return_logprob=True, top_logprobs_num=2)
    params["logprob_start_len"] = 3
    want = engine.generate(input_ids=prompts[:2], sampling_params=params)
    body = {"input_ids": prompts[:2], "sampling_params": dict(GREEDY, max_new_tokens=4, n=2)}
    body.update(return_logprob=True, top_logprobs_num=2, logprob_start_len=3)
    status, answers = post(cluster.url + "/generate", body)
    assert status == 200, answers
    for k, answer in enumerate(answers):
        local = want[k // 2]
        assert answer["output_ids"] == local.output_ids
        meta = answer["meta_info"]
        for name in ("input_token_logprobs", "output_token_logprobs"):
            got = [(lp, t) for lp, t, _ in meta[name]]
            assert [t for _, t in got] == [t for _, t in local.meta[name]]
            assert [lp for lp, _ in got][1:] == pytest.approx(
                [lp for lp, _ in local.meta[name]][1:], abs=1e-4
            )
    assert_all_pages_free(cluster.prefill, cluster.decode)


def test_structured_output_through_the_pair(cluster, make_engine):
    """The prefill draws the first token under the grammar, the decode's ranks replay it into
    their matchers and go on: the colocated engine's seeded tokens, a valid JSON object."""
    from tests.runtime.test_structured_output import SCHEMA, check_json

    params = {"max_new_tokens": 80, "temperature": 0.9, "seed": 11}
    params["json_schema"] = json.dumps(SCHEMA)
    want = make_engine(cluster.model).generate("hello", sampling_params=params)
    status, body = post(cluster.url + "/generate", {"text": "hello", "sampling_params": params})
    assert status == 200, body
    assert body["output_ids"] == want.output_ids
    check_json(body["text"])
    assert_all_pages_free(cluster.prefill, cluster.decode)


def test_admin_routes_through_the_router(cluster):
    """SGLang's admin routes: /get_model_info from a decode instance, /health_generate and
    /flush_cache on every instance (a one-token request through each engine)."""
    status, info = get(cluster.url + "/get_model_info")
    assert status == 200 and info["model_path"] == cluster.model
    status, each = get(cluster.url + "/health_generate")
    assert status == 200 and set(each) == {cluster.prefill.url, cluster.decode.url}
    status, _ = get(cluster.url + "/flush_cache")
    assert status == 200
    status, body = post(cluster.url + "/abort_request", {"rid": "no-such-request"})
    assert status == 200
    assert_all_pages_free(cluster.prefill, cluster.decode)
