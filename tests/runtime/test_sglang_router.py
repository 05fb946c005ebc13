"""SGLang's own gateway (`sglang-router`, `--pd-disaggregation`) in front of a dserve prefill and
decode instance, all real processes: it sends the SGLang bootstrap fields dserve speaks
(`bootstrap_host/port/room`) plus fields of its own at their defaults, and what it relays equals
the colocated engine's greedy output on `/generate` (whole and streamed) and, through the
official `openai` client, on `/v1/completions` and `/v1/chat/completions`."""

from __future__ import annotations

import openai
import pytest

from tests.servers import (
    Proc,
    assert_all_pages_free,
    free_port,
    get,
    post,
    start_instance,
    stop_all,
    stream,
    wait_for,
)

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair(tiny_dir, tmp_path_factory):
    model, logs = tiny_dir("deepseek_v3"), tmp_path_factory.mktemp("sglang_router")
    prefill = start_instance("prefill", model, logs)
    decode = start_instance("decode", model, logs)
    procs = [prefill, decode]
    try:
        prefill.wait_ready()
        decode.wait_ready()
        boot = prefill.args[prefill.args.index("--bootstrap-port") + 1]
        port = free_port()
        args = ["--pd-disaggregation", "--host", "127.0.0.1", "--port", str(port)]
        args += ["--prefill", prefill.url, boot, "--decode", decode.url]
        args += ["--policy", "round_robin", "--prometheus-port", str(free_port())]
        router = Proc(
            args,
            str(logs / "sglang-router.log"),
            port,
            command=("-m", "sglang_router.launch_router"),
        )
        procs.append(router)
        wait_for(lambda: get(router.url + "/health")[0] == 200, 60, "sglang-router is up")
        yield model, router, prefill, decode
    finally:
        stop_all(procs)


def test_generate_through_sglang_router(pair, make_engine):
    model, router, prefill, decode = pair
    engine = make_engine(model)
    ids = [17, 4, 99, 250, 31, 8]
    expected = engine.generate(input_ids=ids, sampling_params=GREEDY)
    body = {"input_ids": ids, "sampling_params": GREEDY}
    status, answer = post(router.url + "/generate", body)
    assert status == 200, answer
    assert answer["output_ids"] == expected.output_ids
    assert answer["meta_info"]["kv_transfer"]["bytes"] > 0  # the KV came from the prefill
    events = stream(router.url + "/generate", body)  # the whole output so far in each event
    assert events[-1]["output_ids"] == expected.output_ids
    assert [len(e["output_ids"]) for e in events] == sorted({len(e["output_ids"]) for e in events})
    assert_all_pages_free(prefill, decode)
    for proc in (prefill, decode):  # its HTTP/2 probe of each instance leaves no traceback
        assert "Traceback" not in proc.tail(400), proc.tail()


def test_openai_client_through_sglang_router(pair, make_engine):
    model, router, prefill, decode = pair
    engine = make_engine(model)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    name = get(decode.url + "/v1/models")[1]["data"][0]["id"]
    params = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    prompt = "Hello world! How are"
    expected = engine.generate(prompt, sampling_params=GREEDY)
    done = client.completions.create(model=name, prompt=prompt, **params)
    assert done.choices[0].text == expected.text
    messages = [{"role": "user", "content": "Tell me a story."}]
    ids = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    chat_expected = engine.generate(input_ids=list(ids), sampling_params=GREEDY)
    chunks = client.chat.completions.create(model=name, messages=messages, stream=True, **params)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_expected.text
    assert_all_pages_free(prefill, decode)
