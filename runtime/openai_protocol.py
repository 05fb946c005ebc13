"""The OpenAI routes' request bodies (`/v1/completions`, `/v1/chat/completions`) as `GenerateInput`.

vLLM and SGLang are the reference: their sampling extensions (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`, `min_tokens`,
`regex`, `json_schema`, `ebnf`, `chat_template_kwargs`, `separate_reasoning`) are accepted beside
OpenAI's fields. Every field is either honoured or refused with a 400 naming it: fields that have
no effect on a single self-hosted model (`user`, `store: false`, `service_tier: auto`,
`modalities: ["text"]`) are accepted only with values that ask for nothing else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dserve.runtime.protocol import (
    BadRequest,
    GenerateInput,
    Prompt,
    bootstrap,
    choices,
    expect,
    is_int,
    parse_generate,
    refuse_unknown,
    stream_flag,
    token_list,
)

# OpenAI's (or vLLM's / SGLang's) name -> the engine's sampling name
SAMPLING = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
    "skip_special_tokens": "skip_special_tokens",
    "logit_bias": "logit_bias",
    "min_tokens": "min_new_tokens",
    "no_stop_trim": "no_stop_trim",
    "include_stop_str_in_output": "no_stop_trim",
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
}
# accepted with these values only: they ask for nothing a self-hosted model does differently
INERT = {
    "user": lambda v: isinstance(v, str),
    "store": lambda v: v is False,
    "service_tier": lambda v: v in ("auto", "default"),
    "modalities": lambda v: v == ["text"],
    "metadata": lambda v: v == {},
}
COMMON = {"model", "n", "stream", "stream_options", "response_format"} | set(SAMPLING) | set(INERT)
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {
    "messages",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "separate_reasoning",
    "stream_reasoning",
}
ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass
class ChatOptions:
    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str | dict = "auto"
    """`auto`, `none`, `required`, or {"type": "function", "function": {"name": ...}}."""
    parallel_tool_calls: bool = True
    template_kwargs: dict = field(default_factory=dict)
    separate_reasoning: bool = True
    formats_answer: bool = False
    """`response_format` constrains the answer (after any reasoning), where the `regex` /
    `json_schema` / `ebnf` fields constrain the whole text."""

    @property
    def forced_tool(self) -> str | None:
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return None


@dataclass
class OpenAIOptions:
    top_logprobs: int | None = None
    """None: no logprobs; else how many alternatives per token (0: the chosen one only)."""
    echo: bool = False
    include_usage: bool = False
    chat: ChatOptions | None = None


def _present(body: dict) -> dict:
    """The body without fields sent as null (the same as leaving them out)."""
    return {k: v for k, v in body.items() if v is not None}


def _common(body: dict, default_max: int | None) -> tuple[dict, int, bool]:
    for name, ok in INERT.items():
        if name in body:
            expect(ok(body[name]), f"{name}={body[name]!r} is not supported")
    sampling = {ours: body[name] for name, ours in SAMPLING.items() if name in body}
    if default_max is not None:
        sampling.setdefault("max_new_tokens", default_max)
    else:
        sampling.setdefault("max_new_tokens", None)  # the rest of the context
    sampling.update(_response_format(body.get("response_format")))
    stream = stream_flag(body)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        expect(stream, "stream_options is only allowed with stream: true")
        expect(isinstance(options, dict), "stream_options must be an object")
        refuse_unknown(
            {k: v for k, v in options.items() if k != "include_obfuscation" or v},
            {"include_usage"},
            " in stream_options",
        )
        include_usage = options.get("include_usage", False)
        expect(isinstance(include_usage, bool), "stream_options.include_usage must be a bool")
    return sampling, choices(body.get("n", 1)), include_usage


def _response_format(value) -> dict:
    if value is None:
        return {}
    expect(isinstance(value, dict), "response_format must be an object")
    kind = value.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if kind == "json_schema":
        spec = value.get("json_schema")
        expect(
            isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict),
            "response_format.json_schema must be an object with a `schema` object",
        )
        return {"json_schema": json.dumps(spec.get("schema", {}))}
    raise BadRequest(
        f"response_format.type {kind!r} is not supported (text, json_object, json_schema)"
    )


def parse_completions(body: dict) -> GenerateInput:
    body = _present(body)
    refuse_unknown(body, COMPLETION_FIELDS)
    expect("prompt" in body, "prompt is required")
    expect(body.get("suffix", "") == "", "suffix is not supported")
    sampling, n, include_usage = _common(body, 16)
    expect(body.get("best_of", n) == n, "best_of is not supported (only best_of = n, the default)")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        expect(is_int(logprobs) and 0 <= logprobs <= 20, "logprobs must be an integer in [0, 20]")
        sampling.update(return_logprob=True, top_logprobs_num=logprobs)
    echo = body.get("echo", False)
    expect(isinstance(echo, bool), "echo must be true or false")
    if echo and logprobs is not None:
        sampling["logprob_start_len"] = 0  # the prompt's logprobs too
    prompts = _prompts(body["prompt"])
    options = OpenAIOptions(logprobs, echo, include_usage)
    return GenerateInput(
        "completions",
        prompts,
        [dict(sampling) for _ in prompts],
        n=n,
        stream=stream_flag(body),
        bootstrap=bootstrap(body),
        model=body.get("model"),
        openai=options,
    )


def _prompts(value) -> list[Prompt]:
    if isinstance(value, str):
        return [Prompt(text=value)]
    if token_list(value):
        return [Prompt(input_ids=value)]
    ok = isinstance(value, list) and value
    if ok and all(isinstance(p, str) for p in value):
        return [Prompt(text=p) for p in value]
    if ok and all(token_list(p) for p in value):
        return [Prompt(input_ids=p) for p in value]
    raise BadRequest(
        "prompt must be a string, a list of strings, a list of token ids or a list of such lists"
    )


def parse_chat(body: dict) -> GenerateInput:
    body = _present(body)
    refuse_unknown(body, CHAT_FIELDS)
    messages = body.get("messages")
    expect(isinstance(messages, list) and messages, "messages must be a non-empty list")
    sampling, n, include_usage = _common(body, None)
    top = None
    logprobs = body.get("logprobs", False)
    expect(isinstance(logprobs, bool), "logprobs must be true or false")
    if "top_logprobs" in body:
        expect(logprobs, "top_logprobs needs logprobs: true")
        top = body["top_logprobs"]
        expect(is_int(top) and 0 <= top <= 20, "top_logprobs must be an integer in [0, 20]")
    if logprobs:
        top = top or 0
        sampling.update(return_logprob=True, top_logprobs_num=top)
    expect(body.get("stream_reasoning", True) is True, "stream_reasoning: false is not supported")
    chat = ChatOptions(
        [_message(m, i) for i, m in enumerate(messages)],
        _tools(body.get("tools")),
        body.get("tool_choice", "auto" if body.get("tools") else "none"),
        _bool(body, "parallel_tool_calls", True),
        _template_kwargs(body.get("chat_template_kwargs")),
        _bool(body, "separate_reasoning", True),
    )
    _check_tool_choice(chat)
    chat.formats_answer = bool(_response_format(body.get("response_format")))
    return GenerateInput(
        "chat",
        [Prompt()],
        [sampling],
        n=n,
        stream=stream_flag(body),
        bootstrap=bootstrap(body),
        model=body.get("model"),
        openai=OpenAIOptions(top, False, include_usage, chat),
    )


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    expect(isinstance(value, bool), f"{name} must be true or false")
    return value


def _template_kwargs(value) -> dict:
    expect(value is None or isinstance(value, dict), "chat_template_kwargs must be an object")
    return dict(value or {})


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    expect(isinstance(m, dict), f"{where} must be an object")
    m = _present(m)
    role = m.get("role")
    expect(role in ROLES, f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {role!r}")
    known = {"role", "content", "name"}
    if role == "assistant":
        known |= {"tool_calls", "reasoning_content"}
    if role == "tool":
        known.add("tool_call_id")
    refuse_unknown(m, known, f" in {where}")
    out = {"role": "system" if role == "developer" else role}
    if "content" in m or role != "assistant" or not m.get("tool_calls"):
        out["content"] = _content(m.get("content"), where)
    for key in ("name", "reasoning_content", "tool_call_id"):
        if key in m:
            expect(isinstance(m[key], str), f"{where}.{key} must be a string")
            out[key] = m[key]
    if role == "tool":
        expect("tool_call_id" in m, f"{where}: a tool message needs tool_call_id")
    if m.get("tool_calls"):
        out["tool_calls"] = [
            _call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(m["tool_calls"])
        ]
    return out


def _content(value, where: str) -> str:
    """A string, or an array of text parts (joined by newlines, as vLLM joins them)."""
    if isinstance(value, str):
        return value
    expect(isinstance(value, list), f"{where}.content must be a string or an array of parts")
    texts = []
    for k, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        expect(
            kind == "text" and isinstance(part.get("text"), str),
            f"{where}.content[{k}]: only text parts are supported, got type {kind!r}",
        )
        texts.append(part["text"])
    return "\n".join(texts)


def _call(call, where: str) -> dict:
    ok = isinstance(call, dict) and call.get("type", "function") == "function"
    fn = call.get("function") if ok else None
    expect(
        isinstance(fn, dict)
        and isinstance(fn.get("name"), str)
        and isinstance(fn.get("arguments"), str),
        f"{where} must be a function call with a name and string arguments",
    )
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError as e:
        raise BadRequest(f"{where}.function.arguments is not JSON: {e}") from e
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _tools(value) -> list[dict] | None:
    if value is None:
        return None
    expect(isinstance(value, list), "tools must be a list")
    tools = []
    for k, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        expect(
            isinstance(tool, dict)
            and tool.get("type") == "function"
            and isinstance(fn, dict)
            and isinstance(fn.get("name"), str),
            f"tools[{k}] must be {{type: function, function: {{name, parameters}}}}",
        )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        expect(isinstance(params, dict), f"tools[{k}].function.parameters must be an object")
        tools.append({"type": "function", "function": {**fn, "parameters": params}})
    return tools


def _check_tool_choice(chat: ChatOptions) -> None:
    choice = chat.tool_choice
    if isinstance(choice, str):
        expect(
            choice in ("auto", "none", "required"),
            "tool_choice must be auto, none, required or a named function",
        )
        expect(choice == "none" or chat.tools, f"tool_choice {choice!r} needs tools")
        return
    fn = choice.get("function") if isinstance(choice, dict) else None
    expect(
        isinstance(fn, dict) and isinstance(fn.get("name"), str),
        "tool_choice must be auto, none, required or {type: function, function: {name}}",
    )
    names = [t["function"]["name"] for t in chat.tools or []]
    expect(fn["name"] in names, f"tool_choice names {fn['name']!r}, which is not in tools")


# each route's body parser, the native route's from protocol.py (the instances and the router)
PARSERS = {"generate": parse_generate, "completions": parse_completions, "chat": parse_chat}
