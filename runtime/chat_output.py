"""A chat answer's text -> the message the client sees: `content`, and with the server's parsers
`reasoning_content` and `tool_calls`.

Text arrives in pieces (`feed`, then `finish` once the request ended) and leaves as OpenAI delta
objects; a whole answer is the same deltas merged (`merge_deltas`), so a streamed answer and a
whole one always agree.
"""

from __future__ import annotations


class ChatText:
    """No parser: every piece of text is content."""

    called = False
    """Whether a tool call was found."""

    def feed(self, text: str) -> list[dict]:
        return [{"content": text}] if text else []

    def finish(self) -> list[dict]:
        return []


def merge_deltas(deltas: list[dict]) -> dict:
    """Delta objects -> one assistant message (`content` None when there is none beside tool
    calls; a tool call's arguments are the concatenation of its pieces)."""
    content, reasoning, calls = [], [], {}
    for delta in deltas:
        content.append(delta.get("content") or "")
        reasoning.append(delta.get("reasoning_content") or "")
        for call in delta.get("tool_calls", []):
            slot = calls.setdefault(call["index"], {"function": {"arguments": ""}})
            if "id" in call:
                slot.update(id=call["id"], type="function")
            fn = call.get("function", {})
            if "name" in fn:
                slot["function"]["name"] = fn["name"]
            slot["function"]["arguments"] += fn.get("arguments", "")
    message = {"role": "assistant", "content": "".join(content)}
    if "".join(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
        message["content"] = message["content"] or None
    return message
