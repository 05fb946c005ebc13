"""A chat request's messages -> prompt token ids through the checkpoint's chat template (or the
one `--chat-template` gives), with the request's tools and `chat_template_kwargs`; and the
parsers that read its answer (`chat_output.ChatText`)."""

from __future__ import annotations

import json
import os

import jinja2

from dserve.runtime.chat_output import ChatText
from dserve.runtime.openai_protocol import ChatOptions
from dserve.runtime.protocol import BadRequest
from dserve.runtime.reasoning import END, make_split
from dserve.runtime.tool_calls import arguments_as_text, grammar, make_parser

# apply_chat_template's own arguments: not for a template's variables
RESERVED = {
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}


def load_template(value: str | None) -> str | None:
    """`--chat-template`: a file's text, or the template itself."""
    if value is not None and os.path.isfile(value):
        with open(value) as f:
            return f.read()
    return value


def render_chat(
    tokenizer, chat: ChatOptions, template: str | None, parser: str | None
) -> list[int]:
    clash = sorted(set(chat.template_kwargs) & RESERVED)
    if clash:
        raise BadRequest(f"chat_template_kwargs may not set {', '.join(clash)}")
    tools = chat.tools if chat.tool_choice != "none" else None
    messages = _messages(chat.messages, arguments_as_text(parser))
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **chat.template_kwargs,
        )
    except (jinja2.TemplateError, TypeError, ValueError) as e:
        raise BadRequest(f"the chat template failed on these messages: {e}") from e
    return list(ids)


def _messages(messages: list[dict], as_text: bool) -> list[dict]:
    """The assistant turns' tool-call arguments as the template takes them: JSON text (as
    OpenAI sends them) or an object (GLM-4.5's template iterates over them)."""
    if not as_text:
        return messages
    out = []
    for m in messages:
        if "tool_calls" in m:
            calls = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.dumps(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def tool_grammar(chat: ChatOptions, parser: str | None, sampling: dict) -> None:
    """`tool_choice` required or named: the answer is one call in the parser's format (an EBNF
    grammar in `sampling`)."""
    if chat.tool_choice in ("auto", "none") or parser is None:
        return
    taken = [k for k in ("json_schema", "regex", "ebnf") if sampling.get(k) is not None]
    if taken:
        raise BadRequest(f"tool_choice {chat.tool_choice!r} cannot be combined with {taken[0]}")
    sampling["ebnf"] = grammar(parser, chat.tools, chat.forced_tool)


def grammar_after_reasoning(chat: ChatOptions, reasoning: str | None, sampling: dict) -> None:
    """A model that answers after reasoning it was made to open (deepseek-r1 with thinking on)
    has the answer's format (`response_format`, `tool_choice` required or named) hold only
    after the reasoning ends (`</think>`). The `regex` / `json_schema` / `ebnf` fields hold
    for the whole text."""
    answer = chat.formats_answer or chat.tool_choice not in ("auto", "none")
    if answer and reasoning is not None and make_split(reasoning, chat.template_kwargs).forced:
        sampling["grammar_after"] = END


def chat_text(chat: ChatOptions, reasoning: str | None, tools: str | None) -> ChatText:
    """What reads one choice's answer: the server's parsers as the request wants them."""
    split = None
    if reasoning is not None and chat.separate_reasoning:
        split = make_split(reasoning, chat.template_kwargs)
    calls = None
    if tools is not None and chat.tools and chat.tool_choice != "none":
        calls = make_parser(tools, chat.tools)
    return ChatText(split, calls, chat.parallel_tool_calls)
