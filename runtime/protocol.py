"""Request bodies of the HTTP API, checked and turned into one `GenerateInput`; answers formatted back.

`/generate` is SGLang's shape (`text` or `input_ids`, `sampling_params`, `stream`); `/v1/completions`
and `/v1/chat/completions` are OpenAI's. Any body that does not fit raises `BadRequest` with a message
the client sees (HTTP 400). The router adds `bootstrap_host`, `bootstrap_port` and `bootstrap_room`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field


class BadRequest(ValueError):
    """The client's request is malformed; HTTP 400 with this message."""


@dataclass
class Bootstrap:
    host: str
    port: int
    room: int


@dataclass
class GenerateInput:
    kind: str  # "generate" | "completions" | "chat"
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict] | None = None
    sampling: dict = field(default_factory=dict)
    stream: bool = False
    rid: str | None = None
    bootstrap: Bootstrap | None = None
    model: str | None = None


BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
# OpenAI fields we accept and ignore (the official client may send them)
IGNORED = {
    "user",
    "logit_bias",
    "suffix",
    "echo",
    "best_of",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "service_tier",
    "store",
    "metadata",
    "stream_options",
    "modalities",
}
# OpenAI name -> SGLang sampling name
OPENAI_SAMPLING = {
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
}


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise BadRequest(message)


def _bootstrap(body: dict) -> Bootstrap | None:
    present = [k for k in BOOTSTRAP_FIELDS if body.get(k) is not None]
    if not present:
        return None
    _expect(len(present) == 3, f"give all of {', '.join(BOOTSTRAP_FIELDS)} or none")
    host, port, room = (body[k] for k in BOOTSTRAP_FIELDS)
    _expect(isinstance(host, str) and 0 < len(host) < 256, "bootstrap_host must be a host name")
    _expect(isinstance(port, int) and 0 < port < 65536, "bootstrap_port must be a TCP port")
    _expect(
        isinstance(room, int) and not isinstance(room, bool) and 0 <= room < 2**63,
        "bootstrap_room must be an integer in [0, 2^63)",
    )
    return Bootstrap(host, port, room)


def _unknown(body: dict, known: set[str]) -> None:
    extra = sorted(set(body) - known - set(BOOTSTRAP_FIELDS) - IGNORED)
    _expect(not extra, f"unknown field(s): {', '.join(extra)}")


def _stream_flag(body: dict) -> bool:
    value = body.get("stream", False)
    _expect(isinstance(value, bool), "stream must be true or false")
    return value


def _prompt(value) -> tuple[str | None, list[int] | None]:
    if isinstance(value, str):
        return value, None
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return None, value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0], None
    raise BadRequest("prompt must be a string or a list of token ids (one prompt per request)")


def parse_generate(body: dict) -> GenerateInput:
    _expect(isinstance(body, dict), "the body must be a JSON object")
    _unknown(
        body,
        {
            "text",
            "input_ids",
            "sampling_params",
            "stream",
            "rid",
            "return_logprob",
            "top_logprobs_num",
        },
    )
    sampling = body.get("sampling_params") or {}
    _expect(isinstance(sampling, dict), "sampling_params must be an object")
    sampling = dict(sampling)
    for name in ("return_logprob", "top_logprobs_num"):
        if name in body:
            sampling[name] = body[name]
    text, ids = body.get("text"), body.get("input_ids")
    _expect((text is None) != (ids is None), "give exactly one of text or input_ids")
    if text is not None:
        _expect(isinstance(text, str), "text must be a string")
    else:
        _prompt(ids)
    rid = body.get("rid")
    _expect(
        rid is None or (isinstance(rid, str) and 0 < len(rid) <= 128), "rid must be a short string"
    )
    return GenerateInput(
        "generate",
        text=text,
        input_ids=ids,
        sampling=sampling,
        stream=_stream_flag(body),
        rid=rid,
        bootstrap=_bootstrap(body),
    )


def _openai_sampling(body: dict, default_max: int | None) -> dict:
    sampling = {}
    for name, ours in OPENAI_SAMPLING.items():
        if body.get(name) is not None:
            sampling[ours] = body[name]
    if default_max is not None:
        sampling.setdefault("max_new_tokens", default_max)
    n = body.get("n", 1)
    _expect(n == 1, "only n = 1 is supported")
    if body.get("logprobs") not in (None, False, 0):
        sampling["return_logprob"] = True
        top = body.get("top_logprobs") if body.get("logprobs") is True else body.get("logprobs")
        if isinstance(top, int) and not isinstance(top, bool):
            sampling["top_logprobs_num"] = top
    return sampling


def parse_completions(body: dict) -> GenerateInput:
    _expect(isinstance(body, dict), "the body must be a JSON object")
    _unknown(body, {"model", "prompt", "n", "logprobs", "stream"} | set(OPENAI_SAMPLING))
    _expect("prompt" in body, "prompt is required")
    text, ids = _prompt(body["prompt"])
    return GenerateInput(
        "completions",
        text=text,
        input_ids=ids,
        sampling=_openai_sampling(body, 16),
        stream=_stream_flag(body),
        bootstrap=_bootstrap(body),
        model=body.get("model"),
    )


def parse_chat(body: dict) -> GenerateInput:
    _expect(isinstance(body, dict), "the body must be a JSON object")
    _unknown(
        body,
        {"model", "messages", "n", "logprobs", "top_logprobs", "stream"} | set(OPENAI_SAMPLING),
    )
    messages = body.get("messages")
    _expect(isinstance(messages, list) and messages, "messages must be a non-empty list")
    for m in messages:
        _expect(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str),
            "each message needs a string role and a string content",
        )
        _expect(
            m["role"] in ("system", "user", "assistant", "tool"),
            f"unknown message role {m['role']!r}",
        )
    return GenerateInput(
        "chat",
        messages=[{"role": m["role"], "content": m["content"]} for m in messages],
        sampling=_openai_sampling(body, None),
        stream=_stream_flag(body),
        bootstrap=_bootstrap(body),
        model=body.get("model"),
    )


PARSERS = {"generate": parse_generate, "completions": parse_completions, "chat": parse_chat}


# ---- answers ---------------------------------------------------------------------------------------
def openai_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(meta: dict) -> dict:
    p, c = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def full_answer(
    kind: str, model: str, text: str, output_ids: list[int], meta: dict, rid: str
) -> dict:
    if kind == "generate":
        return {"text": text, "output_ids": output_ids, "meta_info": {"id": rid, **meta}}
    base = {
        "id": openai_id(kind),
        "created": int(time.time()),
        "model": model,
        "usage": usage(meta),
    }
    if kind == "completions":
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": meta.get("finish_reason"),
        }
        return {**base, "object": "text_completion", "choices": [choice]}
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": meta.get("finish_reason"),
    }
    return {**base, "object": "chat.completion", "choices": [choice]}


def stream_piece(
    kind: str,
    model: str,
    ident: str,
    text: str,
    token_ids: list[int],
    meta: dict | None,
    first: bool,
) -> dict:
    """One SSE event: incremental text and token ids; the last carries finish_reason and usage."""
    finish = meta.get("finish_reason") if meta else None
    if kind == "generate":
        piece = {"text": text, "output_ids": token_ids}
        if meta is not None:
            piece["meta_info"] = {"id": ident, **meta}
        return piece
    base = {"id": ident, "created": int(time.time()), "model": model}
    if kind == "completions":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        piece = {**base, "object": "text_completion", "choices": [choice]}
    else:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        piece = {**base, "object": "chat.completion.chunk", "choices": [choice]}
    if meta is not None:
        piece["usage"] = usage(meta)
    return piece


def error_body(message: str, status: int) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}
