"""Request bodies of the HTTP API, checked and turned into one `GenerateInput`; the SGLang route.

`/generate` is SGLang's shape (`text` or `input_ids`, one or a list, `sampling_params`, `stream`,
the logprob fields); the OpenAI routes are parsed in `openai_protocol.py`. A body that does not fit
raises `BadRequest` with a message the client sees (HTTP 400; an unknown model is 404). The router
adds `bootstrap_host`, `bootstrap_port` and `bootstrap_room`. One HTTP request may start several
engine requests (a list of prompts, `n` choices each): `GenerateInput.parts` lists them, choice
`j` of prompt `i` at index `i * n + j`, each with its own rid and bootstrap room.

A streamed request may come with `shared_stream` too (`SharedStream`): the pair then shares
the client's stream, the prefill sending each part's first token's events and the decode the
rest, under one id.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web


class BadRequest(ValueError):
    """The client's request is malformed; HTTP `status` (400) with this message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class SharedStream:
    """A stream the router makes of two: the prefill's events of each request's first token
    (as soon as it is computed), then the decode's of the rest. Both answer under this id and
    creation time (the requests' rids: the id, or the id and the part's index)."""

    id: str
    created: int


@dataclass
class Bootstrap:
    host: str
    port: int
    room: int
    shared: SharedStream | None = None

    def room_of(self, index: int) -> int:
        """The room of the request at `index` (prefill and decode derive the same)."""
        return (self.room + index) % 2**63


@dataclass
class Prompt:
    text: str | None = None
    input_ids: list[int] | None = None


ROUTES = {"/generate": "generate", "/v1/completions": "completions", "/v1/chat/completions": "chat"}
"""The generation routes: path -> route name (`GenerateInput.route`, the metrics' endpoint)."""


@dataclass
class Part:
    """One engine request of an HTTP request."""

    index: int
    prompt: Prompt
    sampling: dict
    rid: str | None
    room: int | None


@dataclass
class GenerateInput:
    route: str  # "generate" | "completions" | "chat" (ROUTES)
    prompts: list[Prompt]
    sampling: list[dict]
    """Per prompt, in SGLang's names."""
    n: int = 1
    stream: bool = False
    rids: list[str] | None = None
    bootstrap: Bootstrap | None = None
    model: str | None = None
    batched: bool = False
    """/generate got a list of prompts (or n > 1): the answer is a list."""
    text_in_logprobs: bool = False
    """/generate: token texts beside the ids in the logprobs."""
    openai: object | None = None
    """`OpenAIOptions` of an OpenAI route."""

    def __post_init__(self) -> None:
        if self.bootstrap is not None and self.bootstrap.shared is not None:
            expect(self.stream, "shared_stream needs stream: true")

    @property
    def count(self) -> int:
        """Engine requests: prompts x n."""
        return len(self.prompts) * self.n

    @property
    def shared(self) -> SharedStream | None:
        """The stream this request shares with its pair's other instance, if any."""
        return self.bootstrap.shared if self.bootstrap else None

    def parts(self) -> list[Part]:
        parts = []
        for i, prompt in enumerate(self.prompts):
            for j in range(self.n):
                index = i * self.n + j
                sampling = dict(self.sampling[i])
                if j and sampling.get("seed") is not None:  # each choice its own draws
                    sampling["seed"] += j
                rid = self.rids[index] if self.rids else None
                if rid is None and self.shared:  # the same on both instances
                    rid = self.shared.id if self.count == 1 else f"{self.shared.id}-{index}"
                room = self.bootstrap.room_of(index) if self.bootstrap else None
                parts.append(Part(index, prompt, sampling, rid, room))
        return parts


BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
ROUTER_FIELDS = (*BOOTSTRAP_FIELDS, "shared_stream")
"""The fields the router sets (a client's are its to replace)."""


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise BadRequest(message)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def bootstrap(body: dict) -> Bootstrap | None:
    present = [k for k in BOOTSTRAP_FIELDS if body.get(k) is not None]
    if not present:
        expect(body.get("shared_stream") is None, "shared_stream needs the bootstrap fields")
        return None
    expect(len(present) == 3, f"give all of {', '.join(BOOTSTRAP_FIELDS)} or none")
    host, port, room = (body[k] for k in BOOTSTRAP_FIELDS)
    expect(isinstance(host, str) and 0 < len(host) < 256, "bootstrap_host must be a host name")
    expect(is_int(port) and 0 < port < 65536, "bootstrap_port must be a TCP port")
    expect(is_int(room) and 0 <= room < 2**63, "bootstrap_room must be an integer in [0, 2^63)")
    return Bootstrap(host, port, room, shared_stream(body.get("shared_stream")))


def shared_stream(value) -> SharedStream | None:
    if value is None:
        return None
    ok = isinstance(value, dict) and set(value) == {"id", "created"}
    expect(ok, "shared_stream must be an object of id and created")
    ident, created = value["id"], value["created"]
    ok_id = isinstance(ident, str) and 0 < len(ident) <= 64 and ident.isalnum()
    expect(ok_id, "shared_stream.id must be a short alphanumeric string")
    expect(is_int(created) and created >= 0, "shared_stream.created must be a Unix time")
    return SharedStream(ident, created)


def refuse_unknown(body: dict, known: set[str], where: str = "") -> None:
    extra = sorted(set(body) - known - set(ROUTER_FIELDS))
    expect(not extra, f"unknown field(s){where}: {', '.join(extra)} (not supported)")


def stream_flag(body: dict) -> bool:
    value = body.get("stream", False)
    expect(isinstance(value, bool), "stream must be true or false")
    return value


def choices(value, name: str = "n") -> int:
    expect(is_int(value) and 1 <= value <= 128, f"{name} must be an integer in [1, 128]")
    return value


def token_list(value) -> bool:
    """A non-empty list of integers (JSON's: of type int, a bool is none), checked in one pass in
    C: 16k token ids in 0.3 ms against 1.5 ms for an `is_int` call each (the router and every
    instance check each prompt)."""
    return isinstance(value, list) and bool(value) and {int}.issuperset(map(type, value))


def prompt_list(text, ids) -> tuple[list[Prompt], bool]:
    """SGLang's `text` / `input_ids` (one prompt or a list) as prompts, and whether a list came."""
    expect((text is None) != (ids is None), "give exactly one of text or input_ids")
    if text is not None:
        if isinstance(text, str):
            return [Prompt(text=text)], False
        expect(
            isinstance(text, list) and text and all(isinstance(t, str) for t in text),
            "text must be a string or a non-empty list of strings",
        )
        return [Prompt(text=t) for t in text], True
    if token_list(ids):
        return [Prompt(input_ids=ids)], False
    expect(
        isinstance(ids, list) and ids and all(token_list(x) for x in ids),
        "input_ids: a prompt must be a list of token ids, or a list of such lists",
    )
    return [Prompt(input_ids=x) for x in ids], True


GENERATE_FIELDS = {
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "rid",
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
    "return_text_in_logprobs",
}


def parse_generate(body: dict) -> GenerateInput:
    refuse_unknown(body, GENERATE_FIELDS)
    prompts, listed = prompt_list(body.get("text"), body.get("input_ids"))
    sampling = _per_prompt(body.get("sampling_params"), len(prompts), "sampling_params")
    n = _same_n(sampling)
    for name in ("return_logprob", "top_logprobs_num", "logprob_start_len"):
        values = _per_prompt_value(body.get(name), len(prompts), name)
        for params, value in zip(sampling, values):
            if value is not None:
                params[name] = value
    text_in = body.get("return_text_in_logprobs", False)
    expect(isinstance(text_in, bool), "return_text_in_logprobs must be true or false")
    count = len(prompts) * n
    return GenerateInput(
        "generate",
        prompts,
        sampling,
        n=n,
        stream=stream_flag(body),
        rids=_rids(body.get("rid"), count),
        bootstrap=bootstrap(body),
        batched=listed or n > 1,
        text_in_logprobs=text_in,
    )


def _per_prompt(value, count: int, name: str) -> list[dict]:
    """An object for every prompt, or a list of one per prompt (copies: each is changed)."""
    if value is None:
        return [{} for _ in range(count)]
    if isinstance(value, dict):
        return [dict(value) for _ in range(count)]
    expect(
        isinstance(value, list) and len(value) == count and all(isinstance(v, dict) for v in value),
        f"{name} must be an object, or a list of one per prompt ({count})",
    )
    return [dict(v) for v in value]


def _per_prompt_value(value, count: int, name: str) -> list:
    if isinstance(value, list):
        expect(len(value) == count, f"{name}: give one value, or one per prompt ({count})")
        return value
    return [value] * count


def _same_n(sampling: list[dict]) -> int:
    values = {choices(p.pop("n", 1), "sampling_params.n") for p in sampling}
    expect(len(values) == 1, "sampling_params.n must be the same for every prompt")
    return values.pop()


def _rids(value, count: int) -> list[str] | None:
    if value is None:
        return None
    values = [value] if isinstance(value, str) else value
    expect(
        isinstance(values, list) and all(isinstance(r, str) and 0 < len(r) <= 128 for r in values),
        "rid must be a short string or a list of them",
    )
    if len(values) == 1 and count > 1:
        return [f"{values[0]}-{i}" for i in range(count)]
    expect(len(values) == count, f"rid: give one, or one per request ({count})")
    expect(len(set(values)) == count, "rid: the ids must differ")
    return values


def error_body(message: str, status: int) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 404:
        kind = "NotFoundError"
    return {"error": {"message": message, "type": kind, "code": status}}


class EventStream(web.StreamResponse):
    """A server-sent event stream (the instances' streamed answers, the router's relay of them)
    whose headers leave with its first event, in one write. Sent apart, the send between them
    let the engine thread take the GIL, and the first event waited for it (2-core CPU host:
    0.5 ms of the time to first token). aiohttp 3.12 on reads the flag; an older one sends the
    headers at once."""

    HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    _send_headers_immediately = False
