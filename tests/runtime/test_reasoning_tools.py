"""Reasoning and tool calls end to end with the official client, on tiny checkpoints whose chat
templates render DeepSeek-R1/V3's and GLM-4.5's formats (DeepSeek's given with --chat-template,
GLM's the checkpoint's own). The model is random, so its text is forced into the formats by a
regex (SGLang's field) or by tool_choice's own grammar."""

from __future__ import annotations

import json
import re

import pytest

from dserve.models.tiny_chat import DEEPSEEK
from tests.servers import assert_all_pages_free, openai_client, start_instance

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("pages_back")]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z][a-z]{2,6}$"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
        },
    },
}
FAMILIES = {
    # think: the regex of an answer that reasons, then answers
    "deepseek": dict(arch="deepseek_v3", parsers=("deepseek-r1", "deepseekv3"), opens=""),
    "glm45": dict(arch="glm4_moe", parsers=("glm45", "glm45"), opens="<think>"),
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=list(FAMILIES))
def server(request, tmp_path_factory):
    from dserve.models.tiny import make_tiny

    family = FAMILIES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    reasoning, tools = family["parsers"]
    flags = ["--reasoning-parser", reasoning, "--tool-call-parser", tools]
    if request.param == "deepseek":  # the checkpoint's template is plain; override it
        path = make_tiny(family["arch"], str(out / "model"))
        template = out / "deepseek.jinja"
        template.write_text(DEEPSEEK)
        flags += ["--chat-template", str(template)]
    else:
        path = make_tiny(family["arch"], str(out / "model"), chat_format="glm45")
    proc = start_instance("serve", path, out, *flags).wait_ready()
    proc.family, proc.opens, proc.name = request.param, family["opens"], "model"
    yield proc
    proc.stop()


def think_regex(server) -> str:
    return re.escape(server.opens) + r"[a-z]{3,8} [a-z]{3,8}</think>[a-z]{2,6}\."


def reasoning_of(message) -> str | None:
    return getattr(message, "reasoning_content", None)


def test_reasoning_split_whole_and_streamed(server):
    client = openai_client(server)
    params = dict(model=server.name, messages=ASK, seed=3, max_tokens=40)
    forced = {"regex": think_regex(server)}
    whole = client.chat.completions.create(**params, extra_body=forced).choices[0]
    reasoning, content = reasoning_of(whole.message), whole.message.content
    assert re.fullmatch(r"[a-z]{3,8} [a-z]{3,8}", reasoning), reasoning
    assert re.fullmatch(r"[a-z]{2,6}\.", content), content
    chunks = list(client.chat.completions.create(**params, stream=True, extra_body=forced))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(reasoning_of(d) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    assert any(reasoning_of(d) and not d.content for d in deltas)  # its own deltas
    joined = client.chat.completions.create(
        **params, extra_body={**forced, "separate_reasoning": False}
    )
    raw = joined.choices[0].message.content
    assert reasoning_of(joined.choices[0].message) is None
    assert raw == f"{server.opens}{reasoning}</think>{content}"
    assert_all_pages_free(server)


def test_thinking_switched_off_by_template_kwargs(server):
    client = openai_client(server)
    kwargs = {"thinking": False} if server.family == "deepseek" else {"enable_thinking": False}
    params = dict(model=server.name, messages=ASK, seed=1, max_tokens=20)
    on = client.chat.completions.create(**params, extra_body={"regex": "[a-z]{2,6}"})
    off = client.chat.completions.create(
        **params, extra_body={"regex": "[a-z]{2,6}", "chat_template_kwargs": kwargs}
    )
    assert off.choices[0].message.content and reasoning_of(off.choices[0].message) is None
    if server.family == "deepseek":  # R1 opens the thinking in the prompt, unless told not to
        assert reasoning_of(on.choices[0].message) and not on.choices[0].message.content
    else:  # GLM's template closes it in the prompt (an empty <think></think>)
        assert off.usage.prompt_tokens > on.usage.prompt_tokens


def check_call(call, name: str) -> dict:
    assert call.type == "function" and call.id and call.function.name == name
    args = json.loads(call.function.arguments)
    if name == "get_weather":
        assert re.fullmatch(r"[A-Z][a-z]{2,6}", args["city"]) and 1 <= args["days"] <= 7
    return args


def no_thinking(server) -> dict:
    """R1 with thinking on would reason before the forced call (the call's grammar holds after
    `</think>`, which a random model never writes): the tool tests turn it off."""
    kwargs = {"thinking": False} if server.family == "deepseek" else {}
    return {"chat_template_kwargs": kwargs}


def test_two_turn_tool_conversation(server):
    """Turn one must call a tool (tool_choice required: the call in the model's format is
    forced), streamed arguments arrive in pieces and add up to the whole answer's; turn two
    sends the call back (content null) with the tool's result, and the template renders both."""
    client = openai_client(server)
    params = dict(model=server.name, messages=ASK, tools=[WEATHER, TIME], seed=2, max_tokens=400)
    params["extra_body"] = no_thinking(server)
    first = client.chat.completions.create(**params, tool_choice="required").choices[0]
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    name = call.function.name
    args = check_call(call, name)
    chunks = list(client.chat.completions.create(**params, tool_choice="required", stream=True))
    pieces = [
        d.tool_calls[0] for c in chunks if c.choices for d in [c.choices[0].delta] if d.tool_calls
    ]
    assert pieces[0].function.name == name and pieces[0].id
    assert len(pieces) > 2  # the arguments in more than one piece
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear"})},
    ]
    second = client.chat.completions.create(
        model=server.name,
        messages=history,
        tools=[WEATHER, TIME],
        max_tokens=8,
        temperature=0,
        extra_body=no_thinking(server),
    )
    assert second.choices[0].finish_reason in ("length", "stop")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.args[server.args.index("--model") + 1])
    rendered = history[:1] + [
        {**history[1], "tool_calls": [{"function": {"name": name, "arguments": args}}]},
        history[2],
    ]
    if server.family == "deepseek":
        rendered[1]["tool_calls"][0]["function"]["arguments"] = call.function.arguments
        tokenizer.chat_template = DEEPSEEK
    ids = tokenizer.apply_chat_template(
        rendered,
        tools=[WEATHER, TIME],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert second.usage.prompt_tokens == len(ids)
    assert name in tokenizer.decode(ids) and "clear" in tokenizer.decode(ids)
    assert_all_pages_free(server)


def test_tool_choice_named_auto_and_none(server):
    client = openai_client(server)
    params = dict(model=server.name, messages=ASK, tools=[WEATHER, TIME], seed=4, max_tokens=400)
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = client.chat.completions.create(
        **params, tool_choice=named, extra_body=no_thinking(server)
    )
    (call,) = answer.choices[0].message.tool_calls
    assert -12 <= check_call(call, "get_time")["zone"] <= 12
    if server.family == "deepseek":
        text = (
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
            '{"zone": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
        )
    else:
        text = (
            "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
        )
    forced = {"regex": re.escape(server.opens) + "[a-z]{2,4}</think>" + re.escape(text)}
    auto = client.chat.completions.create(**params, tool_choice="auto", extra_body=forced)
    (call,) = auto.choices[0].message.tool_calls  # read from free text by the parser
    assert json.loads(call.function.arguments) == {"zone": 3}
    assert auto.choices[0].finish_reason == "tool_calls"
    none = client.chat.completions.create(**params, tool_choice="none", extra_body=forced)
    assert none.choices[0].message.tool_calls is None
    assert text in none.choices[0].message.content  # not parsed: content as it came
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens  # no tools in the template
    assert_all_pages_free(server)
