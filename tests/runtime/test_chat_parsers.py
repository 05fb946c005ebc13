"""The reasoning and tool-call parsers driven with text: fed whole or cut into pieces at every
place (tags split across pieces included), they give the same message."""

from __future__ import annotations

import json
import random

import pytest

from dserve.runtime.chat_output import ChatText, merge_deltas
from dserve.runtime.reasoning import ReasoningSplit, make_split
from dserve.runtime.tool_calls import make_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
DS_CALL = (
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
)
DS_TEXT = (
    "I should look.</think>Let me check.<｜tool▁calls▁begin｜>"
    + DS_CALL.format(name="get_weather", args='{"city": "Paris", "days": 3}')
    + "\n"
    + DS_CALL.format(name="get_weather", args='{"city": "Oslo", "days": 1}')
    + "<｜tool▁calls▁end｜>"
)
GLM_TEXT = (
    "<think>plan it</think>Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
    "<arg_value>New York</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n"
    "</tool_call>"
)


def run(make, text: str, cuts: list[int]) -> dict:
    parser = make()
    deltas, last = [], 0
    for cut in [*cuts, len(text)]:
        deltas += parser.feed(text[last:cut])
        last = cut
    message = merge_deltas(deltas + parser.finish())
    for call in message.get("tool_calls", []):
        call.pop("id")
    return message


def every_split(make, text: str) -> dict:
    """The message of `text` fed whole, checked equal for one cut at every place and for
    random cuts into many pieces."""
    whole = run(make, text, [])
    for cut in range(1, len(text)):
        assert run(make, text, [cut]) == whole, cut
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(12, len(text) - 1)))
        assert run(make, text, cuts) == whole, cuts
    return whole


def test_deepseek_r1_and_v3_calls():
    text = every_split(
        lambda: ChatText(make_split("deepseek-r1", {}), make_parser("deepseekv3", [WEATHER])),
        DS_TEXT,
    )
    assert text["reasoning_content"] == "I should look."
    assert text["content"] == "Let me check."
    calls = text["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris", "days": 3},
        {"city": "Oslo", "days": 1},
    ]


def test_glm45_reasoning_and_calls():
    text = every_split(
        lambda: ChatText(make_split("glm45", {}), make_parser("glm45", [WEATHER])), GLM_TEXT
    )
    assert text["reasoning_content"] == "plan it" and text["content"] == "Sure."
    (call,) = text["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "New York", "days": 2}


@pytest.mark.parametrize(
    "parser,kwargs,text,reasoning,content",
    [
        ("deepseek-r1", {}, "<think>a b</think>c", "a b", "c"),  # R1-0528 opens it itself
        ("deepseek-r1", {}, "never closed", "never closed", ""),
        ("deepseek-r1", {"thinking": False}, "plain answer", "", "plain answer"),
        ("glm45", {}, "no thinking here", "", "no thinking here"),
        ("glm45", {}, "<thinking is not a tag", "", "<thinking is not a tag"),
    ],
)
def test_reasoning_cases(parser, kwargs, text, reasoning, content):
    message = every_split(lambda: ChatText(make_split(parser, kwargs)), text)
    assert message.get("reasoning_content", "") == reasoning
    assert message["content"] == content


def test_text_that_only_looks_like_a_call_stays_content():
    text = "a <｜tool▁calls▁begin｜ but no call, and <tool_call without a name"
    for name in ("deepseekv3", "glm45"):
        message = every_split(lambda name=name: ChatText(None, make_parser(name, [WEATHER])), text)
        assert message["content"] == text and "tool_calls" not in message


def test_streamed_arguments_come_in_pieces():
    """A call's name comes first (arguments ""), then its arguments as they arrive."""
    parser = make_parser("deepseekv3", [WEATHER])
    deltas = []
    for ch in DS_TEXT.split("Let me check.")[1]:
        deltas += parser.feed(ch)
    first = deltas[0]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["id"]
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:4]]
    assert all(len(p) == 1 for p in pieces)


def test_no_parallel_calls_keeps_the_first():
    chat = ChatText(None, make_parser("deepseekv3", [WEATHER]), parallel=False)
    message = merge_deltas(chat.feed(DS_TEXT.split("</think>")[1]) + chat.finish())
    assert len(message["tool_calls"]) == 1


def test_split_held_back_tag():
    split = ReasoningSplit(forced=True)
    assert split.feed("abc</th") == [("reasoning", "abc")]
    assert split.feed("ink>rest") == [("content", "rest")]
