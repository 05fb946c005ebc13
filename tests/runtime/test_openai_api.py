"""The OpenAI routes with the official `openai` client on a colocated instance: defaults, n,
logprobs (whole and streamed), usage, echo, the sampling extensions, message shapes, and every
field either honoured or refused with a 400 naming it."""

from __future__ import annotations

import json
import math
import re

import openai
import pytest

from tests.runtime.test_structured_output import REGEX, SCHEMA, check_json
from tests.servers import assert_all_pages_free, openai_client, post, start_instance

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("pages_back")]
GREEDY = {"temperature": 0, "max_tokens": 5, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    model = tiny_dir("deepseek_v3")
    proc = start_instance("serve", model, tmp_path_factory.mktemp("openai"))
    proc.wait_ready()
    proc.model = model
    proc.name = model.rstrip("/").rsplit("/", 1)[-1]
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def engine(server):
    from dserve.runtime import Engine

    with Engine(server.model, device="cpu", load_progress=False) as engine:
        yield engine


def chat_ids(engine, messages) -> list[int]:
    return list(
        engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def test_chat_default_max_tokens_is_the_rest_of_the_context(server, client):
    messages = [{"role": "user", "content": "hi"}]
    answer = client.chat.completions.create(
        model=server.name, messages=messages, extra_body={"ignore_eos": True}
    )
    usage = answer.usage
    assert answer.choices[0].finish_reason == "length"
    assert usage.prompt_tokens + usage.completion_tokens == 1024  # the tiny model's context


def test_n_logprobs_and_usage(server, client, engine):
    """n choices of one prompt (greedy: all the engine's), their logprobs against the engine's,
    usage counting the prompt once, and cached tokens in prompt_tokens_details."""
    messages = [{"role": "user", "content": "tell me a story about a robot who learns to paint"}]
    ids = chat_ids(engine, messages)
    params = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True, "return_logprob": True}
    params["top_logprobs_num"] = 2
    want = engine.generate(input_ids=ids, sampling_params=params)
    answer = client.chat.completions.create(
        model=server.name, messages=messages, n=3, logprobs=True, top_logprobs=2, **GREEDY
    )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for choice in answer.choices:
        assert choice.message.content == want.text
        content = choice.logprobs.content
        lps = [lp for lp, _ in want.meta["output_token_logprobs"]]
        assert [e.logprob for e in content] == pytest.approx(lps, abs=1e-4)
        assert all(len(e.top_logprobs) == 2 for e in content)
        assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == want.text
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == 15
    again = client.chat.completions.create(model=server.name, messages=messages, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert_all_pages_free(server)


def test_streamed_chat_with_usage_and_logprobs(server, client, engine):
    messages = [{"role": "user", "content": "hello"}]
    want = engine.generate(
        input_ids=chat_ids(engine, messages),
        sampling_params={"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
    )
    chunks = list(
        client.chat.completions.create(
            model=server.name,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            n=2,
            **GREEDY,
        )
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == want.text
        assert sum(len(c.logprobs.content) for c in mine if c.logprobs) == 5
        assert mine[-1].finish_reason == "length"
    plain = list(
        client.chat.completions.create(model=server.name, messages=messages, stream=True, **GREEDY)
    )
    assert all(c.usage is None for c in plain)  # usage only when asked


def test_completions_list_echo_logprobs(server, client, engine):
    prompts = ["hello there", "the quick brown"]
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    want = engine.generate(prompts, sampling_params=params)
    answer = client.completions.create(
        model=server.name, prompt=prompts, n=2, echo=True, logprobs=1, **dict(GREEDY, max_tokens=4)
    )
    assert len(answer.choices) == 4
    for choice in answer.choices:
        i = choice.index // 2
        assert choice.text == prompts[i] + want[i].text
        lp = choice.logprobs
        prompt_len = len(engine.tokenizer.encode(prompts[i]))
        assert len(lp.tokens) == prompt_len + 4 and lp.token_logprobs[0] is None
        assert all(math.isfinite(x) for x in lp.token_logprobs[1:])
        assert lp.text_offset[prompt_len] == len(prompts[i])
    events = list(
        client.completions.create(
            model=server.name, prompt=prompts[0], echo=True, stream=True, **GREEDY
        )
    )
    five = engine.generate(prompts[0], sampling_params=dict(params, max_new_tokens=5)).text
    assert events[0].choices[0].text.startswith(prompts[0])
    assert "".join(e.choices[0].text for e in events) == prompts[0] + five
    ids = engine.tokenizer.encode("token ids")
    answer = client.completions.create(model=server.name, prompt=[ids, ids], **GREEDY)
    assert answer.choices[0].text == answer.choices[1].text
    assert_all_pages_free(server)


def test_sampling_extensions(server, client, engine):
    """logit_bias, stop_token_ids, min_tokens, ignore_eos, skip_special_tokens."""
    eos = engine.tokenizer.eos_token_id
    messages = [{"role": "user", "content": "hi"}]
    forced = client.chat.completions.create(
        model=server.name, messages=messages, logit_bias={str(eos): 100}, max_tokens=8
    )
    assert forced.choices[0].finish_reason == "stop" and forced.usage.completion_tokens == 1
    kept = client.chat.completions.create(
        model=server.name,
        messages=messages,
        logit_bias={str(eos): 100},
        max_tokens=8,
        extra_body={"min_tokens": 3, "skip_special_tokens": False},
    )
    assert kept.usage.completion_tokens == 4
    assert kept.choices[0].message.content.endswith(engine.tokenizer.eos_token)
    first = engine.generate("hi", sampling_params={"temperature": 0, "max_new_tokens": 4})
    stopped = client.completions.create(
        model=server.name,
        prompt="hi",
        temperature=0,
        max_tokens=6,
        extra_body={"stop_token_ids": [first.output_ids[1]]},
    )
    assert stopped.usage.completion_tokens == 2 and stopped.choices[0].finish_reason == "stop"


def test_messages_roles_parts_and_tool_history(server, client, engine):
    """Content-part arrays, developer (as system), tool messages, and an assistant turn with
    tool_calls and null content reach the template."""
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "f", "arguments": json.dumps({"x": 1})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    answer = client.chat.completions.create(model=server.name, messages=messages, **GREEDY)
    rendered = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42"},
    ]
    assert answer.usage.prompt_tokens == len(chat_ids(engine, rendered))
    assert_all_pages_free(server)


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


# every field the routes once ignored: honoured (tests above and below), inert with the values
# that ask nothing else, or refused with a 400 naming it
REFUSED = [
    ("completions", {"suffix": "tail"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool-call-parser"),
    ("chat", {"service_tier": "priority"}, "service_tier"),
    ("chat", {"store": True}, "store"),
    ("chat", {"metadata": {"k": "v"}}, "metadata"),
    ("chat", {"modalities": ["audio"]}, "modalities"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"response_format": {"type": "structural_tag"}}, "response_format"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"chat_template_kwargs": {"tokenize": False}}, "tokenize"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text parts"),
    ("completions", {"logprobs": 30}, "logprobs"),
    ("completions", {"logit_bias": {"999999": 5}}, "logit_bias"),
]
INERT = [
    {"user": "someone"},
    {"store": False},
    {"service_tier": "auto"},
    {"modalities": ["text"]},
    {"metadata": {}},
    {"parallel_tool_calls": True},
    {"tool_choice": "none"},
]


@pytest.mark.parametrize("route,extra,named", REFUSED, ids=[n for _, _, n in REFUSED])
def test_unsupported_fields_are_refused_by_name(server, route, extra, named):
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    body = {"model": server.name, "max_tokens": 2}
    body.update(
        {"prompt": "x"}
        if route == "completions"
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    body.update(extra)
    status, answer = post(server.url + path, body)
    assert status == 400, answer
    assert named in answer["error"]["message"]


def test_inert_fields_are_accepted(server):
    for extra in INERT:
        body = {
            "model": server.name,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "x"}],
        }
        status, answer = post(server.url + "/v1/chat/completions", {**body, **extra})
        assert status == 200, (extra, answer)
    assert_all_pages_free(server)


def test_response_format(server, client):
    """json_schema output parses and validates against the schema; json_object is an object;
    SGLang's regex field on the OpenAI route matches."""
    messages = [{"role": "user", "content": "who are you?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    answer = client.chat.completions.create(
        model=server.name, messages=messages, response_format=fmt, n=2, seed=5, max_tokens=80
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        check_json(choice.message.content)
    obj = client.chat.completions.create(
        model=server.name,
        messages=messages,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    matched = client.completions.create(
        model=server.name, prompt="x", max_tokens=30, seed=1, extra_body={"regex": REGEX}
    )
    assert re.fullmatch(REGEX, matched.choices[0].text)
    assert_all_pages_free(server)
