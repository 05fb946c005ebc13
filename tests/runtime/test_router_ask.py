"""`router_tries.Ask`: the bodies a router's tries send, made from the client's bytes where they
can be (no second serialization of a long prompt) and checked once."""

from __future__ import annotations

import orjson

from dserve.runtime.router_tries import Ask, Failure

BOOT = {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 7}


def ask_of(raw: bytes, checker=lambda: None) -> Ask:
    return Ask("/generate", orjson.loads(raw), raw, 0.0, checker)


def test_a_shared_body_is_the_clients_bytes_and_the_routers_fields():
    raw = b' { "input_ids": [1, 2, 3],\n "stream": true } \n'
    sent = ask_of(raw).shared_body({**BOOT, "shared_stream": {"id": "x"}})
    assert sent.startswith(orjson.dumps(BOOT)[:-1])  # the router's fields, then the client's
    assert orjson.loads(sent) == {
        "input_ids": [1, 2, 3],
        "stream": True,
        **BOOT,
        "shared_stream": {"id": "x"},
    }


def test_a_clients_own_router_fields_are_replaced_not_repeated():
    client = {"text": "a", "stream": True, "stream_options": {"include_usage": True}}
    raw = orjson.dumps({**client, "bootstrap_room": 99, "shared_stream": {"id": "theirs"}})
    sent = ask_of(raw).shared_body({**BOOT, "shared_stream": {"id": "ours"}})
    assert sent.count(b"bootstrap_room") == 1 and sent.count(b"shared_stream") == 1
    assert orjson.loads(sent) == {**client, **BOOT, "shared_stream": {"id": "ours"}}


def test_an_empty_body_and_the_rest_without_own_fields():
    assert orjson.loads(ask_of(b"{ }").shared_body(BOOT)) == BOOT
    request = ask_of(orjson.dumps({"text": "a", "stream": True, "bootstrap_port": 5, "rid": "r"}))
    assert orjson.loads(request.rest()) == {"text": "a", "rid": "r"}


def test_the_check_runs_once_and_a_bad_body_is_a_400():
    calls = []

    def bad():
        calls.append(1)
        raise ValueError("stream must be true or false")

    request = ask_of(b'{"text": "a"}', bad)
    failure = request.check()
    assert isinstance(failure, Failure) and failure.status == 400 and not failure.retry
    assert "stream" in failure.message
    assert request.check() is None and calls == [1]
